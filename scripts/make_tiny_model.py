"""Builds the tiny demo model shipped in hybridrl/assets/tiny-arith, with hybridrl's own SFT.

A character-level Qwen2 model is initialised at random and fine-tuned on 2-digit addition
until its greedy held-out accuracy first reaches --target (default 0.25): partly trained, so
that RL has room to show. Run from the repository root:

    python scripts/make_tiny_model.py [--out hybridrl/assets/tiny-arith]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

from hybridrl import RolloutEngine, TrainerEngine
from hybridrl.config import Config
from hybridrl.data import arith_sft_rows, make_arith_rows
from hybridrl.models.tiny import build_char_tokenizer, build_tiny_qwen2


def greedy_accuracy(engine: RolloutEngine, rows: list[dict]) -> float:
    samples = engine.generate([r["prompt"] for r in rows], n=1, max_tokens=6, temperature=0.0)
    return sum(s.response.strip() == r["ground_truth"] for s, r in zip(samples, rows)) / len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="hybridrl/assets/tiny-arith")
    ap.add_argument("--target", type=float, default=0.25, help="stop once held-out greedy accuracy reaches this")
    ap.add_argument("--max-steps", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3, help="SFT learning rate")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen2(tokenizer, seed=args.seed)
    engine = RolloutEngine(model, tokenizer, backend="hf")

    train_rows = arith_sft_rows(make_arith_rows(20000, seed=args.seed, split="train"), tokenizer.eos_token)
    # Held-out problems for the stopping rule; the demo evaluates on another seed's test draw.
    heldout = make_arith_rows(300, seed=args.seed + 1, split="test")

    cfg = Config()
    cfg.algorithm.name = "sft"
    cfg.train.total_steps = args.max_steps
    cfg.train.batch_size = 64
    cfg.train.micro_batch_size = 64
    cfg.train.lr = args.lr
    cfg.train.warmup_steps = 50
    cfg.train.seed = args.seed
    cfg.trainer.save_every = 0
    cfg.trainer.progress = True
    work = Path(tempfile.mkdtemp(prefix="tiny-sft-"))
    cfg.trainer.output_dir = str(work)
    cfg.trainer.resume = "off"
    trainer = TrainerEngine(actor=engine, config=cfg)

    def stop_when(record: dict) -> bool:
        if record["step"] % 50:
            return False
        acc = greedy_accuracy(engine, heldout)
        print(f"step {record['step']}: sft loss {record['sft/loss']:.4f}, held-out greedy accuracy {acc:.3f}", flush=True)
        return acc >= args.target

    trainer.fit(train_rows, stop_when=stop_when)
    acc = greedy_accuracy(engine, heldout)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    shutil.rmtree(work, ignore_errors=True)
    size = sum(p.stat().st_size for p in out.iterdir()) / 1e6
    print(f"saved {out} ({size:.1f} MB), held-out greedy accuracy {acc:.3f}")


if __name__ == "__main__":
    main()
