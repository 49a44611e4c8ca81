"""What `hybridrl train` and `hybridrl make-data` do, through the public API only."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Sequence

from hybridrl.config import Config, algorithm_spec, load_config


def build_trainer(cfg: Config):
    """The engines a config describes: rollout (with the policy), reward, trainer."""
    from hybridrl import RolloutEngine, TrainerEngine
    from hybridrl.models import resolve_device
    from hybridrl.trainer.engine import reward_from_config, set_determinism, set_host_threads

    # Before loading, so that it runs with the threads and kernels the step will have (TrainerEngine sets the same).
    set_host_threads(cfg.train.num_threads, resolve_device(cfg.train.device))
    set_determinism(cfg.train.deterministic)
    m, r = cfg.model, cfg.rollout
    if cfg.algorithm.name == "rm":  # a reward model is a sequence classifier started from model.path, not a generator
        from hybridrl.reward.model import TrainableRewardModel

        actor = TrainableRewardModel.from_hf(m.path, dtype=m.dtype, device=str(resolve_device(cfg.train.device)),
                                             trust_remote_code=m.trust_remote_code, chat_template=m.chat_template)
        return TrainerEngine(actor=actor, config=cfg)
    actor = RolloutEngine.from_hf(
        m.path, backend=r.backend, dtype=m.dtype, device=str(resolve_device(cfg.train.device)),
        attn_implementation=m.attn_implementation, trust_remote_code=m.trust_remote_code, chat_template=m.chat_template,
        native_options={"kv_cache_fraction": r.kv_cache_fraction, "fp32_residual": r.fp32_residual,
                        "shared_prefix_attention": r.shared_prefix_attention, "tuned_products": r.tuned_products,
                        "step_ahead": None if r.step_ahead else False},
    )
    reward = None
    if algorithm_spec(cfg.algorithm.name).kind == "rl":
        reward = reward_from_config(cfg)
    return TrainerEngine(actor=actor, reward_fn=reward, config=cfg)


def train(config_path: str, overrides: Sequence[str]) -> int:
    cfg = load_config(config_path, overrides)
    trainer = build_trainer(cfg)
    summary = trainer.fit()
    print(json.dumps(summary, indent=1, default=str))
    if summary.get("preempted"):  # SIGTERM / SIGINT: a checkpoint was written, exit 0 so schedulers requeue cleanly
        print(f"stopped by {summary['preempted']} at step {summary['steps']} (checkpoint: {summary['checkpoint'] or 'none yet'}); "
              f"to resume, run: {resume_command(config_path, overrides, cfg.trainer.resume)}", file=sys.stderr)
    return 0


def resume_command(config_path: str, overrides: Sequence[str], resume: str) -> str:
    """The same `hybridrl train` command, with trainer.resume=auto so it picks up the latest checkpoint."""
    kept = [shlex.quote(o) for o in overrides if not o.strip().startswith("trainer.resume=")]
    return " ".join(["hybridrl", "train", shlex.quote(config_path), *kept, *([] if resume == "auto" else ["trainer.resume=auto"])])


def make_data(task: str, out_dir: str, *, num_train: int, num_test: int, seed: int) -> int:
    from hybridrl.data import (
        arith_sft_rows,
        make_arith_preference_rows,
        make_arith_rows,
        make_arith_unpaired_rows,
        write_arith_dataset,
    )
    from hybridrl.models.tiny import EOS_TOKEN

    if task == "arith":
        paths = write_arith_dataset(out_dir, num_train=num_train, num_test=num_test, seed=seed)
    else:
        transform = {
            "arith-preference": lambda rows: make_arith_preference_rows(rows, seed=seed),
            "arith-unpaired": lambda rows: make_arith_unpaired_rows(rows, seed=seed),
            "arith-sft": lambda rows: arith_sft_rows(rows, EOS_TOKEN),
        }[task]
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {}
        for split, n in (("train", num_train), ("test", num_test)):
            rows = transform(make_arith_rows(n, seed=seed, split=split))
            paths[split] = out / f"{split}.jsonl"
            paths[split].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0
