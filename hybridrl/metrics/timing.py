"""Phase timers: `with timer.phase("rollout"):` records seconds under `timing/rollout`."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class PhaseTimer:
    def __init__(self, device: torch.device | None = None):
        self.device = device
        self.times: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        self._sync()
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"phase/{name}"):  # names the phase in a torch.profiler trace
                yield
        finally:
            self._sync()
            self.times[f"timing/{name}"] = self.times.get(f"timing/{name}", 0.0) + time.perf_counter() - start

    def _sync(self) -> None:
        # GPU work is asynchronous: without a sync a phase would be charged for the previous one.
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def pop(self) -> dict[str, float]:
        times, self.times = self.times, {}
        return times


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Peak memory since the last reset: GPU allocator peak, or the process's peak RSS on CPU."""
    gib = 1024**3
    if device.type == "cuda":
        out = {
            "memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
            "memory/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / gib,
        }
        torch.cuda.reset_peak_memory_stats(device)
        return out
    import resource

    # ru_maxrss is in KiB on Linux; it is the process peak (it cannot be reset).
    return {"memory/peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2}
