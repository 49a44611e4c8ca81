"""End to end on the tiny model: the reward must rise (GRPO and PPO with a critic)."""

import json

import pytest
import torch

from conftest import small_config
from hybridrl.cli.commands import build_trainer
from hybridrl.data import make_arith_rows
from hybridrl.metrics import read_records


@pytest.fixture(scope="module")
def few_prompts(tmp_path_factory):
    """16 training prompts, reused every step: learning shows within a few dozen steps."""
    d = tmp_path_factory.mktemp("few")
    rows = make_arith_rows(16, seed=5, split="train")
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"train": d / "train.jsonl", "test": d / "train.jsonl"}


@pytest.mark.parametrize(
    "algorithm, extra",
    [
        ("grpo", {}),
        ("ppo", {"train.mini_batch_size": 64, "train.micro_batch_size": 64, "train.critic_lr": 1e-3, "train.total_steps": 60}),
        ("rloo", {}),
    ],
)
def test_reward_rises(tmp_path, few_prompts, algorithm, extra):
    # fp32 on any device: the +0.2 line below is set for it. In bf16 (a GPU's `model.dtype: auto`; measured on CPU)
    # RLOO's 40 steps rose 0.170 -> 0.358 in one run, under the line.
    # lr 3e-4 holds the line for every seed tried (train.seed 0-19 for GRPO and RLOO, 0-9 for PPO, on CPU; least
    # rise +0.275 GRPO, +0.277 RLOO, +0.405 PPO). At 5e-4 some seeds collapsed (GRPO seed 9 +0.106, RLOO seed 4
    # +0.181, PPO seed 4 +0.180), and a GPU's sampling stream is another seed: on an H100 at 3e-4, train.seed 0-7
    # (RLOO) and 0-6 (GRPO) rose at least +0.309 and +0.409. RLOO's case did fail there, at 3e-4 as at 5e-4 (whose
    # traceback was lost), but on the phase-sum line below (95.3%): host work between one phase's end event and
    # the next one's start, counted in no phase while the GPU sat idle. That was two reads of the allocator's
    # counters (82 us each there) and the scores' copy; now one read (11 us) and the copy is in reward_exposed.
    cfg = small_config(tmp_path, few_prompts, **{
        "model.dtype": "float32", "algorithm.name": algorithm, "rollout.n": 8, "train.batch_size": 128, "train.micro_batch_size": 128,
        "train.lr": 3e-4, "train.total_steps": 40, "trainer.save_every": 0, "algorithm.kl_coef": 0.0, **extra,
    })
    trainer = build_trainer(cfg)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.fit()
    records = read_records(trainer.metrics.path)
    # train.device is "auto": on a GPU the record gives the allocator's peak instead of the host's.
    memory_key = "memory/peak_allocated_gib" if trainer.device.type == "cuda" else "memory/peak_rss_gib"
    assert [r["step"] for r in records] == list(range(1, cfg.train.total_steps + 1))
    first = sum(r["reward/mean"] for r in records[:5]) / 5
    last = sum(r["reward/mean"] for r in records[-5:]) / 5
    assert last > first + 0.2, f"{algorithm}: reward {first:.3f} -> {last:.3f}"
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    for key in ("timing/rollout", "timing/reward", "timing/ref", "timing/train", "timing/step", "actor/pg_loss",
                "actor/pg_clipfrac", "actor/entropy", "actor/grad_norm", "actor/lr", "reward/std",
                "rollout/response_length/mean", "perf/tokens_per_s", memory_key,
                "timing/rollout/generate", "timing/rollout/postprocess", "timing/rollout/sleep"):
        assert isinstance(records[-1][key], (int, float)), key
    # Generation's share of the rollout phase, and no evaluation time carried into a step's record.
    assert all(r["timing/rollout/generate"] <= r["timing/rollout"] for r in records)
    # The phases account for the steps: no untimed work between them. Summed over the run, since one
    # ~0.1 s CPU step can lose a few ms between phases to a GIL hand-over or a GC pass.
    phases = ("rollout", "batch", "ref", "reward_exposed", "old_logprobs", "values", "advantage", "train", "metrics", "gc_freeze")
    timed = [sum(r[f"timing/{p}"] for p in phases) for r in records]
    assert all(t <= r["timing/step"] for t, r in zip(timed, records))
    total = sum(r["timing/step"] for r in records)
    assert sum(timed) >= 0.97 * total, (sum(timed), total)
    if algorithm == "ppo":
        assert "critic/vf_loss" in records[-1] and "critic/grad_norm" in records[-1]
