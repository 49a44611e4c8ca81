"""metrics.jsonl: cutting it back to a resumed step, and where the records past it go."""

import json

import pytest

from hybridrl.metrics import JsonlSink, MetricsWriteError, read_records


def sink_with(tmp_path, steps, partial=False):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for step in steps:
        sink.write({"step": step, "reward/mean": step / 10})
    if partial:  # what a kill in the middle of a write leaves
        with open(sink.path, "a", encoding="utf-8") as f:
            f.write('{"step": 6, "rew')
    return sink


def test_truncate_after_spills_complete_records_only(tmp_path):
    sink = sink_with(tmp_path, [1, 2, 3, 4, 5], partial=True)
    spill = tmp_path / "aside" / "metrics.jsonl"
    assert sink.truncate_after(2, spill=spill) == (4, 3)  # three records and the partial line; the records spilled
    assert [r["step"] for r in read_records(sink.path)] == [1, 2]
    assert [json.loads(line)["step"] for line in spill.read_text().splitlines()] == [3, 4, 5]


def test_truncate_after_without_records_past_the_step_writes_no_spill(tmp_path):
    sink = sink_with(tmp_path, [1, 2])
    spill = tmp_path / "aside" / "metrics.jsonl"
    assert sink.truncate_after(2, spill=spill) == (0, 0)
    assert not spill.parent.exists()


def test_a_spill_that_cannot_be_written_leaves_the_records_where_they_were(tmp_path):
    sink = sink_with(tmp_path, [1, 2, 3])
    (tmp_path / "blocker").write_text("a file where the spill's directory would go")
    with pytest.raises(MetricsWriteError, match="records past step 1 to .*blocker"):
        sink.truncate_after(1, spill=tmp_path / "blocker" / "metrics.jsonl")
    assert [r["step"] for r in read_records(sink.path)] == [1, 2, 3]
