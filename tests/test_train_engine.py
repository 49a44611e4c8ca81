"""The trainer options of issue 4 wired end to end: packing, token budget, gradient checkpointing,
reference offload; the step record carries MFU, throughput and memory."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from conftest import small_config
from hybridrl.cli.commands import build_trainer
from hybridrl.metrics import read_records

REPO = Path(__file__).resolve().parents[1]


def _first_record(tmp_path, arith_data, **overrides):
    cfg = small_config(tmp_path, arith_data, **{"train.total_steps": 1, "trainer.save_every": 0, "data.eval_path": "null",
                                                "algorithm.kl_coef": 0.05, **overrides})  # fmt: skip
    trainer = build_trainer(cfg)
    trainer.fit()
    return trainer, read_records(trainer.metrics.path)[0]


def test_packed_token_budget_step_matches_the_padded_step(tmp_path, arith_data):
    _, padded = _first_record(tmp_path / "a", arith_data, **{"train.packing": "off"})
    trainer, packed = _first_record(
        tmp_path / "b", arith_data,
        **{"train.packing": "on", "train.max_tokens_per_micro_batch": 96, "model.gradient_checkpointing": "true",
           "train.offload_reference": "true"},
    )  # fmt: skip
    assert trainer.packed and trainer.ref_offload is not None
    assert packed["reward/mean"] == padded["reward/mean"]  # the same rollout
    for key in ("actor/pg_loss", "actor/grad_norm"):  # sums over the mini-batch: the same whatever the micro-batches
        assert packed[key] == pytest.approx(padded[key], abs=1e-6, rel=1e-4), key
    for key in ("actor/kl", "actor/entropy"):  # means of per-micro-batch means: other micro-batches, other weights
        assert packed[key] == pytest.approx(padded[key], rel=5e-3), key
    for key in ("perf/mfu/actor", "perf/mfu/ref", "perf/tokens_per_s", "perf/train_tflops"):
        assert key in packed
    assert packed["perf/mfu/actor"] is None  # CPU: no known peak
    assert packed["perf/train_tflops"] < padded["perf/train_tflops"]  # a shared prompt is computed once
    assert packed["perf/tokens_per_s"] > 0 and "memory/peak_rss_gib" in packed


def _bench_script(name: str):
    """Imports bench/<name>.py (the benchmarks are scripts, not a package)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "bench"))


def test_compare_trl_tiny_runs_hybridrl_and_skips_a_missing_trl(tmp_path):
    compare_trl = _bench_script("compare_trl")
    out = tmp_path / "table.json"
    result = compare_trl.main(["--tiny", "--steps", "2", "--trl-steps", "2", "--json", str(out)])
    assert out.exists()
    h = result["hybridrl"]
    assert h["step_time_s"] > 0 and h["response_tokens_per_s"] > 0 and len(h["step_times_s"]) == 2
    assert {"rollout", "ref", "train"} <= set(h["phases_s"])
    trl = result["trl"]
    if "skipped" in trl:
        assert "trl" in trl["skipped"]
    else:
        assert trl["step_time_s"] > 0 and result["speedup"] > 0


def test_tiny_learning_bench_evaluates_at_its_marks(tmp_path):
    tiny_learning = _bench_script("tiny_learning")
    out = tmp_path / "curve.json"
    result = tiny_learning.main(["--budget", "1", "--marks", "0.3,1", "--skip-trl", "--json", str(out)])
    assert out.exists()
    h = result["hybridrl"]
    curve = h["curve"]
    assert [p["train_s"] >= m for p, m in zip(curve, (0.0, 0.3, 1.0))] == [True, True, True] and len(curve) == 3
    assert curve[0]["accuracy"] == 0.265  # the shipped model, greedy, as `hybridrl demo` reports it before training
    assert h["steps"] == curve[-1]["steps"] > 0 and h["s_per_step"] > 0
