"""Learning per wall-clock second on CPU: hybridrl and TRL 1.16 `GRPOTrainer` on the same tiny model.

    python bench/tiny_learning.py                    # 120 s of training each, 2 threads
    python bench/tiny_learning.py --budget 300 --json out.json

BENCHMARK.md's W-tiny: the shipped tiny character-level model (hybridrl/assets/tiny-arith) on
2-digit addition. Both systems run GRPO with the demo's settings (hybridrl/assets/arith_grpo.yaml):
8 prompts x 8 samples per step, at most 6 new tokens, temperature 1.0, lr 1e-4 with 5 warmup steps
then constant, clip 0.2 / 0.28, no KL, grad clip 1.0, fp32, no gradient checkpointing, 2 threads,
the same reward (hybridrl's `arith` scorer). Each runs in its own process for `--budget` seconds of
training time (the sum of its step times; evaluation is not counted), and is evaluated by the same
code at the same marks: greedy held-out accuracy on 200 problems with transformers `generate`.
TRL and `datasets` are optional: without them only hybridrl runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = ROOT / "hybridrl" / "assets" / "tiny-arith"
DEMO_CONFIG = ROOT / "hybridrl" / "assets" / "arith_grpo.yaml"
MAX_NEW_TOKENS = 6


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[dict]) -> float:
    """Fraction of `rows` whose greedy answer the `arith` scorer marks correct (prompts grouped by
    length, so no padding is needed)."""
    from hybridrl.reward.scorers import arith

    was_training = model.training
    model.eval()
    by_len: dict[int, list[dict]] = {}
    for row in rows:
        by_len.setdefault(len(tokenizer(row["prompt"], add_special_tokens=False).input_ids), []).append(row)
    correct = 0
    for group in by_len.values():
        ids = torch.tensor([tokenizer(r["prompt"], add_special_tokens=False).input_ids for r in group])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        responses = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
        scores = arith([r["prompt"] for r in group], responses, [r["ground_truth"] for r in group])
        correct += sum(s >= 1.0 for s in scores)
    model.train(was_training)
    return correct / len(rows)


class Clock:
    """Training seconds so far, and the marks at which to evaluate."""

    def __init__(self, marks: list[float], evaluate):
        self.elapsed = 0.0
        self.pending = sorted(marks)
        self.evaluate = evaluate
        self.curve: list[dict] = [{"train_s": 0.0, "steps": 0, "accuracy": evaluate()}]

    def after_step(self, step_s: float, steps: int) -> bool:
        """Adds a step's time; evaluates at every mark passed. True when the last mark is passed."""
        self.elapsed += step_s
        while self.pending and self.elapsed >= self.pending[0]:
            self.pending.pop(0)
            self.curve.append({"train_s": self.elapsed, "steps": steps, "accuracy": self.evaluate()})
        return not self.pending


def run_hybridrl(data: dict[str, Path], marks: list[float], eval_rows: list[dict], work: Path, overrides: list[str]) -> dict:
    from hybridrl.cli.commands import build_trainer
    from hybridrl.config import load_config

    cfg = load_config(DEMO_CONFIG, [
        f"model.path={TINY_MODEL}", f"data.train_path={data['train']}", f"data.eval_path={data['test']}",
        f"trainer.output_dir={work / 'hybridrl'}", "trainer.eval_every=0", "trainer.save_every=0",
        "trainer.progress=false", "trainer.resume=off", "train.total_steps=1000000",
        "train.device=cpu", "model.dtype=float32",  # W-tiny is a CPU workload in fp32, as TRL's side runs it
        *overrides,
    ])  # fmt: skip
    trainer = build_trainer(cfg)
    clock = Clock(marks, lambda: greedy_accuracy(trainer.model, trainer.tokenizer, eval_rows))
    trainer.fit(stop_when=lambda record: clock.after_step(record["timing/step"], record["step"]))
    return {"curve": clock.curve, "steps": trainer.step, "s_per_step": clock.elapsed / max(1, trainer.step)}


def run_trl(data: dict[str, Path], marks: list[float], eval_rows: list[dict], work: Path, overrides: list[str]) -> dict:
    import transformers
    import trl
    from datasets import Dataset

    from hybridrl.models import load_tokenizer
    from hybridrl.reward.scorers import arith

    def reward(prompts, completions, ground_truth, **kwargs):
        return arith(prompts, completions, ground_truth)

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if clock.after_step(time.perf_counter() - self.t0, state.global_step):
                control.should_training_stop = True

    rows = [json.loads(line) for line in Path(data["train"]).read_text().splitlines()]
    tokenizer = load_tokenizer(str(TINY_MODEL))
    args = trl.GRPOConfig(
        output_dir=str(work / "trl"), max_steps=1_000_000, learning_rate=1e-4, warmup_steps=5,
        lr_scheduler_type="constant_with_warmup", beta=0.0, epsilon=0.2, epsilon_high=0.28, max_grad_norm=1.0,
        num_generations=8, per_device_train_batch_size=64, gradient_accumulation_steps=1,
        max_completion_length=MAX_NEW_TOKENS, temperature=1.0, use_cpu=True, bf16=False,
        gradient_checkpointing=False, report_to="none", save_strategy="no", logging_steps=50,
        disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(model=str(TINY_MODEL), reward_funcs=reward, args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_list(rows), callbacks=[Timer()])  # fmt: skip
    clock = Clock(marks, lambda: greedy_accuracy(trainer.model, tokenizer, eval_rows))
    trainer.train()
    steps = trainer.state.global_step
    return {"version": trl.__version__, "curve": clock.curve, "steps": steps, "s_per_step": clock.elapsed / max(1, steps)}


def worker(system: str, out: Path, data_dir: Path, marks: list[float], threads: int, overrides: list[str]) -> None:
    torch.set_num_threads(threads)
    data = {"train": data_dir / "train.jsonl", "test": data_dir / "test.jsonl"}
    eval_rows = [json.loads(line) for line in data["test"].read_text().splitlines()][:200]
    with tempfile.TemporaryDirectory() as tmp:
        runner = run_hybridrl if system == "hybridrl" else run_trl
        out.write_text(json.dumps(runner(data, marks, eval_rows, Path(tmp), overrides)))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=120.0, help="seconds of training per system")
    ap.add_argument("--marks", type=str, default=None, help="comma-separated evaluation times (s); default: 6 points up to --budget")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="hybridrl config override (repeatable)")
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--worker", choices=["hybridrl", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--data-dir", type=str, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", type=str, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    marks = [float(m) for m in args.marks.split(",")] if args.marks else [args.budget * f for f in (1 / 8, 1 / 4, 1 / 2, 3 / 4, 1)]
    if args.worker:
        worker(args.worker, Path(args.worker_out), Path(args.data_dir), marks, args.threads, args.set)
        return {}

    from hybridrl.data import write_arith_dataset

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_arith_dataset(Path(tmp) / "data", num_train=5000, num_test=200, seed=0)  # the demo's data
        systems = ["hybridrl"]
        if not args.skip_trl:
            try:
                import datasets  # noqa: F401
                import trl  # noqa: F401

                systems.append("trl")
            except ImportError as e:
                results["trl"] = {"skipped": f"trl / datasets not installed ({e})"}
        for system in systems:  # one process each: own threads, RNG and allocator
            out = Path(tmp) / f"{system}.json"
            cmd = [sys.executable, __file__, "--worker", system, "--data-dir", str(Path(data["train"]).parent),
                   "--worker-out", str(out), "--threads", str(args.threads), "--marks", ",".join(map(str, marks))]  # fmt: skip
            cmd += [f"--set={item}" for item in args.set]
            proc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            results[system] = json.loads(out.read_text()) if proc.returncode == 0 else {"error": f"exit status {proc.returncode}"}
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


def print_table(results: dict) -> None:
    print("\nheld-out greedy accuracy (200 problems) after t seconds of training, 2-digit addition, tiny-arith\n")
    for name, r in results.items():
        if "curve" not in r:
            print(f"{name}: not run: {r.get('skipped') or r.get('error')}")
            continue
        label = f"TRL {r['version']} GRPOTrainer" if name == "trl" else "hybridrl"
        points = ", ".join(f"{p['train_s']:.0f} s: {p['accuracy']:.3f}" for p in r["curve"])
        print(f"{label}: {r['s_per_step']:.3f} s/step, {r['steps']} steps | {points}")


if __name__ == "__main__":
    main()
