"""RLHF on the tiny arithmetic model, on CPU, end to end: SFT -> reward model -> PPO against it.

    .venv/bin/python examples/rlhf/run.py              # the full run (minutes on 2 cores)
    .venv/bin/python examples/rlhf/run.py --smoke      # two steps per stage: checks the pipeline

Each stage is one of the configs beside this file, so the same run works from the command line:

    hybridrl make-data arith-sft runs/rlhf/data/sft
    hybridrl make-data arith-preference runs/rlhf/data/preference
    hybridrl make-data arith runs/rlhf/data/prompts
    hybridrl train examples/rlhf/sft.yaml && hybridrl export runs/rlhf/sft/checkpoints runs/rlhf/sft-model
    hybridrl train examples/rlhf/rm.yaml  && hybridrl export runs/rlhf/rm/checkpoints runs/rlhf/reward-model
    hybridrl train examples/rlhf/ppo.yaml

PPO never sees the true answers: its only reward is the learned reward model's score. This script
also measures what PPO cannot: the true held-out greedy accuracy (the `arith` scorer) before and
after, next to the reward model's held-out pairwise accuracy and the learned reward.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np

from hybridrl.checkpoint import export_checkpoint
from hybridrl.cli.commands import build_trainer
from hybridrl.config import load_config
from hybridrl.data import arith_sft_rows, load_prompt_dataset, make_arith_preference_rows, make_arith_rows
from hybridrl.models.tiny import EOS_TOKEN
from hybridrl.reward import RewardEngine

HERE = Path(__file__).resolve().parent
TINY_MODEL = HERE.parents[1] / "hybridrl" / "assets" / "tiny-arith"
MALFORMED_SHARE = 0.5  # training prompts that also get a malformed wrong answer
SMOKE = ["train.total_steps=2", "trainer.save_every=2", "trainer.eval_samples=16", "trainer.progress=false"]


def malformed_answer(answer: str, rng: np.random.Generator) -> str:
    """A wrong answer of the wrong shape, unlike make_arith_preference_rows' plausible ones: a digit
    dropped or added, or a random number. Without these the reward model has never seen a short
    answer, and PPO learns to answer "4" to 46+2= (a classic reward hack)."""
    while True:
        kind, digits = int(rng.integers(3)), list(answer)
        if kind == 0 and len(digits) > 1:
            del digits[int(rng.integers(len(digits)))]
        elif kind == 1:
            digits.insert(int(rng.integers(len(digits) + 1)), str(int(rng.integers(10))))
        else:
            digits = list(str(int(rng.integers(1000))))
        wrong = "".join(digits)
        if wrong != answer and wrong.lstrip("0") != answer:
            return wrong


def preference_rows(rows: list[dict], seed: int, malformed_share: float) -> list[dict]:
    """Correct answer chosen; rejected: a plausible wrong answer, plus a malformed one for a share of the prompts."""
    rng = np.random.default_rng(seed)
    extra = [{"prompt": r["prompt"], "chosen": r["ground_truth"], "rejected": malformed_answer(r["ground_truth"], rng)}
             for r in rows if rng.random() < malformed_share]
    out = make_arith_preference_rows(rows, seed=seed) + extra
    rng.shuffle(out)
    return out


def write_data(out: Path, num_train: int, num_test: int) -> dict[str, Path]:
    """The three datasets: SFT rows, preference pairs (correct answer chosen), prompts for PPO.
    Held-out pairs are plausible wrong answers only: the harder test."""
    transforms = {
        "sft": lambda rows, seed, split: arith_sft_rows(rows, EOS_TOKEN),
        "preference": lambda rows, seed, split: preference_rows(rows, seed, MALFORMED_SHARE if split == "train" else 0.0),
        "prompts": lambda rows, seed, split: rows,
    }
    paths = {}
    for seed, (name, transform) in enumerate(transforms.items()):
        (out / name).mkdir(parents=True, exist_ok=True)
        for split, num in (("train", num_train), ("test", num_test)):
            rows = transform(make_arith_rows(num, seed=seed, split=split), seed, split)
            path = paths[f"{name}/{split}"] = out / name / f"{split}.jsonl"
            path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return paths


def run_stage(config: str, overrides: list[str]) -> dict:
    return build_trainer(load_config(HERE / config, overrides)).fit()


def export(summary: dict, out: Path) -> Path:
    shutil.rmtree(out, ignore_errors=True)
    return export_checkpoint(summary["checkpoint"], out)


def greedy_figures(trainer, prompts_path: Path, num: int, learned: RewardEngine) -> tuple[float, float]:
    """(true accuracy, mean learned reward) of greedy answers to held-out prompts: the true answers,
    which PPO's reward never sees, and the reward model's raw score (not normalised)."""
    prompts = load_prompt_dataset(prompts_path, trainer.tokenizer)[:num]
    samples = trainer.rollout.generate([p.prompt_ids for p in prompts], n=1, max_tokens=trainer.config.rollout.max_tokens,
                                       temperature=0.0)
    texts = [s.prompt for s in samples], [s.response for s in samples]
    truth = RewardEngine.from_builtin("arith").score(*texts, {"ground_truth": [p.columns["ground_truth"] for p in prompts]})
    return sum(truth.scores) / num, sum(learned.score(*texts).scores) / num


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/rlhf", help="everything is written here (a run starts over)")
    ap.add_argument("--smoke", action="store_true", help="two steps per stage, small data")
    args = ap.parse_args(argv)
    out = Path(args.out)
    start = time.perf_counter()
    num_test = 16 if args.smoke else 200
    data = write_data(out / "data", num_train=64 if args.smoke else 5000, num_test=num_test)
    common = ["trainer.resume=off", *(SMOKE if args.smoke else [])]
    figures: dict = {}

    sft = run_stage("sft.yaml", [
        f"model.path={TINY_MODEL}", f"data.train_path={data['sft/train']}", f"data.eval_path={data['sft/test']}",
        f"trainer.output_dir={out / 'sft'}", *common])
    sft_model = export(sft, out / "sft-model")
    figures["sft_loss"] = [sft["eval_before"]["loss"], sft["eval_after"]["loss"]]
    print(f"[sft] held-out loss {figures['sft_loss'][0]:.3f} -> {figures['sft_loss'][1]:.3f} -> {sft_model}")

    rm = run_stage("rm.yaml", [
        f"model.path={sft_model}", f"data.train_path={data['preference/train']}",
        f"data.eval_path={data['preference/test']}", f"trainer.output_dir={out / 'rm'}", *common])
    reward_model = export(rm, out / "reward-model")
    figures["rm_accuracy"] = [rm["eval_before"]["accuracy"], rm["eval_after"]["accuracy"]]
    print(f"[rm] held-out pairwise accuracy {figures['rm_accuracy'][0]:.3f} -> {figures['rm_accuracy'][1]:.3f} "
          f"-> {reward_model}")

    ppo_overrides = [
        f"model.path={sft_model}", f"model.reward_model_path={reward_model}", f"data.train_path={data['prompts/train']}",
        f"data.eval_path={data['prompts/test']}", f"trainer.output_dir={out / 'ppo'}", *common]
    cfg = load_config(HERE / "ppo.yaml", ppo_overrides)
    ppo_trainer = build_trainer(cfg)
    learned = RewardEngine.from_hf(str(reward_model), offload=False, device="cpu")
    before = greedy_figures(ppo_trainer, data["prompts/test"], num_test, learned)
    ppo_trainer.fit()
    after = greedy_figures(ppo_trainer, data["prompts/test"], num_test, learned)
    figures["true_accuracy"] = [before[0], after[0]]
    figures["learned_reward"] = [before[1], after[1]]
    figures["minutes"] = (time.perf_counter() - start) / 60
    print(f"[ppo] learned reward of greedy answers {before[1]:+.3f} -> {after[1]:+.3f}")
    print(f"[ppo] true held-out greedy accuracy {before[0]:.3f} -> {after[0]:.3f} ({after[0] - before[0]:+.3f}) "
          f"after {cfg.train.total_steps} steps")
    print(f"total {figures['minutes']:.1f} min; figures in {out / 'figures.json'}")
    (out / "figures.json").write_text(json.dumps(figures, indent=1), encoding="utf-8")
    return figures


if __name__ == "__main__":
    main()
