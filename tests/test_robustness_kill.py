"""Killed at any moment, a run resumes with nothing lost and nothing wrong; SIGTERM checkpoints and exits 0.

Every run is `hybridrl train` in a subprocess. `HYBRIDRL_KILL_AT` (hybridrl/failpoints.py) makes
the process signal itself at a chosen moment of a chosen phase: a training step (rollout, reward,
advantages, update), an optimizer update, a checkpoint write, or a metrics write (half a line
written first). After each kill the same command runs again and resumes; in the end the weights
and optimizer state must equal those of a run that was never interrupted, bit for bit, and
metrics.jsonl must hold every step exactly once.
"""

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_MODEL
from hybridrl.checkpoint import CheckpointManager

STEPS = 12
VOLATILE = ("timing/", "perf/", "memory/")


def write_config(tmp_path, arith_data, steps=STEPS, **trainer):
    """A tiny GRPO run (with a reference model) that checkpoints every step."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = tmp_path / "run.yaml"
    trainer_yaml = ", ".join(f"{k}: {v}" for k, v in {"output_dir": tmp_path / "run", "save_every": 1, "keep_last": 2, "progress": "false", **trainer}.items())
    cfg.write_text(
        f"model: {{path: {TINY_MODEL}}}\n"
        f"data: {{train_path: {arith_data['train']}, max_prompt_length: 16}}\n"
        "rollout: {backend: hf, n: 4, max_tokens: 6}\n"
        # deterministic: conftest.BIT_EXACT's setting, written as YAML
        f"train: {{batch_size: 8, micro_batch_size: 4, total_steps: {steps}, lr: 1.0e-4, num_threads: 1, deterministic: true}}\n"
        "algorithm: {kl_coef: 0.001}\n"
        f"trainer: {{{trainer_yaml}}}\n"
    )
    return cfg


def train(cfg, kill_at=None, *overrides, timeout=180):
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDRL_KILL_AT"}
    if kill_at:
        env["HYBRIDRL_KILL_AT"] = kill_at
    return subprocess.run([sys.executable, "-m", "hybridrl.cli.main", "train", str(cfg), *overrides],
                          capture_output=True, text=True, env=env, cwd=cfg.parent, timeout=timeout)


def final_state(run_dir, steps=STEPS):
    ckpt = run_dir / "checkpoints" / f"step_{steps:06d}"
    assert CheckpointManager.verify(ckpt) is None
    weights = load_file(str(ckpt / "model" / "model.safetensors"))
    optimizer = torch.load(ckpt / "optimizer.pt", weights_only=True)
    return weights, optimizer


def assert_same_tensors(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"differs at {where}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tensors(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"differs at {where}: {a!r} != {b!r}"


def metric_records(run_dir):
    """Every line must be a complete record: no partial line survives a resume."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def stable(record):
    return {k: v for k, v in record.items() if not k.startswith(VOLATILE)}


def straight_run(tmp, arith_data, steps=STEPS):
    """The run that is never interrupted."""
    out = train(write_config(tmp, arith_data, steps))
    assert out.returncode == 0, out.stderr
    return final_state(tmp / "run", steps), metric_records(tmp / "run")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, arith_data):
    return straight_run(tmp_path_factory.mktemp("straight"), arith_data)


def kill_schedule(rng: random.Random, num_kills: int) -> list[str]:
    """Kill points spread over the phases, with random delays inside each phase."""
    kinds = [
        lambda: f"step:{rng.choice([1, 1, 2])}:{rng.uniform(0, 0.05):.4f}",  # rollout, reward, advantages, update
        lambda: f"update:{rng.choice([1, 1, 2])}:{rng.uniform(0, 0.02):.4f}",
        lambda: f"checkpoint:{rng.choice([1, 1, 2])}:{rng.uniform(0, 0.1):.4f}",
        lambda: f"metrics:{rng.choice([1, 1, 2])}",  # half a line written, then killed
    ]
    return [kinds[i % len(kinds)]() for i in range(num_kills)]


def kill_and_resume(tmp_path, arith_data, straight, num_kills, seed, steps=STEPS):
    (weights, optimizer), records = straight
    cfg = write_config(tmp_path, arith_data, steps)
    schedule = kill_schedule(random.Random(seed), num_kills)
    outcomes = []
    for spec in schedule:
        out = train(cfg, spec)
        # Killed (-9), or finished before the kill was due (0); never an error while resuming.
        assert out.returncode in (-9, 0), f"after kills {outcomes}, {spec}: rc {out.returncode}\n{out.stderr[-3000:]}"
        assert "Traceback" not in out.stderr, out.stderr
        outcomes.append((spec, out.returncode))
    out = train(cfg)
    assert out.returncode == 0, out.stderr
    assert sum(rc == -9 for _, rc in outcomes) >= num_kills * 3 // 4, f"too few kills landed: {outcomes}"

    run_dir = tmp_path / "run"
    got_weights, got_optimizer = final_state(run_dir, steps)
    assert_same_tensors(weights, got_weights, "weights")
    assert_same_tensors(optimizer, got_optimizer, "optimizer")
    got_records = metric_records(run_dir)
    assert [r["step"] for r in got_records] == list(range(1, steps + 1)), outcomes
    assert [stable(r) for r in got_records] == [stable(r) for r in records]
    assert not list((run_dir / "checkpoints").glob(".tmp-*")) and not list((run_dir / "checkpoints").glob(".trash-*"))


def test_kill_9_at_20_random_moments_then_resume_is_exact(tmp_path, arith_data, straight):
    kill_and_resume(tmp_path, arith_data, straight, num_kills=20, seed=7)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("HYBRIDRL_SLOW_TESTS"), reason="~5 min; set HYBRIDRL_SLOW_TESTS=1 to run")
def test_kill_9_at_60_random_moments_then_resume_is_exact(tmp_path, arith_data):
    straight = straight_run(tmp_path / "straight", arith_data, steps=40)
    kill_and_resume(tmp_path / "killed", arith_data, straight, num_kills=60, seed=11, steps=40)


@pytest.mark.parametrize("kill_at, grace, stopped_at", [
    ("step:3:0:TERM", 20, 3),  # the step finishes, then the checkpoint
    ("step:3:0:TERM", 0, 2),  # no grace: the step is abandoned (its batch given back) before its update
])
def test_sigterm_checkpoints_exits_0_and_resumes_exactly(tmp_path, arith_data, straight, kill_at, grace, stopped_at):
    (weights, optimizer), records = straight
    cfg = write_config(tmp_path, arith_data, save_every=0, preemption_grace_s=grace)  # only the preemption saves
    out = train(cfg, kill_at)
    assert out.returncode == 0, out.stderr
    assert "SIGTERM received" in out.stderr and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"stopped by SIGTERM at step {stopped_at}") and f"to resume, run: hybridrl train {cfg}" in last, last
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in CheckpointManager(root).list_steps()] == [f"step_{stopped_at:06d}"]
    assert CheckpointManager.verify(root / f"step_{stopped_at:06d}") is None
    assert [r["step"] for r in metric_records(tmp_path / "run")] == list(range(1, stopped_at + 1))

    out = train(cfg, None, "trainer.save_every=1")
    assert out.returncode == 0, out.stderr
    assert f"resumed from {root / f'step_{stopped_at:06d}'} at step {stopped_at}" in out.stderr
    got_weights, got_optimizer = final_state(tmp_path / "run")
    assert_same_tensors(weights, got_weights, "weights")
    assert_same_tensors(optimizer, got_optimizer, "optimizer")
    assert [stable(r) for r in metric_records(tmp_path / "run")] == [stable(r) for r in records]


def test_second_sigterm_exits_at_once_and_leaves_nothing_corrupt(tmp_path, arith_data, straight):
    (weights, _), _ = straight
    cfg = write_config(tmp_path, arith_data)
    out = train(cfg, "step:3:0:TERM,checkpoint:3:0:TERM")  # the second one arrives as step 3's checkpoint starts
    assert out.returncode == 143, out.stderr
    assert "SIGTERM again: exiting now" in out.stderr
    root = tmp_path / "run" / "checkpoints"
    assert CheckpointManager(root).latest_intact() is not None
    out = train(cfg)
    assert out.returncode == 0, out.stderr
    assert_same_tensors(weights, final_state(tmp_path / "run")[0], "weights")
