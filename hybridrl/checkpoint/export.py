"""Export a checkpoint's model as a plain HF directory (what `hybridrl export` does)."""

from __future__ import annotations

import shutil
from pathlib import Path

from hybridrl.checkpoint.manager import CheckpointError, CheckpointManager


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, model: str = "model") -> Path:
    """Verifies the checkpoint and copies its `model/` (weights, config, tokenizer) to out_dir."""
    ckpt = Path(checkpoint)
    if ckpt.is_dir() and (ckpt / "latest").is_file():
        resolved = CheckpointManager(ckpt).latest_intact()
        if resolved is None:
            raise CheckpointError(f"{ckpt} holds no intact checkpoint to export")
        ckpt = resolved
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt} is not a checkpoint directory (expected e.g. runs/x/checkpoints/step_000050)")
    problem = CheckpointManager.verify(ckpt)
    if problem is not None:
        raise CheckpointError(f"checkpoint {ckpt} cannot be trusted: {problem}; export another step")
    src = ckpt / model
    if not src.is_dir():
        raise CheckpointError(f"checkpoint {ckpt} has no {model}/ directory (available: {', '.join(p.name for p in ckpt.iterdir() if p.is_dir())})")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} exists and is not empty; choose a new directory")
    shutil.copytree(src, out, dirs_exist_ok=True)
    return out
