"""The garbage collector's time in the step record (`perf/gc_s`, `perf/gc_collections`)."""

from __future__ import annotations

import gc

from conftest import small_config
from hybridrl.cli.commands import build_trainer
from hybridrl.metrics import GcClock, read_records


class _Cycle:
    def __init__(self):
        self.me = self


def test_gc_clock_counts_the_collections_run_inside_it_and_nothing_outside():
    clock = GcClock()
    gc.collect()  # before: not counted
    with clock:
        for _ in range(2000):
            _Cycle()
        gc.collect()
        gc.collect(0)
    gc.collect()  # after exit: not counted either
    first = clock.pop()
    assert first["perf/gc_collections"] >= 2  # the two explicit ones, plus any the allocations triggered
    assert first["perf/gc_s"] > 0
    assert clock.pop() == {"perf/gc_s": 0.0, "perf/gc_collections": 0.0}  # pop resets
    assert clock._callback not in gc.callbacks  # exit removed the hook


def test_every_step_record_carries_the_collectors_time_and_the_hook_is_gone_after(tmp_path, arith_data):
    cfg = small_config(tmp_path, arith_data, **{"train.total_steps": 2, "trainer.save_every": 0, "data.eval_path": "null",
                                                "train.batch_size": 16, "train.micro_batch_size": 8})  # fmt: skip
    trainer = build_trainer(cfg)
    forced = []

    def collect_in_step_2(record):  # stop_when runs after step 1's record: make step 2 collect for sure
        if record["step"] == 1:
            trainer.rollout.generate = _collecting(trainer.rollout.generate, forced)
        return False

    trainer.fit(stop_when=collect_in_step_2)
    records = read_records(trainer.metrics.path)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["perf/gc_s"] >= 0 and r["perf/gc_collections"] >= 0 for r in records)
    assert forced == [True] and records[1]["perf/gc_collections"] >= 1 and records[1]["perf/gc_s"] > 0
    assert trainer.gc_clock._callback not in gc.callbacks


def _parked() -> int:
    """The permanent generation's count with nothing frozen: 0 before Python 3.12; from 3.12 a
    collection parks some of the interpreter's immortal objects there by itself (375 on 3.12.1, at
    start-up and after any `gc.collect()`; see `GcClock`)."""
    gc.unfreeze()
    gc.collect()
    return gc.get_freeze_count()


def _collecting(generate, forced):
    def wrapper(*args, **kwargs):
        gc.collect()
        forced.append(True)
        return generate(*args, **kwargs)

    return wrapper


def test_freeze_collects_the_garbage_first_and_unfreeze_returns_the_objects():
    """`freeze` runs a full collection before gc.freeze: cyclic garbage made before it is freed, not
    frozen; live objects go to the permanent generation; `unfreeze` gives them back."""
    import weakref

    parked = _parked()
    clock = GcClock()
    garbage = _Cycle()
    dead = weakref.ref(garbage)
    alive = _Cycle()
    del garbage
    with clock:
        frozen = clock.freeze()
    assert dead() is None  # collected by the freeze's own collection
    assert frozen > parked
    assert all(o is not alive for o in gc.get_objects())  # frozen: no generation lists it now
    assert clock.pop()["perf/gc_collections"] >= 1  # the freeze's collection is the step's time
    clock.unfreeze()
    assert gc.get_freeze_count() == 0
    clock.unfreeze()  # twice: a no-op
    assert gc.get_freeze_count() == 0


def test_fit_freezes_after_the_first_step_and_unfreezes_at_the_end(tmp_path, arith_data):
    """trainer.gc_freeze (default on): from step 2 on the run's long-lived objects are frozen; after
    fit they are the collector's again, so a trainer dropped afterwards is freed. Off: no freeze."""
    import weakref

    seen = {}
    parked = _parked()
    for on in (True, False):
        cfg = small_config(tmp_path / str(on), arith_data, **{"train.total_steps": 2, "trainer.save_every": 0, "data.eval_path": "null",
                                                              "train.batch_size": 16, "train.micro_batch_size": 8, "trainer.gc_freeze": on})  # fmt: skip
        trainer = build_trainer(cfg)
        counts = []
        trainer.fit(stop_when=lambda record: counts.append(gc.get_freeze_count()) and False)
        seen[on] = counts
        if on:
            assert gc.get_freeze_count() == 0  # fit's last act: gc.unfreeze
        gc.collect()
        assert gc.get_freeze_count() == parked  # nothing but what a collection parks by itself
        model = weakref.ref(trainer.model)
        del trainer
        gc.collect()
        assert model() is None  # nothing of the run stays frozen after fit
    assert all(c > parked for c in seen[True]) and seen[False] == [parked, parked]
