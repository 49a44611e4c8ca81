"""RLHF on the tiny arithmetic model, on CPU, end to end: SFT -> reward model -> PPO against it.

    .venv/bin/python examples/rlhf/run.py              # the full run (about 5 minutes on 2 cores)
    .venv/bin/python examples/rlhf/run.py --smoke      # two steps per stage: checks the pipeline

1. SFT (sft.yaml): the shipped tiny model (partly trained on purpose) trained on correct answers.
2. Reward model (rm.yaml): the SFT model with a scalar head, Bradley-Terry loss on synthetic
   preferences where the correct answer is always chosen. Rejected: a plausible wrong answer
   (`make_arith_preference_rows`: digits swapped, or off by 1-3), a malformed one (a digit dropped
   or added, a random number), and the SFT model's own wrong samples; the true answer plays the
   human labeller. With plausible wrong answers alone the reward model reaches 0.9 on them but
   has never seen the policy's mistakes (mostly a wrong carry in the tens digit), and PPO soon
   finds answers it scores highly ("4" for 46+2=, 178 for 72+98=).
3. PPO with a critic (ppo.yaml), from the SFT model, against the learned reward model alone (PPO
   never sees the answers), with a KL penalty to the SFT policy in the reward.

It prints the reward model's held-out pairwise accuracy (on plausible wrong answers), and the
learned reward and true held-out greedy accuracy (the `arith` scorer) before and after PPO. The
three configs are ordinary `hybridrl train` configs; this script passes them the paths under
--out and writes the data, including the SFT model's mistakes, which need the SFT model.
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
from hybridrl.rollout import RolloutEngine

HERE = Path(__file__).resolve().parent
TINY_MODEL = HERE.parents[1] / "hybridrl" / "assets" / "tiny-arith"
MALFORMED_SHARE = 0.25  # share of training prompts that also get a malformed wrong answer
POLICY_PROMPTS = 2000  # training prompts the SFT model answers (4 samples each) for its own wrong answers
SMOKE = ["train.total_steps=2", "trainer.save_every=2", "trainer.eval_samples=16", "trainer.progress=false"]


# ---- data ------------------------------------------------------------------------------------
def malformed_answer(answer: str, rng: np.random.Generator) -> str:
    """A wrong answer of the wrong shape: a digit dropped or added, or a random number."""
    while True:
        kind, digits = int(rng.integers(3)), list(answer)
        if kind == 0 and len(digits) > 1:
            del digits[int(rng.integers(len(digits)))]
        elif kind == 1:
            digits.insert(int(rng.integers(len(digits) + 1)), str(int(rng.integers(10))))
        else:
            digits = list(str(int(rng.integers(1000))))
        wrong = "".join(digits)
        if wrong.lstrip("0") != answer.lstrip("0"):
            return wrong


def synthetic_preferences(rows: list[dict], seed: int, malformed_share: float) -> list[dict]:
    """The correct answer chosen over a plausible wrong one; for a share of prompts, also over a malformed one."""
    rng = np.random.default_rng(seed)
    malformed = [{"prompt": r["prompt"], "chosen": r["ground_truth"], "rejected": malformed_answer(r["ground_truth"], rng)}
                 for r in rows if rng.random() < malformed_share]
    return make_arith_preference_rows(rows, seed=seed) + malformed


def policy_preferences(model_dir: Path, rows: list[dict], seed: int, n: int = 4) -> list[dict]:
    """The correct answer chosen over each distinct wrong answer the model samples (temperature 1)."""
    engine = RolloutEngine.from_hf(str(model_dir), backend="hf", device="cpu")
    samples = engine.generate([r["prompt"] for r in rows], n=n, max_tokens=6, temperature=1.0, seed=seed)
    pairs: dict[tuple[str, str], dict] = {}
    for s in samples:
        row = rows[s.prompt_index]
        if s.response.strip() and s.response.strip() != row["ground_truth"]:
            pairs[row["prompt"], s.response] = {"prompt": row["prompt"], "chosen": row["ground_truth"], "rejected": s.response}
    return list(pairs.values())


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def write_data(out: Path, num_train: int, num_test: int) -> dict[str, Path]:
    """SFT rows, synthetic preference pairs (held-out: plausible wrong answers only), prompts for PPO."""
    train = {name: make_arith_rows(num_train, seed=seed, split="train") for seed, name in enumerate(("sft", "rm", "ppo"))}
    test = {name: make_arith_rows(num_test, seed=seed, split="test") for seed, name in enumerate(("sft", "rm", "ppo"))}
    return {
        "sft/train": write_rows(out / "sft" / "train.jsonl", arith_sft_rows(train["sft"], EOS_TOKEN)),
        "sft/test": write_rows(out / "sft" / "test.jsonl", arith_sft_rows(test["sft"], EOS_TOKEN)),
        "preference/train": write_rows(out / "preference" / "train.jsonl", synthetic_preferences(train["rm"], 1, MALFORMED_SHARE)),
        "preference/test": write_rows(out / "preference" / "test.jsonl", make_arith_preference_rows(test["rm"], seed=1)),
        "prompts/train": write_rows(out / "prompts" / "train.jsonl", train["ppo"]),
        "prompts/test": write_rows(out / "prompts" / "test.jsonl", test["ppo"]),
    }


# ---- stages ----------------------------------------------------------------------------------
def stage_config(config: str, overrides: list[str]):
    """The stage's config, its output directory emptied: this script starts every stage over, so an
    earlier run's outputs are removed rather than set aside in superseded-*/ as trainer.resume=off would."""
    cfg = load_config(HERE / config, overrides)
    shutil.rmtree(cfg.trainer.output_dir, ignore_errors=True)
    return cfg


def run_stage(config: str, overrides: list[str]) -> dict:
    return build_trainer(stage_config(config, overrides)).fit()


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
    num_train, num_test = (64, 16) if args.smoke else (5000, 200)
    data = write_data(out / "data", num_train, num_test)
    common = ["trainer.resume=off", *(SMOKE if args.smoke else [])]
    figures: dict = {}

    sft = run_stage("sft.yaml", [f"model.path={TINY_MODEL}", f"data.train_path={data['sft/train']}",
                                 f"data.eval_path={data['sft/test']}", f"trainer.output_dir={out / 'sft'}", *common])
    sft_model = export(sft, out / "sft-model")
    figures["sft_loss"] = [sft["eval_before"]["loss"], sft["eval_after"]["loss"]]
    print(f"[sft] held-out loss {figures['sft_loss'][0]:.3f} -> {figures['sft_loss'][1]:.3f}")

    prompts = make_arith_rows(16 if args.smoke else POLICY_PROMPTS, seed=3, split="train")
    own_mistakes = policy_preferences(sft_model, prompts, seed=3)
    preference_train = write_rows(out / "data" / "preference" / "train_with_samples.jsonl",
                                  json_rows(data["preference/train"]) + own_mistakes)
    rm = run_stage("rm.yaml", [f"model.path={sft_model}", f"data.train_path={preference_train}",
                               f"data.eval_path={data['preference/test']}", f"trainer.output_dir={out / 'rm'}", *common])
    reward_model = export(rm, out / "reward-model")
    figures["rm_pairs"] = {"synthetic": len(json_rows(data["preference/train"])), "sft_model_mistakes": len(own_mistakes)}
    figures["rm_accuracy"] = rm["eval_after"]["accuracy"]
    print(f"[rm] {figures['rm_pairs']} training pairs; held-out pairwise accuracy {figures['rm_accuracy']:.3f}")

    cfg = stage_config("ppo.yaml", [
        f"model.path={sft_model}", f"model.reward_model_path={reward_model}", f"data.train_path={data['prompts/train']}",
        f"data.eval_path={data['prompts/test']}", f"trainer.output_dir={out / 'ppo'}", *common])
    trainer = build_trainer(cfg)
    learned = RewardEngine.from_hf(str(reward_model), offload=False, device="cpu")
    before = greedy_figures(trainer, data["prompts/test"], num_test, learned)
    trainer.fit()
    after = greedy_figures(trainer, data["prompts/test"], num_test, learned)
    figures["learned_reward"] = [before[1], after[1]]
    figures["true_accuracy"] = [before[0], after[0]]
    figures["minutes"] = (time.perf_counter() - start) / 60
    print(f"[ppo] learned reward of greedy answers {before[1]:+.3f} -> {after[1]:+.3f}")
    print(f"[ppo] true held-out greedy accuracy {before[0]:.3f} -> {after[0]:.3f} ({after[0] - before[0]:+.3f}) "
          f"after {cfg.train.total_steps} steps")
    print(f"total {figures['minutes']:.1f} min; figures in {out / 'figures.json'}")
    (out / "figures.json").write_text(json.dumps(figures, indent=1), encoding="utf-8")
    return figures


def json_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


if __name__ == "__main__":
    main()
