"""Faults injected into a tiny run: NaN/inf losses, out-of-memory, a full disk, preemption in-process."""

import copy
import errno
import os
import signal
import time

import pytest
import torch
import yaml

from conftest import BIT_EXACT, small_config
from hybridrl.checkpoint import CheckpointError, CheckpointManager
from hybridrl.cli.commands import build_trainer
from hybridrl.cli.main import main
from hybridrl.config import to_dict
from hybridrl.metrics import MetricsWriteError, read_records
from hybridrl.train import oom, update
from hybridrl.train.optim import build_optimizer, build_scheduler, lr_lambda, step_schedule

FAST = {"data.eval_path": "null", "trainer.save_every": 0, "train.batch_size": 16, "train.micro_batch_size": 8}


def config(tmp_path, arith_data, **overrides):
    return small_config(tmp_path, arith_data, **{**FAST, **overrides})


def snapshot(trainer):
    return {
        "weights": {k: v.clone() for k, v in trainer.model.state_dict().items()},
        "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
        "scheduler": copy.deepcopy(trainer.scheduler.state_dict()),
    }


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def poison_losses(monkeypatch, trainer, bad_steps, value=float("nan")):
    """Multiplies every micro-batch loss by `value` during the given (1-based) steps."""
    real = update._accumulate

    def accumulate(micro_batches, loss_fn):
        if trainer.step + 1 not in bad_steps:
            return real(micro_batches, loss_fn)
        return real(micro_batches, lambda m: (lambda loss, metrics: (loss * value, metrics))(*loss_fn(m)))

    monkeypatch.setattr(update, "_accumulate", accumulate)


# ---- NaN / inf --------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_loss_skips_the_update_and_leaves_optimizer_and_schedule_untouched(tmp_path, arith_data, monkeypatch, value):
    # A warmup schedule, so that a scheduler step would show in the learning rate.
    cfg = config(tmp_path, arith_data, **{"train.total_steps": 3, "train.warmup_steps": 5})
    trainer = build_trainer(cfg)
    poison_losses(monkeypatch, trainer, bad_steps={2}, value=value)
    states = []
    trainer.fit(stop_when=lambda record: states.append(snapshot(trainer)) and False)
    after_1, after_2, after_3 = states
    assert same(after_1, after_2), "a skipped update changed the weights, the optimizer or the LR schedule"
    assert not same(after_2["weights"], after_3["weights"])  # training goes on afterwards
    assert after_3["scheduler"]["last_epoch"] == 2  # two applied updates, two scheduler steps
    records = read_records(trainer.metrics.path)
    assert [r["train/skipped_steps"] for r in records] == [0, 1, 1]
    assert records[1]["actor/grad_norm"] is None and records[1]["actor/lr"] == records[2]["actor/lr"]


def test_consecutive_non_finite_steps_abort_with_a_clear_message(tmp_path, arith_data, monkeypatch, capsys, recwarn):
    cfg = config(tmp_path, arith_data, **{"train.max_skipped_steps": 2, "train.total_steps": 5})
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(to_dict(cfg)))
    real_build = build_trainer

    def build_poisoned(cfg):
        trainer = real_build(cfg)
        poison_losses(monkeypatch, trainer, bad_steps={1, 2, 3, 4, 5})
        return trainer

    monkeypatch.setattr("hybridrl.cli.commands.build_trainer", build_poisoned)
    assert main(["train", str(cfg_path)]) == 2
    err = capsys.readouterr().err
    assert "error: 2 consecutive steps had NaN/inf losses or gradients, so training stopped (train.max_skipped_steps)" in err
    assert "Lower train.lr" in err and "Traceback" not in err
    assert [r["train/skipped_steps"] for r in read_records(tmp_path / "run" / "metrics.jsonl")] == [1]
    # The LR schedule still advances over skipped updates, without torch's warning about the call order.
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]


def test_schedule_steps_over_a_skipped_first_update_without_a_call_order_warning(recwarn):
    """The shared mechanism behind the RL epochs and the offline (SFT / DPO / KTO) step."""
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    sched = build_scheduler(opt, warmup_steps=4, total_steps=10, schedule="constant")
    step_schedule(sched)  # no optimizer.step(): the step's only update was skipped
    assert sched.last_epoch == 1
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_lambda(1, warmup_steps=4, total_steps=10, schedule="constant", min_lr_ratio=0.0))
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]


# ---- out of memory ----------------------------------------------------------------------------

def oom_error():
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")


def test_training_micro_batch_oom_is_retried_with_halved_micro_batches(tmp_path, arith_data, monkeypatch):
    # On CPU, where the weights are fp32: in bf16 (a GPU's default) the halved micro-batches' other rounding can flip
    # the sign of a near-zero gradient, which Adam's first update turns into a full lr step, so no tolerance both
    # holds there and could fail. The OOM is injected, so the retry under test is the same on any device.
    steps = {"train.total_steps": 2, "train.device": "cpu"}
    reference = build_trainer(config(tmp_path / "a", arith_data, **steps))
    reference.fit()
    trainer = build_trainer(config(tmp_path / "b", arith_data, **steps))
    real = update._accumulate
    sizes = []

    def accumulate(micro_batches, loss_fn):
        sizes.append([m.size for m in micro_batches])
        if any(m.size > 4 for m in micro_batches):  # only micro-batches of <= 4 sequences fit
            raise oom_error()
        return real(micro_batches, loss_fn)

    monkeypatch.setattr(update, "_accumulate", accumulate)
    trainer.fit()
    assert sizes[:2] == [[8, 8], [4, 4, 4, 4]]
    assert [r["train/oom_retries"] for r in read_records(trainer.metrics.path)] == [1, 1]
    # The same gradient, summed in another order: equal up to float rounding.
    for (name, a), b in zip(reference.model.state_dict().items(), trainer.model.state_dict().values()):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_rollout_oom_generates_in_more_parts(tmp_path, arith_data, monkeypatch):
    trainer = build_trainer(config(tmp_path, arith_data, **{"train.total_steps": 2, "rollout.n": 2}))
    real = trainer.rollout.generate
    calls = []

    def generate(prompts, **kwargs):
        calls.append(len(prompts))
        if len(prompts) > 2:
            raise oom_error()
        return real(prompts, **kwargs)

    monkeypatch.setattr(trainer.rollout, "generate", generate)
    trainer.fit()
    assert calls == [8, 4, 2, 2, 2, 2, 2, 2, 2, 2]  # 8 -> 4 -> 2 prompts per call; the split is kept
    assert trainer.rollout_parts == 4
    records = read_records(trainer.metrics.path)
    assert [r["train/oom_retries"] for r in records] == [2, 0]
    assert all(len(r) > 0 for r in records) and records[0]["rollout/response_length/mean"] > 0


@pytest.mark.parametrize("where", ["rollout", "training"])
def test_oom_at_the_floor_names_the_settings_to_change(tmp_path, arith_data, monkeypatch, where):
    trainer = build_trainer(config(tmp_path, arith_data, **{"train.total_steps": 1}))
    if where == "rollout":
        monkeypatch.setattr(trainer.rollout, "generate", lambda *a, **k: (_ for _ in ()).throw(oom_error()))
    else:
        monkeypatch.setattr(update, "_accumulate", lambda *a: (_ for _ in ()).throw(oom_error()))
    with pytest.raises(oom.OutOfMemoryError) as info:
        trainer.fit()
    message = str(info.value)
    assert ("rollout (generation)" if where == "rollout" else "a training micro-batch") in message
    for setting in ("train.micro_batch_size", "rollout.n", "rollout.max_tokens", "rollout.kv_cache_fraction", "model.gradient_checkpointing"):
        assert setting in message


# ---- a full disk ------------------------------------------------------------------------------

def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_during_checkpoint_keeps_the_previous_one(tmp_path, arith_data, monkeypatch):
    cfg = config(tmp_path, arith_data, **{"train.total_steps": 4, "trainer.save_every": 2})
    trainer = build_trainer(cfg)
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: enospc() if trainer.step == 4 else real_save(obj, f, *a, **k))
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*step_000004: No space left on device\. "
                                              r"The previous checkpoints are intact\. Free disk space"):
        trainer.fit()
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in CheckpointManager(root).list_steps()] == ["step_000002"]
    assert CheckpointManager.verify(root / "step_000002") is None
    assert (root / "latest").read_text().strip() == "step_000002"
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # the half-written one is gone


def test_full_disk_with_continue_on_save_error_keeps_training(tmp_path, arith_data, monkeypatch):
    cfg = config(tmp_path, arith_data, **{"train.total_steps": 4, "trainer.save_every": 1, "trainer.continue_on_save_error": True})
    trainer = build_trainer(cfg)
    real_save, real_fsync = torch.save, os.fsync
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: enospc() if trainer.step == 2 else real_save(obj, f, *a, **k))

    def fsync(fd):  # the metrics write of step 3 hits the full disk after writing its bytes
        if trainer.step == 3 and os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl"):
            enospc()
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    summary = trainer.fit()
    assert summary["steps"] == 4
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in CheckpointManager(root).list_steps()] == ["step_000001", "step_000003", "step_000004"]
    # The record of step 3 was cut off again and written with step 4's: each step once, in order.
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [r["step"] for r in read_records(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4] and len(lines) == 4


def test_full_disk_during_metrics_write_is_a_clear_error(tmp_path, arith_data, monkeypatch):
    trainer = build_trainer(config(tmp_path, arith_data, **{"train.total_steps": 3}))
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: enospc() if trainer.step == 2 and os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl") else real_fsync(fd))
    with pytest.raises(MetricsWriteError, match=r"could not append to .*metrics.jsonl: No space left on device\. Free disk space"):
        trainer.fit()
    assert [r["step"] for r in read_records(trainer.metrics.path)] == [1]
    assert trainer.metrics.path.read_text().count("\n") == 1  # no partial line left behind


# ---- preemption, in-process -------------------------------------------------------------------

def test_sigterm_past_the_grace_period_abandons_the_step_exactly(tmp_path, arith_data, monkeypatch):
    extra = {"train.total_steps": 4, "trainer.preemption_grace_s": 0.2, **BIT_EXACT}
    straight = build_trainer(config(tmp_path / "a", arith_data, **extra))
    straight.fit()

    trainer = build_trainer(config(tmp_path / "b", arith_data, **extra))
    real = trainer.rollout.generate

    waited = []

    def hung_generate(*args, **kwargs):
        if trainer.step == 2:  # step 3's rollout gets SIGTERM and does not finish in time
            os.kill(os.getpid(), signal.SIGTERM)
            start = time.monotonic()
            try:
                time.sleep(60)
            finally:
                waited.append(time.monotonic() - start)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer.rollout, "generate", hung_generate)
    mine = signal.signal(signal.SIGTERM, lambda *a: None)
    try:
        summary = trainer.fit()
        assert waited and waited[0] < 20  # interrupted about 0.2 s after the signal, not after 60 s
        assert signal.getsignal(signal.SIGTERM) is not mine and signal.getsignal(signal.SIGTERM).__name__ == "<lambda>"
    finally:
        signal.signal(signal.SIGTERM, mine)
    assert summary["preempted"] == "SIGTERM" and summary["steps"] == 2
    assert summary["checkpoint"].endswith("step_000002")

    resumed = build_trainer(config(tmp_path / "b", arith_data, **extra))
    resumed.fit()
    assert same(straight.model.state_dict(), resumed.model.state_dict())
    assert same(straight.optimizer.state_dict(), resumed.optimizer.state_dict())


def test_a_step_that_has_started_its_update_is_finished(tmp_path, arith_data):
    trainer = build_trainer(config(tmp_path, arith_data, **{"train.total_steps": 5, "trainer.preemption_grace_s": 0.1}))

    def slow_update(optimizer, args, kwargs):  # SIGTERM while the optimizer is stepping, past the grace
        if trainer.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)

    hook = trainer.optimizer.register_step_post_hook(slow_update)
    try:
        summary = trainer.fit()
    finally:
        hook.remove()
    assert summary["preempted"] == "SIGTERM" and summary["steps"] == 3
    assert summary["checkpoint"].endswith("step_000003")
    assert [r["step"] for r in read_records(trainer.metrics.path)] == [1, 2, 3]
