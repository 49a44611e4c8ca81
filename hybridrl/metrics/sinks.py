"""Where step records go: a JSONL file (always), the console, TensorBoard / W&B (optional)."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, NamedTuple

from hybridrl import failpoints

log = logging.getLogger("hybridrl.metrics")


class MetricsWriteError(OSError):
    """A run output (metrics.jsonl, config.yaml) could not be written (full disk, permissions); names the path."""


FIX = ("Free disk space or choose a writable trainer.output_dir; checkpoints already written are intact "
       "and the run can be resumed (trainer.continue_on_save_error=true keeps training through failed writes).")


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null so every line stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class Truncation(NamedTuple):
    """What `JsonlSink.truncate_after` removed: every line it cut (`dropped`: the records past the step
    and any partial line) and, of those, the complete records written to the spill file (`spilled`)."""

    dropped: int
    spilled: int


class JsonlSink:
    """Appends one JSON object per step to `metrics.jsonl`.

    Each record is written with a single `write` of a complete line and fsync'd, so a kill can at
    worst leave one partial last line (a failed write is cut off again); `truncate_after` removes it
    (and any record past the checkpoint being resumed) so a resumed run never duplicates a step.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MetricsWriteError(f"could not create the output directory {self.path.parent}: {e.strerror or e}. {FIX}") from e

    def truncate_after(self, step: int, spill: Path | None = None) -> Truncation:
        """Keeps only complete records with `step <= step`; returns how many lines were cut and spilled.

        With `spill`, the complete records dropped are first written there (a partial line left by
        a crash is not a record and is only dropped).
        """
        if not self.path.exists():
            return Truncation(0, 0)
        kept, later, dropped = [], [], 0
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1  # a partial line left by a crash
                continue
            if isinstance(record, dict) and record.get("step", math.inf) <= step:
                kept.append(line)
            else:
                later.append(line)
        dropped += len(later)
        if spill is not None and later:
            try:
                spill.parent.mkdir(parents=True, exist_ok=True)
                with open(spill, "w", encoding="utf-8") as f:
                    f.write("".join(l + "\n" for l in later))
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:  # before the rewrite below, so the records are still in self.path
                raise MetricsWriteError(f"could not write the records past step {step} to {spill}: {e.strerror or e}. {FIX}") from e
        tmp = self.path.with_suffix(".jsonl.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write("".join(l + "\n" for l in kept))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            raise MetricsWriteError(f"could not rewrite {self.path} to step {step} for the resume: {e.strerror or e}. {FIX}") from e
        return Truncation(dropped, len(later) if spill is not None else 0)

    def write(self, record: dict[str, Any]) -> None:
        data = (json.dumps({k: _clean(v) for k, v in record.items()}, sort_keys=False) + "\n").encode("utf-8")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise MetricsWriteError(f"could not open {self.path} for appending: {e.strerror or e}. {FIX}") from e
        try:
            start = os.lseek(fd, 0, os.SEEK_END)
            failpoints.reached("metrics", torn_write=lambda: os.write(fd, data[: len(data) // 2]))
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except OSError as e:
                try:
                    os.ftruncate(fd, start)  # no partial line stays behind
                except OSError:
                    pass  # the next resume's truncate_after drops it
                raise MetricsWriteError(f"could not append to {self.path}: {e.strerror or e}. {FIX}") from e
        finally:
            os.close(fd)


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
