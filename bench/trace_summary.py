"""Where the GPU time of a profiled step went, phase by phase, from a torch.profiler Chrome trace.

    python bench/compare_trl.py --skip-trl --profile 3 --trace step3.json.gz [--stack]
    python bench/trace_summary.py step3.json.gz [--top 15] [--gaps] [--why] [--launchers 'phase/train:Memset|add']
    python bench/trace_summary.py step3.json.gz --timeline phase/ref

A kernel belongs to the phase (`phase/*` ranges of the step loop) whose CPU range launched it; for
each phase this prints its wall time, the time the GPU was busy with its kernels (the union of their
intervals, so overlapping streams count once), the idle rest, and the kernels that took the most time.
`--gaps` also splits each phase's idle GPU time by what the host was doing meanwhile (inside a
compiled forward, a compiled backward, another backward function, the optimizer, or elsewhere:
Python between calls, packing, waiting on a copy). With a trace recorded with Python frames
(`--stack`), `--why` names the host-blocking CUDA calls and the frames the host was in while the GPU
idled, and `--launchers PHASE:REGEX` counts the phase's kernels whose name matches by the operator
and frame that launched them. `--timeline PHASE` lists, in ms from the phase's start, the copies the
GPU ran during it (whichever phase issued them: a prefetch issued earlier starts at a negative time)
and the stretches with no kernel running: whether the phase's kernels waited while copies ran; it also
counts and sums every such stretch by length (0-2, 2-10, 10-50, 50-200, >= 200 us): many short ones are kernels
following kernels, long ones the GPU waiting for its host.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def short_name(name: str) -> str:
    """Kernel names without template arguments, argument lists or launch-specific suffixes."""
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    return name[:90]


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarise(events: list[dict], top: int = 15) -> dict:
    phases = sorted(
        ((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
         if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name", "").startswith("phase/")),
    )  # fmt: skip
    launch_ts = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launch_ts[e["args"]["correlation"]] = e["ts"]
    # Phases nest (phase/step holds the others): attribute a launch to the innermost range holding it.
    starts = [p[0] for p in phases]

    def phase_of(ts: float) -> str:
        best = None
        for i in range(bisect.bisect_right(starts, ts) - 1, -1, -1):
            a, b, name = phases[i]
            if a <= ts <= b and (best is None or b - a < best[1] - best[0]):
                best = phases[i]
        return best[2] if best else "(outside phases)"

    kernels = defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATS:
            continue
        ts = launch_ts.get(e.get("args", {}).get("correlation"))
        kernels[phase_of(ts) if ts is not None else "(unattributed)"].append(e)
    wall = defaultdict(float)
    for a, b, name in phases:
        wall[name] += b - a
    out = {}
    for name in sorted(set(wall) | set(kernels)):
        ks = kernels.get(name, [])
        by_kernel = defaultdict(lambda: [0.0, 0])
        for e in ks:
            s = by_kernel[short_name(e["name"])]
            s[0] += e["dur"]
            s[1] += 1
        busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in ks])
        out[name] = {
            "wall_ms": wall.get(name, 0.0) / 1e3,
            "busy_ms": busy / 1e3,
            "kernel_ms": sum(e["dur"] for e in ks) / 1e3,
            "launches": len(ks),
            "top": sorted(((k, v[0] / 1e3, v[1]) for k, v in by_kernel.items()), key=lambda x: -x[1])[:top],
        }
    return out


# Host ranges an idle GPU interval is attributed to, first match wins: (label, name prefix).
HOST_ACTIVITIES = (
    ("compiled forward", "Torch-Compiled Region"),
    ("compiled backward", "autograd::engine::evaluate_function: CompiledFunctionBackward"),
    ("other backward", "autograd::engine::evaluate_function"),
    ("optimizer", "Optimizer."),
)


def idle_intervals(gpu: list[tuple[float, float]], t0: float, t1: float) -> list[tuple[float, float]]:
    """The stretches of [t0, t1] during which no GPU interval (sorted by start) is running."""
    idle, end = [], t0
    for a, b in gpu[max(0, bisect.bisect_left(gpu, (t0, t0)) - 1) :]:
        if a > t1:
            break
        if b <= end:
            continue
        if a > end:
            idle.append((end, min(a, t1)))
        end = b
    if end < t1:
        idle.append((end, t1))
    return idle


def idle_by_host_activity(events: list[dict]) -> dict[str, dict[str, float]]:
    """For each phase: ms of GPU idle time (no kernel, copy or memset running) by what the host was in."""
    ranges = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS)
    host = {label: sorted((e["ts"], e["ts"] + e["dur"]) for e in ranges if e["name"].startswith(prefix)) for label, prefix in HOST_ACTIVITIES}
    out: dict[str, dict[str, float]] = {}
    for phase in (e for e in ranges if e["name"].startswith("phase/") and e["name"] != "phase/step"):
        split = defaultdict(float)
        for a, b in idle_intervals(gpu, phase["ts"], phase["ts"] + phase["dur"]):
            mid, label = (a + b) / 2, "elsewhere"
            for name, spans in host.items():
                i = bisect.bisect_right(spans, (mid, float("inf"))) - 1
                if i >= 0 and spans[i][0] <= mid <= spans[i][1]:
                    label = name
                    break
            split[label] += (b - a) / 1e3
        out[phase["name"]] = dict(split)
    return out


BLOCKING_MS = 0.2  # a runtime call this long held the host: a sync, a pageable copy, an allocation


def _indexed(spans) -> tuple[list[tuple[float, float, str]], list[float]]:
    """(start, end, name) spans sorted by start, and their starts: `_innermost`'s arguments."""
    spans = sorted(spans)
    return spans, [s[0] for s in spans]


def _project_frame(frame: str | None, project: str) -> str | None:
    """A Python frame's name from the project's own path on (None stays None)."""
    return frame and re.sub(r"^.*?" + re.escape(project), "", frame)


def _innermost(spans: list[tuple[float, float, str]], starts: list[float], ts: float, max_back: int = 4000) -> str | None:
    """Name of the shortest span in `spans` (sorted by start) that holds time `ts`."""
    best = None
    i = bisect.bisect_right(starts, ts) - 1
    while i >= 0 and max_back > 0:
        a, b, name = spans[i]
        if a <= ts <= b and (best is None or b - a < best[1] - best[0]):
            best = spans[i]
        i -= 1
        max_back -= 1
    return best[2] if best else None


def why_idle(events: list[dict], project: str = "hybridrl/") -> dict[str, dict[str, list[tuple[str, float, int]]]]:
    """For each phase: (1) host-blocking CUDA runtime calls (longer than BLOCKING_MS), by call and the
    innermost project Python frame (traces made with `with_stack`) or operator that made them; (2) the
    GPU's idle time by the innermost project Python frame the host was in at each idle interval's middle."""
    def spans_of(pred):
        return _indexed((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("ph") == "X" and pred(e))

    frames = spans_of(lambda e: e.get("cat") == "python_function" and project in e.get("name", ""))
    ops = spans_of(lambda e: e.get("cat") == "cpu_op")
    phases = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
              and e.get("name", "").startswith("phase/") and e["name"] != "phase/step"]  # fmt: skip
    runtime = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver") and e["dur"] >= BLOCKING_MS * 1e3]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS)

    def where(ts: float) -> str:
        frame = _innermost(*frames, ts)
        op = _innermost(*ops, ts)
        return " / ".join(x for x in (_project_frame(frame, project), op) if x) or "(no frame)"

    out = {}
    for phase in phases:
        t0, t1 = phase["ts"], phase["ts"] + phase["dur"]
        blocking = defaultdict(lambda: [0.0, 0])
        for e in runtime:
            if t0 <= e["ts"] <= t1:
                s = blocking[f"{e['name']} <- {where(e['ts'])}"]
                s[0] += e["dur"] / 1e3
                s[1] += 1
        by_frame = defaultdict(lambda: [0.0, 0])
        for a, b in idle_intervals(gpu, t0, t1):
            if b - a >= 50:  # us; shorter gaps are launch spacing
                s = by_frame[where((a + b) / 2)]
                s[0] += (b - a) / 1e3
                s[1] += 1
        top = lambda d: sorted(((k, v[0], v[1]) for k, v in d.items()), key=lambda x: -x[1])[:12]  # noqa: E731
        out[phase["name"]] = {"blocking": top(blocking), "idle": top(by_frame)}
    return out


def frames_in(events: list[dict], phase: str, top: int = 25) -> list[tuple[str, float, int]]:
    """Python frames (traces made with `with_stack`) inside a phase, by inclusive time: main thread
    and any other thread that ran meanwhile (a thread's frames are tagged with its id)."""
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") == phase]
    totals = defaultdict(lambda: [0.0, 0])
    for span in spans:
        t0, t1 = span["ts"], span["ts"] + span["dur"]
        for e in events:
            if e.get("ph") == "X" and e.get("cat") == "python_function" and t0 <= e["ts"] <= t1:
                s = totals[f"[tid {e.get('tid')}] {e['name']}"]
                s[0] += min(e["ts"] + e["dur"], t1) / 1e3 - e["ts"] / 1e3
                s[1] += 1
    return sorted(((k, v[0], v[1]) for k, v in totals.items()), key=lambda x: -x[1])[:top]


def launchers(events: list[dict], phase: str, pattern: str, project: str = "hybridrl/", top: int = 30) -> list[tuple[str, float, int]]:
    """Kernels, copies and memsets of PHASE whose name matches `pattern`, by what launched them: the
    innermost operator and project Python frame (traces made with `with_stack`) on the launching
    thread (the autograd engine launches the backward's from its own thread). Kernel ms and count."""
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") == phase]
    by_thread: dict = defaultdict(list)  # (category, thread): its operators' or project frames' spans
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") == "cpu_op" or (e.get("cat") == "python_function" and project in e.get("name", "")):
            by_thread[(e.get("cat"), e.get("tid"))].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    index = {key: _indexed(spans) for key, spans in by_thread.items()}
    launch = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launch[e["args"]["correlation"]] = (e["ts"], e.get("tid"))
    rx = re.compile(pattern)
    totals = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATS or not rx.search(e["name"]):
            continue
        ts, tid = launch.get(e.get("args", {}).get("correlation"), (None, None))
        if ts is None or not any(a <= ts <= b for a, b in spans):
            continue
        op = _innermost(*index.get(("cpu_op", tid), ([], [])), ts)
        frame = _project_frame(_innermost(*index.get(("python_function", tid), ([], [])), ts), project)
        s = totals[f"{short_name(e['name']).strip()[:50]} <- {op} <- {frame}"]
        s[0] += e["dur"] / 1e3
        s[1] += 1
    return sorted(((k, v[0], v[1]) for k, v in totals.items()), key=lambda x: -x[2])[:top]


def timeline(events: list[dict], phase: str, min_idle_us: float = 200.0) -> list[dict]:
    """For each span of `phase`: its wall ms, the copies the GPU ran during it (start ms from the span's
    start, ms, bytes, stream, name) and the stretches of at least `min_idle_us` with no kernel running
    (start ms, ms). Copies do not count as busy here: the question is whether computation waited."""
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") == phase]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e.get("cat") == "kernel")
    copies = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "gpu_memcpy"), key=lambda e: e["ts"])
    out = []
    for t0, t1 in spans:
        during = [((e["ts"] - t0) / 1e3, e["dur"] / 1e3, e.get("args", {}).get("bytes"), e.get("args", {}).get("stream"), e["name"])
                  for e in copies if e["ts"] < t1 and e["ts"] + e["dur"] > t0]  # fmt: skip
        gaps = idle_intervals(kernels, t0, t1)
        idle = [((a - t0) / 1e3, (b - a) / 1e3) for a, b in gaps if b - a >= min_idle_us]
        out.append({"wall_ms": (t1 - t0) / 1e3, "copies": during, "idle": idle, "idle_by_size": idle_by_size(gaps)})
    return out


IDLE_SIZES_US = (2.0, 10.0, 50.0, 200.0)  # upper edges of the size classes of `idle_by_size`; the last is open


def idle_by_size(gaps: list[tuple[float, float]]) -> list[tuple[str, int, float]]:
    """Stretches with no kernel running, by length: (class, count, total ms) for each class of IDLE_SIZES_US.
    Many short ones are kernels following kernels (launch latency); a few long ones are the host's waits."""
    edges = (0.0,) + IDLE_SIZES_US + (float("inf"),)
    out = []
    for lo, hi in zip(edges, edges[1:]):
        sizes = [b - a for a, b in gaps if lo <= b - a < hi]
        label = f">= {lo:g} us" if hi == float("inf") else f"{lo:g}-{hi:g} us"
        out.append((label, len(sizes), sum(sizes) / 1e3))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--gaps", action="store_true", help="split each phase's idle GPU time by host activity")
    ap.add_argument("--why", action="store_true",
                    help="per phase: host-blocking CUDA calls and idle GPU time by the project's Python frame (trace made with --stack)")
    ap.add_argument("--frames", action="append", default=[], metavar="PHASE",
                    help="Python frames inside PHASE (e.g. phase/batch) by inclusive time (trace made with --stack)")
    ap.add_argument("--launchers", action="append", default=[], metavar="PHASE:REGEX",
                    help="kernels of PHASE whose name matches REGEX, counted by the operator and Python frame that launched "
                         "them (e.g. 'phase/train:elementwise|Memset'; trace made with --stack)")
    ap.add_argument("--timeline", action="append", default=[], metavar="PHASE",
                    help="the copies the GPU ran during PHASE and its stretches with no kernel running, in ms from its start, "
                         "and those stretches counted by length")
    args = ap.parse_args(argv)
    events = load(args.trace)
    result = summarise(events, args.top)
    gaps = idle_by_host_activity(events) if args.gaps else {}
    for name, r in result.items():
        print(f"\n== {name}: wall {r['wall_ms']:.1f} ms, GPU busy {r['busy_ms']:.1f} ms (kernels {r['kernel_ms']:.1f} ms, "
              f"{r['launches']} launches)")  # fmt: skip
        for k, ms, n in r["top"]:
            print(f"   {ms:9.2f} ms  {n:6d}x  {k}")
        if name in gaps:
            split = ", ".join(f"{label} {ms:.1f}" for label, ms in sorted(gaps[name].items(), key=lambda x: -x[1]))
            print(f"   GPU idle by host activity (ms): {split or 'none'}")
    if args.why:
        for name, w in why_idle(events).items():
            print(f"\n== {name}: host-blocking CUDA calls (>= {BLOCKING_MS} ms each)")
            for k, ms, n in w["blocking"]:
                print(f"   {ms:9.2f} ms  {n:6d}x  {k[:200]}")
            print(f"   idle GPU (gaps >= 50 us) by where the host was:")
            for k, ms, n in w["idle"]:
                print(f"   {ms:9.2f} ms  {n:6d}x  {k[:200]}")
    for phase in args.frames:
        print(f"\n== Python frames inside {phase} (inclusive ms, calls)")
        for k, ms, n in frames_in(events, phase):
            print(f"   {ms:9.2f} ms  {n:6d}x  {k[:200]}")
    for item in args.launchers:
        phase, _, pattern = item.partition(":")
        print(f"\n== {phase}: kernels matching {pattern!r} by launcher (kernel ms, count)")
        for k, ms, n in launchers(events, phase, pattern):
            print(f"   {ms:9.2f} ms  {n:6d}x  {k[:240]}")
    for phase in args.timeline:
        for i, t in enumerate(timeline(events, phase)):
            print(f"\n== {phase} (span {i}, wall {t['wall_ms']:.1f} ms): copies (start ms, ms, MB, stream)")
            for start, ms, nbytes, stream, name in t["copies"]:
                size = f"{nbytes / 2**20:9.1f}" if nbytes is not None else "        ?"
                print(f"   {start:9.2f}  {ms:8.3f}  {size}  {stream!s:>6}  {name}")
            print("   no kernel running (start ms, ms): " + (", ".join(f"{a:.2f} +{d:.2f}" for a, d in t["idle"]) or "never"))
            print("   no kernel running, by length: " + ", ".join(f"{label} {n}x {ms:.2f} ms" for label, n, ms in t["idle_by_size"]))
    return result


if __name__ == "__main__":
    main()
