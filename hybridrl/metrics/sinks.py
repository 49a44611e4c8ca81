"""Where step records go: a JSONL file (always), the console, TensorBoard / W&B (optional)."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("hybridrl.metrics")


class MetricsWriteError(OSError):
    """The metrics file could not be written (full disk, permissions); names the path."""


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null so every line stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonlSink:
    """Appends one JSON object per step to `metrics.jsonl`.

    Each record is written with a single `write` of a complete line and fsync'd, so a kill can at
    worst leave one partial last line; `truncate_after` removes it (and any record past the
    checkpoint being resumed) so a resumed run never duplicates a step.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> int:
        """Keeps only complete records with `step <= step`; returns how many were dropped."""
        if not self.path.exists():
            return 0
        kept, dropped = [], 0
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1  # a partial line left by a crash
                continue
            if isinstance(record, dict) and record.get("step", math.inf) <= step:
                kept.append(line)
            else:
                dropped += 1
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(l + "\n" for l in kept), encoding="utf-8")
        os.replace(tmp, self.path)
        return dropped

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({k: _clean(v) for k, v in record.items()}, sort_keys=False) + "\n"
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise MetricsWriteError(
                f"could not append to {self.path}: {e.strerror or e}. Free disk space or make the directory writable "
                "(trainer.output_dir); checkpoints already written are intact and the run can be resumed."
            ) from e


class TensorBoardSink:
    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the optional `tensorboard` package

        self.writer = SummaryWriter(str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for k, v in record.items():
            if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a metrics.jsonl file."""
    records = []
    p = Path(path)
    if not p.exists():
        return records
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
