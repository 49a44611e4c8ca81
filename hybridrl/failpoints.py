"""Crash points for the kill tests: nothing happens unless `HYBRIDRL_KILL_AT` is set.

    HYBRIDRL_KILL_AT=<point>:<hit>[:<delay_s>[:<signal>]][,<more specs>]

sends `signal` (default KILL) to this process `delay_s` seconds (default 0) after the `hit`-th time
(1-based) the code passes `reached(point)`. The points: `step` (a training step starts), `update`
(an optimizer update starts), `checkpoint` (a checkpoint write starts) and `metrics` (a metrics
record is about to be appended; with no delay and KILL, half of the line is written first, as a
kill in the middle of a write could leave it). tests/test_robustness_kill.py uses them to kill a
run at chosen moments of every phase.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable

ENV = "HYBRIDRL_KILL_AT"
POINTS = ("step", "update", "checkpoint", "metrics")


@dataclass(frozen=True)
class KillSpec:
    point: str
    hit: int
    delay_s: float = 0.0
    signal: signal.Signals = signal.SIGKILL


def parse(text: str) -> list[KillSpec]:
    specs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        fields = item.split(":")
        if fields[0] not in POINTS or not 2 <= len(fields) <= 4:
            raise ValueError(f"{ENV}: {item!r} must look like <point>:<hit>[:<delay_s>[:<signal>]] with point one of {POINTS}")
        sig = signal.Signals[f"SIG{fields[3].upper().removeprefix('SIG')}"] if len(fields) == 4 else signal.SIGKILL
        specs.append(KillSpec(fields[0], int(fields[1]), float(fields[2]) if len(fields) > 2 else 0.0, sig))
    return specs


_SPECS = parse(os.environ.get(ENV, ""))
_hits: Counter[str] = Counter()


def reached(point: str, torn_write: Callable[[], None] | None = None) -> None:
    """Marks `point`; fires the specs due now. `torn_write` writes part of the pending record."""
    if not _SPECS:
        return
    _hits[point] += 1
    for spec in _SPECS:
        if spec.point != point or spec.hit != _hits[point]:
            continue
        if spec.delay_s > 0:
            timer = threading.Timer(spec.delay_s, os.kill, (os.getpid(), spec.signal))
            timer.daemon = True
            timer.start()
            continue
        if torn_write is not None and spec.signal == signal.SIGKILL:
            torn_write()
        os.kill(os.getpid(), spec.signal)
