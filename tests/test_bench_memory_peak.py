"""bench/memory_peak.py (the live allocations at a step's memory peak, from an allocator snapshot)
and compare_trl.py's --memory-snapshot option, on a synthetic snapshot (recording needs a GPU)."""

from __future__ import annotations

import pickle

import pytest

from conftest import bench_script

MiB = 2**20


def _frame(file: str, line: int, name: str) -> dict:
    return {"filename": file, "line": line, "name": name}


ATTN = [_frame("/x/torch/nn/functional.py", 10, "linear"), _frame("/repo/hybridrl/train/attention.py", 240, "gather_rows"),
        _frame("/repo/hybridrl/train/logprobs.py", 80, "response_logprobs")]  # fmt: skip
HEAD = [_frame("/repo/hybridrl/train/lm_head.py", 55, "chunk"), _frame("/repo/hybridrl/train/logprobs.py", 90, "response_logprobs")]


def _snapshot(trace: list[dict], before: int = 0) -> dict:
    return {"segments": [], "device_traces": [[], trace], "hybridrl": {"step": 3, "allocated_before": before}}


def _alloc(addr, mib, frames):
    return {"action": "alloc", "addr": addr, "size": mib * MiB, "frames": frames, "stream": 0}


def _free(addr, mib, completed=False):
    return {"action": "free_completed" if completed else "free_requested", "addr": addr, "size": mib * MiB, "frames": [], "stream": 0}


def test_the_peak_and_what_is_live_at_it_grouped_by_frame(tmp_path, capsys):
    memory_peak = bench_script("memory_peak")
    trace = [
        _alloc(1, 100, ATTN), _alloc(2, 50, ATTN), _free(2, 50), _free(2, 50, completed=True),  # freed when requested
        _free(99, 30),  # a block from before the recording: the total falls below the start
        _alloc(3, 200, HEAD), _alloc(4, 20, HEAD),  # peak: 100 + 200 + 20 - 30 = 290 MiB over the start
        _free(3, 200), _alloc(5, 150, ATTN),  # later, lower: 100 + 20 + 150 - 30 = 240
    ]  # fmt: skip
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(_snapshot(trace, before=1024 * MiB)))
    s = memory_peak.main([str(path)])
    assert s["peak"] == (1024 + 290) * MiB and s["peak_at"] == 6 and s["entries"] == len(trace)
    assert s["traced_at_peak"] == 320 * MiB  # blocks 1, 3, 4 (the pre-recording free is not itemised)
    assert s["groups"] == {"lm_head.py:55 chunk < logprobs.py:90 response_logprobs": [220 * MiB, 2],
                           "attention.py:240 gather_rows < logprobs.py:80 response_logprobs": [100 * MiB, 1]}  # fmt: skip
    out = capsys.readouterr().out
    assert "peak 1.283 GiB" in out and "| 0.215 | 2 | lm_head.py:55 chunk" in out
    # One frame per place, and a --match that no frame meets (the innermost frame names the place).
    assert set(memory_peak.peak_summary(_snapshot(trace), frames=1)["groups"]) == {"lm_head.py:55 chunk", "attention.py:240 gather_rows"}
    assert set(memory_peak.peak_summary(_snapshot(trace), match="nothing-matches")["groups"]) == {"functional.py:10 linear", "lm_head.py:55 chunk"}


def test_against_a_second_snapshot_sorts_the_places_by_what_the_first_holds_more(tmp_path, capsys):
    memory_peak = bench_script("memory_peak")
    a, b = tmp_path / "a.pickle", tmp_path / "b.pickle"
    a.write_bytes(pickle.dumps(_snapshot([_alloc(1, 100, ATTN), _alloc(2, 200, HEAD)])))
    b.write_bytes(pickle.dumps(_snapshot([_alloc(1, 10, ATTN), _alloc(2, 190, HEAD)])))
    result = memory_peak.main([str(a), "--against", str(b)])
    assert result["first"]["peak"] - result["second"]["peak"] == 100 * MiB
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 0.")]
    assert rows[-2].endswith("attention.py:240 gather_rows < logprobs.py:80 response_logprobs |") and "+0.088" in rows[-2]
    assert "+0.010" in rows[-1]


def test_a_snapshot_without_a_trace_is_refused_with_the_fix(tmp_path):
    memory_peak = bench_script("memory_peak")
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
    with pytest.raises(SystemExit, match="_record_memory_history"):
        memory_peak.main([str(path)])


def test_compare_trl_memory_snapshot_argument_and_variant_files():
    compare_trl = bench_script("compare_trl")
    assert compare_trl.parse_memory_snapshot("3:out/s.pickle") == (3, "out/s.pickle")
    assert compare_trl.parse_memory_snapshot(None) is None
    for bad in ("s.pickle", "0:s.pickle", "x:s.pickle", "3:"):
        with pytest.raises(SystemExit, match="STEP:FILE"):
            compare_trl.parse_memory_snapshot(bad)
    assert compare_trl.snapshot_for_variant("3:out/s.pickle", None) == "3:out/s.pickle"
    assert compare_trl.snapshot_for_variant("3:out/s.pickle", "det") == "3:out/s.det.pickle"


def test_compiled_graph_buffers_are_named_by_their_source_lines_across_runs(tmp_path, capsys):
    """Inductor names its generated module by a hash of the graph, so a run whose graph differs (the
    deterministic mode) has other file names for the same buffers; the place is the source frames."""
    memory_peak = bench_script("memory_peak")

    def compiled(hash_: str, line: int) -> list[dict]:
        return [_frame(f"/tmp/torchinductor_root/{hash_[1:3]}/{hash_}.py", line, "call"),
                _frame("/x/transformers/models/qwen2/modeling_qwen2.py", 47, "forward"),
                _frame("/repo/hybridrl/train/setup.py", 128, "grouped_decoder_forward")]  # fmt: skip

    a, b = tmp_path / "a.pickle", tmp_path / "b.pickle"
    a.write_bytes(pickle.dumps(_snapshot([_alloc(1, 120, compiled("c3hulkozxqgtwllge2455pn7all37xze3hu", 1951)), _alloc(2, 5, HEAD)])))
    b.write_bytes(pickle.dumps(_snapshot([_alloc(1, 100, compiled("cro3qzsby2emc6huxw6x4pzmi4ugatlsk53b", 2725)), _alloc(2, 5, HEAD)])))
    result = memory_peak.main([str(a), "--against", str(b), "--frames", "1"])
    place = "(compiled) modeling_qwen2.py:47 forward"
    assert set(result["first"]["groups"]) == set(result["second"]["groups"]) == {place, "lm_head.py:55 chunk"}
    assert result["first"]["groups"][place] == [120 * MiB, 1] and result["second"]["groups"][place] == [100 * MiB, 1]
    assert result["first"]["peak_where"] == "lm_head.py:55 chunk < logprobs.py:90 response_logprobs"
    out = capsys.readouterr().out
    assert f"| 0.117 | 0.098 | +0.020 | {place} |" in out
    assert "the allocation that reached it: lm_head.py:55 chunk" in out
    # A frame in inductor's own package (not a generated module) still names a place.
    own = [_frame("/x/torch/_inductor/runtime/triton_heuristics.py", 9, "run")] + compiled("cabcdefghijklmnopqrstuvwxyz", 3)
    assert memory_peak.where(_alloc(1, 1, own), memory_peak.re.compile(memory_peak.DEFAULT_MATCH), 1) == "triton_heuristics.py:9 run"
