"""Phase timers: `with timer.phase("rollout"):` records seconds under `timing/rollout`."""

from __future__ import annotations

import gc
import sys
import time
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Seconds per phase of a step.

    On CUDA a phase is timed by two events on the current stream, not by draining the GPU: its time
    is the stretch of the GPU's timeline between them (the GPU reaches the end event once the work
    the phase queued has run). So the host prepares the next phase (plans and packs its first
    micro-batch, launches its kernels) while the GPU still runs this one, as it would without
    timers; a phase that only waits on the host (building the batch, scoring) is charged the time
    the GPU sat waiting for it. Phases laid end to end sum to the step. The times are read with one
    sync when asked for (`times`, `pop`). Elsewhere the phases are timed on the host clock.

    On CUDA each phase also keeps the caching allocator's peak while it ran
    (`memory/peak_allocated_gib/<phase>`, from `pop_memory`): memory is reserved when the host
    issues the work, so the host's span of a phase is the right window. The allocator's peak is
    reset as a phase opens or closes, after being folded into every open phase and into the peak
    since the last `pop_memory`, which `memory_metrics` reports as the step's.
    """

    def __init__(self, device: torch.device | None = None):
        self.device = device
        self._times: dict[str, float] = {}
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._open: list[list] = []  # [name, peak allocated bytes] of each open phase, innermost last
        self._phase_peaks: dict[str, int] = {}  # bytes, since the last pop_memory
        self._since_pop = [0, 0]  # peak allocated, peak reserved (bytes) since the last pop_memory

    @property
    def on_cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    @contextmanager
    def phase(self, name: str):
        if self.on_cuda:
            # The event first: the host's bookkeeping below is charged to this phase, not left between
            # phases, where a GPU idle behind a host-bound phase would count it in no phase.
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
            self._fold_peaks()
            self._open.append([name, 0])
        else:
            start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"phase/{name}"):  # names the phase in a torch.profiler trace
                yield
        finally:
            if self.on_cuda:
                # The counters before the end event, as after the start event: the host's reads fall inside
                # the phases, none between them. The phase's memory was reserved as its work was issued,
                # all of it before this read.
                self._fold_peaks()
                _, allocated = self._open.pop()
                self._phase_peaks[name] = max(self._phase_peaks.get(name, 0), allocated)
                end_event = torch.cuda.Event(enable_timing=True)
                end_event.record()
                self._pending.append((name, start_event, end_event))
            else:
                self._add(name, time.perf_counter() - start)

    def _fold_peaks(self) -> None:
        """Folds the allocator's peaks since their last reset into each open phase (allocated) and the
        running peaks (allocated, reserved), then resets them, so the next phase to open or close
        starts its own window."""
        # One read of the allocator's counters for both, nested: memory_stats() flattens and sorts every
        # counter in Python, most of its time, and this runs twice a phase.
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)
        allocated = stats.get("allocated_bytes", {}).get("all", {}).get("peak", 0)
        reserved = stats.get("reserved_bytes", {}).get("all", {}).get("peak", 0)
        for entry in self._open:
            entry[1] = max(entry[1], allocated)
        self._since_pop = [max(self._since_pop[0], allocated), max(self._since_pop[1], reserved)]
        torch.cuda.reset_peak_memory_stats(self.device)

    def pop_memory(self) -> dict[str, float]:
        """On CUDA: `memory/peak_allocated_gib/<phase>` for the phases closed since the last call, and
        the peaks allocated and reserved over the same span (also outside phases): what
        `memory_metrics` reports. Empty elsewhere."""
        if not self.on_cuda:
            return {}
        self._fold_peaks()
        gib = 1024**3
        out = {f"memory/peak_allocated_gib/{name}": b / gib for name, b in self._phase_peaks.items()}
        out["memory/peak_allocated_gib"], out["memory/peak_reserved_gib"] = (b / gib for b in self._since_pop)
        self._phase_peaks, self._since_pop = {}, [0, 0]
        return out

    def _add(self, name: str, seconds: float) -> None:
        self._times[f"timing/{name}"] = self._times.get(f"timing/{name}", 0.0) + seconds

    @property
    def times(self) -> dict[str, float]:
        """The phases ended so far (waits for the GPU to reach the last one's end)."""
        for name, start_event, end_event in self._pending:
            end_event.synchronize()  # in stream order, so only the first wait is long
            self._add(name, start_event.elapsed_time(end_event) / 1e3)
        self._pending.clear()
        return self._times

    def pop(self) -> dict[str, float]:
        times = self.times
        self._times = {}
        return times


class GcClock:
    """Time the Python garbage collector takes, read per step as `perf/gc_s` and `perf/gc_collections`,
    and the freeze that keeps its full collections short (`trainer.gc_freeze`).

    A full (generation 2) collection walks every container object the process holds (after
    transformers and torch.compile, hundreds of thousands to millions), and the host launches
    nothing meanwhile, so it shows as GPU idle time in whichever phase it falls. Most steps see only
    young collections (W0.5B on one H200: 4-8 ms a step), but a full one took 0.72 s of a 3.14 s
    step, inside the rollout; after a run's last step one took 0.573 s (622,935 objects tracked),
    against 0.001 s with the freeze (800,456 frozen; train/NOTES.md, session 30). `freeze` runs one
    full collection and then moves every surviving object into the collector's permanent generation
    (`gc.freeze`), so later full collections walk only what was made after it: the trainer calls it
    after the first step and after any step that compiled (its own phase, `timing/gc_freeze`), when
    the long-lived objects (models, compiled graphs, kernels) exist. `unfreeze` at the end of `fit`
    returns them to the collector, so a trainer dropped afterwards (a notebook, a sweep, a test
    suite) is collected. Frozen objects that become garbage during the run are collected only then.
    `gc.unfreeze` has no partial form, so objects that something else froze before the run are
    unfrozen with the run's; they are kept alive by their owners, so the collector only walks them
    again. From Python 3.12 the permanent generation is not empty even with nothing frozen: a
    collection puts some of the interpreter's own (immortal) objects there by itself. On 3.12.1,
    `gc.get_freeze_count()` is 375 at start-up, 0 after `gc.unfreeze()`, 375 again after
    `gc.collect()`: the 375 once seen on the H200 machine (Python 3.12) before the first step.
    Collections run in whichever thread allocates, so a helper thread's collections are counted too.
    """

    def __init__(self):
        self._seconds = 0.0
        self._collections = 0
        self._start: float | None = None
        self._installed = False
        self._froze = False  # this clock has frozen objects that `unfreeze` returns

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self._seconds += time.perf_counter() - self._start
            self._collections += 1
            self._start = None

    def __enter__(self) -> "GcClock":
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False

    def freeze(self) -> int:
        """One full collection, then what survives goes to the permanent generation; returns how
        many objects are frozen."""
        gc.collect()
        gc.freeze()
        self._froze = True
        return gc.get_freeze_count()

    def unfreeze(self) -> None:
        """Returns what `freeze` froze to the collector (a no-op if it froze nothing)."""
        if self._froze:
            gc.unfreeze()
            self._froze = False

    def pop(self) -> dict[str, float]:
        out = {"perf/gc_s": self._seconds, "perf/gc_collections": float(self._collections)}
        self._seconds, self._collections = 0.0, 0
        return out


class CompileClock:
    """Compilation inside each step, read per step as `perf/compile_s`, `perf/compiles/graphs` and
    `perf/compiles/triton`, so that a slow step says when its time went to a compiler.

    Two compilers run during training. torch.compile compiles a graph the first time it meets new
    shapes or new guards, and compiles its backward the first time that runs: both are counted from
    dynamo's own timings (`torch._dynamo.utils.compilation_time_metrics`, whose top-level entries are
    added once per compilation). Triton compiles a hand-written kernel (@triton.jit) once per
    specialization: per set of constexpr values, and per integer argument equal to 1 or divisible
    by 16 or neither, so a step whose token counts change that way (a response ending early) may
    compile a kernel again after the first step. Those are counted through Triton's JIT hooks
    (`triton.knobs.runtime.jit_cache_hook` before the compilation, `jit_post_compile_hook` after),
    chained to any hook already installed and restored when the step ends. Kernels that inductor
    generates are compiled inside torch.compile's graphs and counted there. `names` holds what the
    last `pop` counted, for a log line."""

    _TORCH_KEYS = ("_compile.compile_inner", "backward._backward_impl")  # one entry per compilation

    def __init__(self):
        self._triton_s = 0.0
        self._triton_names: list[str] = []
        self._starts: list[float] = []
        self._saved_hooks: tuple | None = None
        self._torch_seen = self._torch_entries()
        self.names: list[str] = []

    @staticmethod
    def _dynamo_timings() -> dict[str, list[float]]:
        utils = sys.modules.get("torch._dynamo.utils")  # not imported: nothing was compiled
        return getattr(utils, "compilation_time_metrics", None) or {}

    @classmethod
    def _torch_entries(cls) -> dict[str, int]:
        timings = cls._dynamo_timings()
        return {k: len(timings.get(k, ())) for k in cls._TORCH_KEYS}

    def _before(self, previous, kwargs):
        result = previous(**kwargs) if previous is not None else None
        if not result:  # a true result tells Triton to skip the compilation
            self._starts.append(time.perf_counter())
        return result

    def _after(self, previous, kwargs):
        if self._starts:
            self._triton_s += time.perf_counter() - self._starts.pop()
            fn = kwargs.get("fn")
            self._triton_names.append(getattr(fn, "name", None) or "triton kernel")
        return previous(**kwargs) if previous is not None else None

    def __enter__(self) -> "CompileClock":
        self._torch_seen = self._torch_entries()  # what compiled between steps (an evaluation) is not the step's
        triton = sys.modules.get("triton")  # not imported yet: no Triton kernel can compile in this step
        knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
        if knobs is not None and self._saved_hooks is None and hasattr(knobs, "jit_post_compile_hook"):
            before, after = knobs.jit_cache_hook, knobs.jit_post_compile_hook
            self._saved_hooks = (knobs, before, after)
            knobs.jit_cache_hook = lambda **kw: self._before(before, kw)
            knobs.jit_post_compile_hook = lambda **kw: self._after(after, kw)
        return self

    def __exit__(self, *exc) -> None:
        if self._saved_hooks is not None:
            knobs, knobs.jit_cache_hook, knobs.jit_post_compile_hook = self._saved_hooks
            self._saved_hooks = None
        self._starts.clear()

    def compiled(self) -> bool:
        """Whether anything compiled since the last `pop` (without popping it)."""
        return bool(self._triton_names) or self._torch_entries() != self._torch_seen

    def pop(self) -> dict[str, float]:
        timings, graphs, torch_s = self._dynamo_timings(), 0, 0.0
        for key in self._TORCH_KEYS:
            new = list(timings.get(key, ()))[self._torch_seen.get(key, 0) :]
            graphs += len(new)
            torch_s += sum(new)
        self._torch_seen = self._torch_entries()
        self.names = [f"{graphs} torch.compile graph(s)"] * bool(graphs) + self._triton_names
        out = {"perf/compile_s": torch_s + self._triton_s, "perf/compiles/graphs": float(graphs),
               "perf/compiles/triton": float(len(self._triton_names))}  # fmt: skip
        self._triton_s, self._triton_names = 0.0, []
        return out


def memory_metrics(device: torch.device, timer: PhaseTimer | None = None) -> dict[str, float]:
    """Peak memory since the last reset: GPU allocator peak, or the process's peak RSS on CPU. With
    the step's CUDA `timer`, also each phase's (PhaseTimer.pop_memory), which resets the peaks."""
    gib = 1024**3
    if device.type == "cuda" and timer is not None and timer.on_cuda:
        return timer.pop_memory()
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
