"""Compilation in the step record (`perf/compile_s`, `perf/compiles/graphs`, `perf/compiles/triton`)."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from conftest import small_config
from hybridrl.cli.commands import build_trainer
from hybridrl.metrics import CompileClock, read_records


def test_compile_clock_counts_torch_compile_graphs_and_backwards_inside_it_only():
    @torch.compile(backend="aot_eager", dynamic=False)
    def f(x):
        return (x.sin() * 2).sum()

    clock = CompileClock()
    f(torch.randn(3, requires_grad=True)).backward()  # before: not counted
    with clock:
        f(torch.randn(3, requires_grad=True)).backward()  # compiled already: nothing new
    assert clock.pop() == {"perf/compile_s": 0.0, "perf/compiles/graphs": 0.0, "perf/compiles/triton": 0.0}
    with clock:
        f(torch.randn(5, requires_grad=True)).backward()  # a new shape: a forward graph and its backward
    counted = clock.pop()
    assert counted["perf/compiles/graphs"] == 2 and counted["perf/compile_s"] > 0
    assert clock.names == ["2 torch.compile graph(s)"]
    f(torch.randn(7, requires_grad=True)).backward()  # between steps (an evaluation): not the next step's
    with clock:
        pass
    assert clock.pop()["perf/compiles/graphs"] == 0


def test_compile_clock_times_triton_compilations_through_its_hooks_and_restores_theirs(monkeypatch):
    """Triton calls `jit_cache_hook` before compiling a kernel and `jit_post_compile_hook` after
    (triton/runtime/jit.py, `_do_compile`), with keyword arguments; here the two calls are made as
    Triton makes them, on a stand-in for `triton.knobs.runtime` (no kernel compiles on a CPU, and
    Triton may not be installed there)."""
    calls = []
    theirs = (lambda **kw: calls.append(("before", kw["fn"].name)), lambda **kw: calls.append(("after", kw["fn"].name)))
    knobs = types.SimpleNamespace(jit_cache_hook=theirs[0], jit_post_compile_hook=theirs[1])
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(knobs=types.SimpleNamespace(runtime=knobs)))
    clock = CompileClock()
    with clock:
        kernel = dict(key="k", repr="r", fn=types.SimpleNamespace(name="_varlen_fwd_kernel"), compile={},
                      is_manual_warmup=False, already_compiled=False)  # fmt: skip
        assert not knobs.jit_cache_hook(**kernel)  # a false result: Triton goes on compiling
        knobs.jit_post_compile_hook(**kernel)
        knobs.jit_post_compile_hook(**kernel)  # a post-compile call with no compilation begun (inductor's): not counted
    assert (knobs.jit_cache_hook, knobs.jit_post_compile_hook) == theirs  # restored at exit
    counted = clock.pop()
    assert counted["perf/compiles/triton"] == 1 and counted["perf/compile_s"] > 0
    assert clock.names == ["_varlen_fwd_kernel"]
    assert calls == [("before", "_varlen_fwd_kernel"), ("after", "_varlen_fwd_kernel"), ("after", "_varlen_fwd_kernel")]
    # A hook before ours that tells Triton to skip the compilation: nothing compiled, nothing counted
    knobs.jit_cache_hook = lambda **kw: True
    with clock:
        assert knobs.jit_cache_hook(**kernel) is True
    assert clock.pop()["perf/compiles/triton"] == 0


def test_the_triton_hooks_the_compile_clock_uses_exist_where_triton_is_installed():
    runtime = pytest.importorskip("triton").knobs.runtime
    assert hasattr(runtime, "jit_cache_hook") and hasattr(runtime, "jit_post_compile_hook")


def test_every_step_record_says_what_compiled_and_a_later_step_that_compiles_is_logged(tmp_path, arith_data, caplog):
    cfg = small_config(tmp_path, arith_data, **{"train.total_steps": 2, "trainer.save_every": 0, "data.eval_path": "null",
                                                "train.batch_size": 16, "train.micro_batch_size": 8})  # fmt: skip
    trainer = build_trainer(cfg)
    compiled = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)

    def compile_in_step_2(record):  # stop_when runs after step 1's record: make step 2 compile a graph
        if record["step"] == 1:
            generate = trainer.rollout.generate

            def wrapper(*args, **kwargs):
                compiled(torch.randn(11))
                return generate(*args, **kwargs)

            trainer.rollout.generate = wrapper
        return False

    with caplog.at_level(logging.INFO, logger="hybridrl.trainer"):
        trainer.fit(stop_when=compile_in_step_2)
    records = read_records(trainer.metrics.path)
    assert [r["step"] for r in records] == [1, 2]
    # This small run compiles no torch.compile graph. On a GPU its first step compiles the native
    # engine's Triton kernels (on CPU the engine runs PyTorch ops): compile time iff something compiled.
    assert records[0]["perf/compiles/graphs"] == 0
    assert (records[0]["perf/compile_s"] > 0) == (records[0]["perf/compiles/triton"] > 0)
    if not torch.cuda.is_available():
        assert records[0]["perf/compiles/triton"] == 0 and records[0]["perf/compile_s"] == 0
    assert records[1]["perf/compiles/graphs"] == 1 and records[1]["perf/compile_s"] > 0
    assert records[1]["perf/compiles/triton"] == 0  # every kernel of step 2 was compiled in step 1
    assert any("step 2 spent" in m and "compiling: 1 torch.compile graph(s)" in m for m in caplog.messages)
