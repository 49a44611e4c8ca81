"""`hybridrl demo`: GRPO on the tiny arithmetic model, on CPU, in a few minutes.

It writes the arithmetic task, evaluates the shipped tiny model's greedy held-out accuracy,
trains with the config in hybridrl/assets/arith_grpo.yaml, and prints the accuracy after.
"""

from __future__ import annotations

import time
from pathlib import Path

import hybridrl
from hybridrl.config import load_config

ASSETS = Path(hybridrl.__file__).parent / "assets"
TINY_MODEL = ASSETS / "tiny-arith"
DEMO_CONFIG = ASSETS / "arith_grpo.yaml"


def demo(output_dir: str, *, steps: int | None = None, algorithm: str = "grpo") -> int:
    from hybridrl.cli.commands import build_trainer
    from hybridrl.data import write_arith_dataset

    out = Path(output_dir)
    data = write_arith_dataset(out / "data", num_train=5000, num_test=200, seed=0)
    overrides = [
        f"model.path={TINY_MODEL}",
        f"data.train_path={data['train']}",
        f"data.eval_path={data['test']}",
        f"trainer.output_dir={out}",
        f"algorithm.name={algorithm}",
    ]
    if steps is not None:
        overrides.append(f"train.total_steps={steps}")
    cfg = load_config(DEMO_CONFIG, overrides)
    print(f"hybridrl demo: {algorithm} on {TINY_MODEL.name} (a {cfg.model.path and 'tiny character-level Qwen2'}), "
          f"{cfg.train.total_steps} steps of {cfg.train.batch_size // cfg.rollout.n} prompts x {cfg.rollout.n} samples, on CPU")
    start = time.perf_counter()
    trainer = build_trainer(cfg)
    summary = trainer.fit()
    elapsed = time.perf_counter() - start
    before, after = summary["eval_before"]["accuracy"], summary["eval_after"]["accuracy"]
    print()
    print(f"held-out greedy accuracy: {before:.3f} -> {after:.3f} ({after - before:+.3f}) in {elapsed:.0f} s")
    print(f"metrics:     {summary['metrics']}  (one JSON record per step)")
    print(f"checkpoints: {out / 'checkpoints'}  (latest: {summary['checkpoint']})")
    print(f"resume:      run the same command again; export: hybridrl export {out / 'checkpoints'} my-model")
    return 0
