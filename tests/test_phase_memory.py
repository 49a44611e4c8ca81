"""Peak memory per phase in the step record (`memory/peak_allocated_gib/<phase>`), on CUDA: the
folding of the allocator's peak into nested phases, checked here against a fake allocator (the
GPU test in test_train_gpu.py runs the real one)."""

from __future__ import annotations

import pytest
import torch

from hybridrl.metrics import PhaseTimer, memory_metrics

GIB = 1024**3


class _Allocator:
    """What PhaseTimer reads of torch.cuda's caching allocator: current and peak bytes, and a reset
    that sets the peaks to the current figures (as torch.cuda.reset_peak_memory_stats does)."""

    def __init__(self):
        self.now = self.peak = self.reserved = self.reserved_peak = 0

    def alloc(self, gib: float) -> None:
        self.now += int(gib * GIB)
        self.peak = max(self.peak, self.now)
        self.reserved = max(self.reserved, self.now)  # the cache keeps what it once held
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def free(self, gib: float) -> None:
        self.now -= int(gib * GIB)

    def reset(self, device=None) -> None:
        self.peak, self.reserved_peak = self.now, self.reserved


class _Event:
    log: list[str] | None = None  # where a test wants the order of event records and counter reads

    def __init__(self, enable_timing=False):
        pass

    def record(self):
        if _Event.log is not None:
            _Event.log.append("event")

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 1.0


@pytest.fixture
def fake_cuda(monkeypatch):
    mem = _Allocator()

    def nested_stats(device=None):
        if _Event.log is not None:
            _Event.log.append("stats")
        return {"allocated_bytes": {"all": {"peak": mem.peak}}, "reserved_bytes": {"all": {"peak": mem.reserved_peak}}}

    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", nested_stats)
    monkeypatch.setattr(_Event, "log", None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", mem.reset)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    return mem


def test_each_phase_keeps_its_own_peak_and_the_step_keeps_the_highest(fake_cuda):
    mem, device = fake_cuda, torch.device("cuda")
    timer = PhaseTimer(device)
    mem.alloc(1.0)  # weights, before any phase
    with timer.phase("step"):
        with timer.phase("rollout"):
            mem.alloc(2.0)  # KV cache
            mem.free(2.0)
        with timer.phase("ref"):
            mem.alloc(0.5)
            mem.free(0.5)
        mem.alloc(0.25)  # between phases, inside the step
        mem.free(0.25)
        with timer.phase("train"):
            for _ in range(3):  # micro-batches
                mem.alloc(1.5)
                mem.free(1.5)
    timer.pop()
    first = memory_metrics(device, timer)
    assert first["memory/peak_allocated_gib/rollout"] == pytest.approx(3.0)
    assert first["memory/peak_allocated_gib/ref"] == pytest.approx(1.5)
    assert first["memory/peak_allocated_gib/train"] == pytest.approx(2.5)
    assert first["memory/peak_allocated_gib/step"] == pytest.approx(3.0)  # an enclosing phase sees its inner ones
    assert first["memory/peak_allocated_gib"] == pytest.approx(3.0)
    assert first["memory/peak_reserved_gib"] == pytest.approx(3.0)

    mem.alloc(4.0)  # between steps (a checkpoint, say): outside every phase, still the next record's
    mem.free(4.0)
    with timer.phase("step"):
        with timer.phase("train"):
            mem.alloc(0.5)
            mem.free(0.5)
    second = memory_metrics(device, timer)
    assert second["memory/peak_allocated_gib/train"] == pytest.approx(1.5)  # this step's, not the last one's
    assert second["memory/peak_allocated_gib/step"] == pytest.approx(1.5)
    assert "memory/peak_allocated_gib/rollout" not in second
    assert second["memory/peak_allocated_gib"] == pytest.approx(5.0)
    assert timer.pop_memory()["memory/peak_allocated_gib"] == pytest.approx(1.0)  # popped: a new window


def test_a_phase_that_raises_still_closes(fake_cuda):
    mem, timer = fake_cuda, PhaseTimer(torch.device("cuda"))
    with pytest.raises(RuntimeError):
        with timer.phase("step"):
            with timer.phase("train"):
                mem.alloc(2.0)
                raise RuntimeError("out of memory, say")
    assert timer._open == []
    assert memory_metrics(torch.device("cuda"), timer)["memory/peak_allocated_gib/train"] == pytest.approx(2.0)


def test_off_cuda_the_step_record_keeps_the_process_peak():
    timer = PhaseTimer(torch.device("cpu"))
    with timer.phase("step"):
        pass
    assert timer.pop_memory() == {}
    out = memory_metrics(torch.device("cpu"), timer)
    assert set(out) == {"memory/peak_rss_gib"} and out["memory/peak_rss_gib"] > 0


def test_between_two_phases_the_host_reads_no_counters(fake_cuda):
    """A GPU idle behind a host-bound phase (scoring, a synchronous generate) keeps running the clock
    between one phase's end event and the next one's start event: time counted in no phase. The
    counters are read after a phase's start event and before its end event, so no read falls there."""
    timer = PhaseTimer(torch.device("cuda"))
    _Event.log = []
    with timer.phase("reward_exposed"):
        pass
    with timer.phase("old_logprobs"):
        pass
    # start, read | read, end || start, read | read, end: no read between the phases (two, then one, before)
    assert _Event.log == ["event", "stats", "stats", "event", "event", "stats", "stats", "event"]
