"""The trainer options of issue 4 wired end to end: packing, token budget, gradient checkpointing,
reference offload; the step record carries MFU, throughput and memory."""

from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace

import pytest

from conftest import bench_script, small_config
from hybridrl.cli.commands import build_trainer
from hybridrl.metrics import read_records


def _first_record(tmp_path, arith_data, **overrides):
    """One step on CPU, in fp32: the packed-vs-padded test's tolerances are fp32's and it checks the CPU record's
    keys (a GPU's packed and padded steps are compared kernel by kernel in test_train_gpu.py)."""
    cfg = small_config(tmp_path, arith_data, **{"train.total_steps": 1, "trainer.save_every": 0, "data.eval_path": "null",
                                                "algorithm.kl_coef": 0.05, "train.device": "cpu", **overrides})  # fmt: skip
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
    # The host's share of the training phase: issuing the micro-batches is part of it (on CPU, most of it).
    assert 0 < packed["timing/train/actor_host_issue"] <= packed["timing/train"]


def test_compare_trl_tiny_runs_hybridrl_and_skips_a_missing_trl(tmp_path):
    compare_trl = bench_script("compare_trl")
    out = tmp_path / "table.json"
    result = compare_trl.main(["--tiny", "--steps", "2", "--trl-steps", "2", "--json", str(out)])
    assert out.exists()
    h = result["hybridrl"]
    assert h["step_time_s"] > 0 and h["response_tokens_per_s"] > 0 and len(h["step_times_s"]) == 2
    # The host's clock around each step (TRL's measure) agrees with the step record's own time.
    assert len(h["host_step_times_s"]) == 2
    for record_s, host_s in zip(h["step_times_s"], h["host_step_times_s"]):
        assert record_s <= host_s < record_s + 0.05
    assert {"rollout", "ref", "train"} <= set(h["phases_s"])
    assert 0 < h["train_host_issue_s"] <= h["phases_s"]["train"]
    trl = result["trl"]
    if "skipped" in trl:
        assert "trl" in trl["skipped"]
    else:
        assert trl["step_time_s"] > 0 and result["speedup"] > 0


def test_compare_trl_host_delay_sleeps_before_each_training_micro_batch(monkeypatch, capsys):
    """--host-delay-ms: the probe sleeps before every micro-batch's loss, and the real update loop goes
    through it (the host's issue time of the tiny run's training phase holds the sleeps)."""
    compare_trl = bench_script("compare_trl")
    calls, sleeps = [], []
    policy = SimpleNamespace(_loss=lambda micro, **kw: calls.append((micro, kw)) or ("loss", {}))
    compare_trl.delay_each_micro_batch(SimpleNamespace(policy_trainer=policy), 3.0)
    with monkeypatch.context() as m:
        m.setattr(compare_trl.time, "sleep", sleeps.append)
        assert policy._loss("m1", num_tokens=5) == ("loss", {})
        policy._loss("m2")
    assert sleeps == [0.003, 0.003] and calls == [("m1", {"num_tokens": 5}), ("m2", {})]
    result = compare_trl.main(["--tiny", "--steps", "2", "--skip-trl", "--host-delay-ms", "300"])
    assert result["hybridrl"]["train_host_issue_s"] >= 0.3
    assert result["host_delay_ms"] == 300  # and the table says so, so its figures are not taken for the plain run's
    assert "hybridrl's host slept 300 ms before each training micro-batch" in capsys.readouterr().out


def test_compare_trl_table_sets_hybridrl_against_benchmark_md_too(capsys):
    """Beside the same call's TRL run, the table sets hybridrl against BENCHMARK.md's TRL figures
    (W0.5B: 15.5 s, 22.9 GiB; target 1.9 s), which do not move with the TRL run's own spread."""
    compare_trl = bench_script("compare_trl")
    h = {"step_time_s": 2.5, "response_tokens_per_step": 131072.0, "peak_allocated_gib": 6.87}
    trl = {"step_time_s": 20.0, "response_tokens_per_step": 131072.0, "peak_allocated_gib": 13.74}
    result = compare_trl.summarise(compare_trl.workload("0.5B"), h, trl, bound_s=1.35)
    ref = result["against_benchmark_md"]
    assert ref["speedup"] == pytest.approx(6.2) and ref["memory_ratio"] == pytest.approx(0.3)
    assert result["speedup"] == pytest.approx(8.0) and result["memory_ratio"] == pytest.approx(0.5)
    compare_trl.print_table(result)
    out = capsys.readouterr().out
    assert "against BENCHMARK.md's TRL figures (15.5 s, 22.9 GiB): 6.2x shorter, 30% of its memory; the target is 1.9 s" in out
    w15 = compare_trl.summarise(compare_trl.workload("1.5B"), dict(h), dict(trl), bound_s=None)
    assert w15["against_benchmark_md"]["speedup"] == pytest.approx(20.4 / 2.5) and w15["against_benchmark_md"]["target_step_time_s"] is None
    # The three lines, each with its verdict: W0.5B only (W1.5B has no step-time target).
    assert {k: v["met"] for k, v in result["targets"].items()} == {"step_time_s": False, "speedup": True, "memory_ratio": True}
    assert "targets: step 2.50 s against <= 1.9 s: not met; 8.0x shorter than this call's TRL against >= 8x: met; 50% of its peak against <= 50%: met" in out
    assert "targets" not in w15
    slow_trl = compare_trl.summarise(compare_trl.workload("0.5B"), dict(h, step_time_s=1.8), dict(trl, step_time_s=12.0, peak_allocated_gib=13.0), bound_s=1.35)
    assert {k: v["met"] for k, v in slow_trl["targets"].items()} == {"step_time_s": True, "speedup": False, "memory_ratio": False}
    alone = compare_trl.summarise(compare_trl.workload("0.5B"), dict(h), {"skipped": "--skip-trl"}, bound_s=1.35)
    assert "targets" not in alone  # the ratios need TRL in the same call
    # CPU (no peak memory) and the tiny workload: BENCHMARK.md has no figure to set them against
    assert "against_benchmark_md" not in compare_trl.summarise(compare_trl.workload("tiny"), dict(h), dict(trl), bound_s=None)
    assert "against_benchmark_md" not in compare_trl.summarise(compare_trl.workload("0.5B"), {"step_time_s": 2.5, "response_tokens_per_step": 1.0, "peak_allocated_gib": None}, {}, bound_s=None)


def test_compare_trl_physical_bound_is_the_gpu_it_ran_on(monkeypatch, capsys):
    """BENCHMARK.md's bound (1.35 s at W0.5B), TRL figures and 1.9 s target are one H200's. On another GPU the
    bound comes from that GPU's measured copy and matmul rates, and the table says whose figures it sets against."""
    compare_trl = bench_script("compare_trl")
    w05, w15 = compare_trl.workload("0.5B"), compare_trl.workload("1.5B")
    n05, b05, n15, b15 = 494_032_768, 988_065_536, 1_543_714_304, 3_087_428_608  # the synthetic models' (compare_trl's JSON)
    assert compare_trl.device_limits("NVIDIA H200") is compare_trl.H200_LIMITS
    assert compare_trl.physical_bound_s(w05, n05, b05, compare_trl.H200_LIMITS) == 1.35
    h200_15 = compare_trl.physical_bound_s(w15, n15, b15, compare_trl.H200_LIMITS)
    assert h200_15 == pytest.approx(3.95, abs=0.01)  # the figure the W1.5B tables have printed since session 20
    # The formula gives BENCHMARK.md's own 1.35 s for W0.5B at the H200's rates (within its rounding)
    h200_05 = compare_trl.physical_bound_s(w05, n05, b05, dict(compare_trl.H200_LIMITS))
    assert h200_05 == pytest.approx(1.35, abs=0.05)
    # An H100's measured rates: the bound follows them (decode by the bandwidth, training by the matmul rate)
    h100 = {"hbm_bytes_per_s": 3.0e12, "bf16_flops": 700e12}
    monkeypatch.setattr(compare_trl, "measure_device_limits", lambda: dict(h100))
    limits = compare_trl.device_limits("NVIDIA H100 80GB HBM3")
    assert limits["source"] == "measured on this GPU: 3.00 TB/s copy, 700 TFLOP/s bf16 matmul"
    slow_copy = compare_trl.physical_bound_s(w05, n05, b05, dict(h100, bf16_flops=790e12))
    assert slow_copy > h200_05 and compare_trl.physical_bound_s(w05, n05, b05, limits) > slow_copy
    bound = compare_trl.physical_bound_s(w05, n05, b05, limits)
    h = {"step_time_s": 2.67, "response_tokens_per_step": 131072.0, "peak_allocated_gib": 6.2}
    trl = {"step_time_s": 25.76, "response_tokens_per_step": 131072.0, "peak_allocated_gib": 13.2}
    result = compare_trl.summarise(w05, h, trl, bound)
    result.update(device="NVIDIA H100 80GB HBM3", physical_bound_limits=limits)
    compare_trl.print_table(result)
    out = capsys.readouterr().out
    assert f"of the physical bound ({bound:.2f} s; measured on this GPU: 3.00 TB/s copy, 700 TFLOP/s bf16 matmul)" in out
    assert "targets: step 2.67 s against <= 1.9 s (an H200's target): not met" in out
    assert "(BENCHMARK.md's figures are one H200's; this call ran on NVIDIA H100 80GB HBM3)" in out
    result.update(device="NVIDIA H200", physical_bound_limits=compare_trl.H200_LIMITS, hybridrl_fraction_of_bound=1.35 / 2.67,
                  physical_bound_s=1.35)  # fmt: skip
    compare_trl.print_table(result)
    out = capsys.readouterr().out
    assert "of the physical bound (1.35 s; BENCHMARK.md's H200 figures)" in out and "an H200's target" not in out


def test_tiny_learning_bench_evaluates_at_its_marks(tmp_path):
    tiny_learning = bench_script("tiny_learning")
    out = tmp_path / "curve.json"
    result = tiny_learning.main(["--budget", "1", "--marks", "0.3,1", "--skip-trl", "--json", str(out)])
    assert out.exists()
    h = result["hybridrl"]
    curve = h["curve"]
    assert [p["train_s"] >= m for p, m in zip(curve, (0.0, 0.3, 1.0))] == [True, True, True] and len(curve) == 3
    assert curve[0]["accuracy"] == 0.265  # the shipped model, greedy, as `hybridrl demo` reports it before training
    assert h["steps"] == curve[-1]["steps"] > 0 and h["s_per_step"] > 0


def test_trace_summary_attributes_kernels_and_idle_gpu_time_to_phases(tmp_path):
    """bench/trace_summary.py on a hand-made trace: busy time is the union of kernel intervals, and
    each idle interval goes to the host range it falls in (a compiled forward) or to 'elsewhere'."""
    trace_summary = bench_script("trace_summary")
    X = dict(ph="X", tid=1, pid=1)
    events = [
        {**X, "cat": "user_annotation", "name": "phase/train", "ts": 0, "dur": 100},
        {**X, "cat": "cpu_op", "name": "Torch-Compiled Region: 0/1", "ts": 12, "dur": 16},
        *({**X, "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t, "dur": 1, "args": {"correlation": c}}
          for c, t in ((1, 1), (2, 13), (3, 80))),
        {**X, "cat": "kernel", "name": "gemm<float>(int)", "ts": 0, "dur": 10, "args": {"correlation": 1}},
        {**X, "cat": "kernel", "name": "gemm<float>(int)", "ts": 5, "dur": 5, "args": {"correlation": 2}},  # overlaps the first
        {**X, "cat": "kernel", "name": "add", "ts": 30, "dur": 10, "args": {"correlation": 3}},
        {**X, "cat": "kernel", "name": "add", "ts": 90, "dur": 10, "args": {"correlation": 3}},
    ]
    summary = trace_summary.summarise(events)
    assert summary["phase/train"]["busy_ms"] == 0.03 and summary["phase/train"]["wall_ms"] == 0.1
    assert summary["phase/train"]["top"] == [("add", pytest.approx(0.02), 2), ("gemm", pytest.approx(0.015), 2)]
    idle = trace_summary.idle_by_host_activity(events)["phase/train"]
    assert idle == {"compiled forward": pytest.approx(0.02), "elsewhere": pytest.approx(0.05)}


def test_trace_summary_names_the_operator_and_frame_on_the_launching_thread():
    """`launchers` attributes each matching kernel of a phase to the innermost operator and project
    frame of the thread that launched it (the autograd engine's own thread for the backward)."""
    trace_summary = bench_script("trace_summary")
    X = dict(ph="X", pid=1)
    events = [
        {**X, "tid": 1, "cat": "user_annotation", "name": "phase/train", "ts": 0, "dur": 100},
        {**X, "tid": 1, "cat": "python_function", "name": "hybridrl/train/update.py(10): step", "ts": 0, "dur": 50},
        {**X, "tid": 1, "cat": "python_function", "name": "hybridrl/train/policy.py(5): loss", "ts": 5, "dur": 10},
        {**X, "tid": 1, "cat": "cpu_op", "name": "aten::mul", "ts": 6, "dur": 2},
        {**X, "tid": 2, "cat": "cpu_op", "name": "aten::zero_", "ts": 6, "dur": 3},  # another thread, same time
        *({**X, "tid": tid, "cat": "cuda_runtime", "name": "launch", "ts": t, "dur": 1, "args": {"correlation": c}}
          for c, t, tid in ((1, 7, 1), (2, 7, 2), (3, 120, 1))),
        {**X, "tid": 7, "cat": "kernel", "name": "elementwise_kernel<mul>(x)", "ts": 8, "dur": 4, "args": {"correlation": 1}},
        {**X, "tid": 7, "cat": "gpu_memset", "name": "Memset (Device)", "ts": 12, "dur": 2, "args": {"correlation": 2}},
        {**X, "tid": 7, "cat": "kernel", "name": "elementwise_kernel<add>(x)", "ts": 121, "dur": 4, "args": {"correlation": 3}},  # after the phase
    ]
    rows = trace_summary.launchers(events, "phase/train", "elementwise|Memset")
    assert rows == [("elementwise_kernel <- aten::mul <- train/policy.py(5): loss", pytest.approx(0.004), 1),
                    ("Memset <- aten::zero_ <- None", pytest.approx(0.002), 1)]


def test_trace_summary_names_the_blocking_call_and_the_frame_the_gpu_idled_in():
    """`why_idle`: a long runtime call of a phase goes to the innermost project frame and operator
    around it; the GPU's idle time to where the host was at each idle interval's middle."""
    trace_summary = bench_script("trace_summary")
    X = dict(ph="X", pid=1, tid=1)
    events = [
        {**X, "cat": "user_annotation", "name": "phase/train", "ts": 0, "dur": 1000},
        {**X, "cat": "python_function", "name": "/site/hybridrl/train/update.py(1): step", "ts": 0, "dur": 900},
        {**X, "cat": "cpu_op", "name": "aten::item", "ts": 100, "dur": 500},
        {**X, "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 200, "dur": 400},
        {**X, "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10, "dur": 5},  # too short to block
        {**X, "cat": "kernel", "name": "k", "ts": 0, "dur": 50},
    ]
    out = trace_summary.why_idle(events)["phase/train"]
    assert out["blocking"] == [("cudaStreamSynchronize <- train/update.py(1): step / aten::item", pytest.approx(0.4), 1)]
    assert out["idle"] == [("train/update.py(1): step / aten::item", pytest.approx(0.95), 1)]


def test_trace_summary_timeline_shows_the_copies_and_the_waits_of_a_phase(tmp_path, capsys):
    """`timeline`: the copies running during a phase, including one issued before it, in ms from its
    start, and the stretches without a kernel (copies do not count as computation)."""
    trace_summary = bench_script("trace_summary")
    X = dict(ph="X", pid=1, tid=1)
    events = [
        {**X, "cat": "user_annotation", "name": "phase/ref", "ts": 1000, "dur": 3000},
        {**X, "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 500, "dur": 1500,
         "args": {"bytes": 3 * 2**20, "stream": 7}},  # issued before the phase, still running at its start
        {**X, "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 2000, "dur": 100, "args": {"stream": 7}},
        {**X, "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 4500, "dur": 10, "args": {"stream": 7}},  # after
        {**X, "cat": "kernel", "name": "embed", "ts": 1050, "dur": 50},
        {**X, "cat": "kernel", "name": "gemm", "ts": 2150, "dur": 1800},  # waited ~1 ms for the copies
    ]
    (t,) = trace_summary.timeline(events, "phase/ref")
    assert t["wall_ms"] == 3.0
    assert t["copies"] == [(-0.5, 1.5, 3 * 2**20, 7, "Memcpy HtoD (Pinned -> Device)"), (1.0, 0.1, None, 7, "Memcpy HtoD (Pinned -> Device)")]
    assert t["idle"] == [(0.1, pytest.approx(1.05))]  # 50 us at the start and at the end are below the threshold
    # Every stretch, by length: the two 50 us ones and the 1.05 ms one.
    assert [(label, n) for label, n, _ in t["idle_by_size"]] == [
        ("0-2 us", 0), ("2-10 us", 0), ("10-50 us", 0), ("50-200 us", 2), (">= 200 us", 1)]
    assert [ms for *_, ms in t["idle_by_size"]] == [0, 0, 0, pytest.approx(0.1), pytest.approx(1.05)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    trace_summary.main([str(path), "--timeline", "phase/ref"])
    printed = capsys.readouterr().out
    assert "== phase/ref (span 0, wall 3.0 ms)" in printed
    assert "    -0.50     1.500        3.0       7  Memcpy HtoD" in printed and "no kernel running (start ms, ms): 0.10 +1.05" in printed
    assert "no kernel running, by length: 0-2 us 0x 0.00 ms, 2-10 us 0x 0.00 ms, 10-50 us 0x 0.00 ms, 50-200 us 2x 0.10 ms, >= 200 us 1x 1.05 ms" in printed


def test_host_threads_default_to_one_with_a_gpu_and_to_torchs_on_cpu():
    import torch

    from hybridrl.trainer.engine import set_host_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert set_host_threads(None, torch.device("cpu")) == 2 and torch.get_num_threads() == 2  # CPU: torch's own
        assert set_host_threads(None, torch.device("cuda", 0)) == 1 and torch.get_num_threads() == 1  # a GPU run: one
        assert set_host_threads(3, torch.device("cuda", 0)) == 3 and torch.get_num_threads() == 3  # asked for
        assert set_host_threads(1, torch.device("cpu")) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_deterministic_turns_on_torchs_deterministic_mode_and_leaves_the_cublas_workspace_alone(monkeypatch):
    import torch
    import torch.utils.deterministic

    from hybridrl.trainer.engine import set_determinism

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(False)
    set_determinism(False)  # off: torch's setting and the environment as they were
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    torch.use_deterministic_algorithms(True)
    set_determinism(False)  # a caller's own deterministic mode is not switched off
    assert torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    torch.utils.deterministic.fill_uninitialized_memory = True
    set_determinism(True)
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.utils.deterministic.fill_uninitialized_memory  # no NaN fill of every new tensor
    # Not set: torch (>= 2.11) gives each stream its own cuBLAS workspace, and on 2.11 the variable
    # costs every cuBLAS call a parse of it (set_determinism's docstring).
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    set_determinism(True)  # a workspace the user chose stays
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_a_cublas_workspace_config_in_the_environment_is_named_with_its_cost_on_torch_2_11(monkeypatch, caplog):
    import torch

    from hybridrl.trainer import engine
    from hybridrl.trainer.engine import set_determinism

    monkeypatch.setattr(engine, "_workspace_warned", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    with caplog.at_level(logging.WARNING, logger="hybridrl.trainer"):
        set_determinism(False)
    assert "CUBLAS_WORKSPACE_CONFIG=:4096:8 is set" in caplog.text and "host time to every cuBLAS product" in caplog.text
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # named, not changed
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hybridrl.trainer"):
        set_determinism(True)  # once a process
    assert "CUBLAS_WORKSPACE_CONFIG" not in caplog.text
    monkeypatch.setattr(engine, "_workspace_warned", False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    with caplog.at_level(logging.WARNING, logger="hybridrl.trainer"):
        set_determinism(False)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setattr(torch, "__version__", "2.13.0")  # measured on 2.11 only: no claim for other versions
    with caplog.at_level(logging.WARNING, logger="hybridrl.trainer"):
        set_determinism(False)
    assert "CUBLAS_WORKSPACE_CONFIG" not in caplog.text


def test_num_threads_below_one_is_refused(tmp_path, arith_data):
    from hybridrl.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match=r"train\.num_threads must be at least 1, got 0.*unset"):
        validate_config(small_config(tmp_path, arith_data, **{"train.num_threads": 0}), require_paths=False)


def test_compare_trl_sets_inductor_options_and_passes_on_the_rest():
    import torch._inductor.config as inductor_config

    compare_trl = bench_script("compare_trl")
    with inductor_config.patch({"cpp_wrapper": False, "triton.cudagraphs": False}):  # restored on exit
        rest = compare_trl.apply_inductor_settings(["train.lr=1e-5", "inductor.cpp_wrapper=true", "inductor.triton.cudagraphs=true"])
        assert rest == ["train.lr=1e-5"]
        assert inductor_config.cpp_wrapper is True and inductor_config.triton.cudagraphs is True
        with pytest.raises(ValueError, match="no 'not_an_option'"):
            compare_trl.apply_inductor_settings(["inductor.not_an_option=1"])
        with pytest.raises(ValueError, match="no 'nowhere.cudagraphs'"):
            compare_trl.apply_inductor_settings(["inductor.nowhere.cudagraphs=1"])
    assert inductor_config.cpp_wrapper is False and inductor_config.triton.cudagraphs is False
