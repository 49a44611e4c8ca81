"""What was allocated at a step's memory peak, from a CUDA allocator snapshot, grouped by where.

    python bench/compare_trl.py --skip-trl --memory-snapshot 3:step3.pickle    # record step 3 (GPU)
    python bench/memory_peak.py step3.pickle [--top 15] [--frames 2] [--match 'hybridrl/|transformers/']
    python bench/compare_trl.py --skip-trl --memory-snapshot 3:s.pickle --variant det:train.deterministic=true
    python bench/memory_peak.py s.det.pickle --against s.pickle                 # what the variant holds more

The snapshot (`torch.cuda.memory._snapshot()` with `_record_memory_history` on for the step) has
every allocation and free of the step, with the Python frames that made it. This replays them: the
allocated total is the bytes allocated when recording started (`allocated_before`, written with the
snapshot; not traced, so not itemised: weights, optimizer state, caches) plus the traced
allocations less their frees. At the highest total it lists the traced allocations still live,
grouped by their innermost `--frames` frames whose file matches `--match` (by default hybridrl,
transformers and inductor's generated code), largest first. A generated module's name is a hash of
its graph, so its frames are marked `(compiled)` and the place is named by the source frames outside
it (the model's lines the graph was traced from), which stay the same when an option changes the
graph. It also names the allocation that reached the peak. `--against` runs the same on a second
snapshot and prints both groupings side by side, sorted by the difference: the places where the
first run holds more at its peak than the second at its own. Sizes are as requested (the allocator
rounds each block up to a multiple of 512 bytes), so the totals can fall a little short of
`torch.cuda.max_memory_allocated`.
"""

from __future__ import annotations

import argparse
import pickle
import re
from collections import defaultdict

DEFAULT_MATCH = r"hybridrl/|transformers/|torchinductor_|torch/_inductor/|torch/utils/checkpoint"
# A module inductor generated (its cache: /tmp/torchinductor_USER/xy/cxy....py). Its name is a hash of
# the graph, so the same place has another name in a run whose graph differs (another option); the
# frames outside it (the model's source lines the graph was traced from) name the place instead.
GENERATED = re.compile(r"torchinductor_[^/]*/(?:[^/]+/)?c[a-z0-9]{20,}\.py$")
GiB = 2**30


def load(path: str) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f)


def _trace(snapshot: dict) -> list[dict]:
    """The device whose trace holds the most entries (the one the step ran on)."""
    traces = snapshot.get("device_traces") or []
    if not any(traces):
        raise SystemExit("the snapshot has no allocator trace: record it with torch.cuda.memory._record_memory_history() on "
                         "(bench/compare_trl.py --memory-snapshot STEP:FILE does)")  # fmt: skip
    return max(traces, key=len)


def replay(trace: list[dict]) -> tuple[int, int, dict[int, dict]]:
    """Replays allocations and frees; returns (peak of the traced bytes, over the start, the trace
    index where it was reached, {addr: entry} of the traced allocations live then). A block freed in
    the trace that was allocated before it lowers the total (it is part of `allocated_before`). A
    free counts when requested: the allocator's allocated total drops then, even where the block's
    reuse waits for another stream (`free_completed`)."""

    def run(stop: int | None):
        live: dict[int, dict] = {}
        total = peak = 0
        peak_at = -1
        for i, e in enumerate(trace):
            if stop is not None and i > stop:
                break
            action = e.get("action")
            if action == "alloc":
                live[e["addr"]] = e
                total += e["size"]
                if total > peak:
                    peak, peak_at = total, i
            elif action == "free_requested":
                total -= e["size"]
                live.pop(e["addr"], None)
        return peak, peak_at, live

    peak, peak_at, _ = run(None)
    _, _, live = run(peak_at)
    return peak, peak_at, live


def where(entry: dict, match: re.Pattern, frames: int) -> str:
    """The innermost `frames` frames of an allocation whose file matches (the innermost frame if none
    does). Frames in inductor's generated modules are not counted: `(compiled)` before the place says
    that the innermost matching frame was one, i.e. a compiled graph's buffer."""
    stack = entry.get("frames") or []
    matching = [f for f in stack if match.search(f.get("filename", ""))]
    compiled = bool(matching) and bool(GENERATED.search(matching[0].get("filename", "")))
    picked = [f for f in matching if not GENERATED.search(f.get("filename", ""))][:frames] or matching[:1] or stack[:1]
    place = " < ".join(f"{f.get('filename', '?').rsplit('/', 2)[-1]}:{f.get('line', '?')} {f.get('name', '?')}" for f in picked)
    return ("(compiled) " if compiled else "") + (place or "(no frames)")


def peak_summary(snapshot: dict, match: str = DEFAULT_MATCH, frames: int = 2) -> dict:
    """{allocated_before, peak, traced_at_peak, entries, peak_at, peak_where (the allocation that reached it),
    groups: {where: [bytes, count]}} (bytes)."""
    trace = _trace(snapshot)
    peak, peak_at, live = replay(trace)
    before = int(snapshot.get("hybridrl", {}).get("allocated_before", 0))
    pattern = re.compile(match)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in live.values():
        g = groups[where(e, pattern, frames)]
        g[0] += e["size"]
        g[1] += 1
    at = where(trace[peak_at], pattern, max(frames, 4)) if peak_at >= 0 else "(no allocation in the trace)"
    return {"allocated_before": before, "peak": before + peak, "traced_at_peak": sum(e["size"] for e in live.values()),
            "entries": len(trace), "peak_at": peak_at, "peak_where": at, "groups": dict(groups)}  # fmt: skip


def _gib(n: int) -> str:
    return f"{n / GiB:.3f}"


def print_summary(s: dict, top: int, label: str = "") -> None:
    print(f"{label}allocated when recording started: {_gib(s['allocated_before'])} GiB; peak {_gib(s['peak'])} GiB at trace "
          f"entry {s['peak_at']:,} of {s['entries']:,}; allocated during the step and live at the peak: "
          f"{_gib(s['traced_at_peak'])} GiB")  # fmt: skip
    print(f"the allocation that reached it: {s['peak_where']}")
    print("| GiB | blocks | where |\n| ---: | ---: | --- |")
    for place, (size, count) in sorted(s["groups"].items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {_gib(size)} | {count:,} | {place} |")


def print_difference(a: dict, b: dict, top: int) -> None:
    print(f"peak {_gib(a['peak'])} GiB against {_gib(b['peak'])} GiB ({(a['peak'] - b['peak']) / GiB:+.3f}); "
          f"before recording {_gib(a['allocated_before'])} against {_gib(b['allocated_before'])} GiB")  # fmt: skip
    places = set(a["groups"]) | set(b["groups"])
    diff = {p: a["groups"].get(p, [0, 0])[0] - b["groups"].get(p, [0, 0])[0] for p in places}
    print("| first GiB | second GiB | difference | where |\n| ---: | ---: | ---: | --- |")
    for p in sorted(places, key=lambda p: -abs(diff[p]))[:top]:
        print(f"| {_gib(a['groups'].get(p, [0])[0])} | {_gib(b['groups'].get(p, [0])[0])} | {diff[p] / GiB:+.3f} | {p} |")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("snapshot")
    ap.add_argument("--against", default=None, metavar="SNAPSHOT", help="a second snapshot: print where the first holds more at its peak")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--frames", type=int, default=2, help="frames (matching --match, innermost first) that name a place")
    ap.add_argument("--match", default=DEFAULT_MATCH, help="regex on a frame's file name: the frames that name a place")
    args = ap.parse_args(argv)
    first = peak_summary(load(args.snapshot), args.match, args.frames)
    if args.against is None:
        print_summary(first, args.top)
        return first
    second = peak_summary(load(args.against), args.match, args.frames)
    print_summary(first, args.top, "first:  ")
    print_summary(second, args.top, "second: ")
    print_difference(first, second, args.top)
    return {"first": first, "second": second}


if __name__ == "__main__":
    main()
