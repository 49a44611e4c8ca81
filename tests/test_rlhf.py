"""The RL loop with rewards scored while generation runs, per-sample timeouts, and PPO against a
learned reward model (with exact resume)."""

import json
import logging
import time

import pytest
import torch

from conftest import BIT_EXACT, TINY_MODEL, save_random_head_reward_model, small_config
from hybridrl.cli.commands import build_trainer
from hybridrl.metrics import read_records

STABLE = lambda records: [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/", "memory/", "reward/overlap"))}
                          for r in records]

SLOW_REWARD = '''
import time

def slow_on_multiples_of_three(prompts, responses, ground_truth, **columns):
    """Correctness, but it hangs on answers divisible by 3."""
    if int(ground_truth[0]) % 3 == 0:
        time.sleep(5)
    return [1.0 if responses[0].strip() == ground_truth[0] else 0.0]
'''


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """The tiny model with a random (seeded) reward head: a stand-in for a trained reward model."""
    return save_random_head_reward_model(tmp_path_factory.mktemp("rm"), seed=1)


def test_timed_out_samples_are_reported_not_waited_for(tmp_path, arith_data, caplog):
    (tmp_path / "slow.py").write_text(SLOW_REWARD)
    cfg = small_config(tmp_path, arith_data, **{
        "reward.functions": f"[{{function: {tmp_path / 'slow.py'}:slow_on_multiples_of_three}}]",
        "reward.timeout_s": 0.3, "reward.num_workers": 4, "train.total_steps": 1, "train.batch_size": 16,
        "trainer.save_every": 0, "data.eval_path": "null",
    })
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="hybridrl.trainer"):
        build_trainer(cfg).fit()
    assert time.perf_counter() - start < 30  # abandoned, never joined (each hang is 5 s)
    record = read_records(tmp_path / "run" / "metrics.jsonl")[0]
    assert record["reward/timeouts"] > 0 and record["reward/slow_on_multiples_of_three/timeouts"] == record["reward/timeouts"]
    assert "timed out in the reward" in caplog.text
    for key in ("timing/reward", "timing/reward_exposed", "reward/overlap_ratio"):
        assert isinstance(record[key], float), key


def test_ppo_with_learned_reward_and_streamed_function_resumes_exactly(tmp_path, arith_data, reward_model_dir):
    """Function reward scored on worker threads as responses finish + a normalised learned reward
    model scored per batch (offloaded, the CPU as the device) + PPO's critic: 2 + 2 steps == 4."""
    extra = {
        "algorithm.name": "ppo", "model.reward_model_path": str(reward_model_dir), "reward.model_offload": True,
        "reward.model_normalize": True, "reward.model_clip": 3.0, "reward.model_weight": 0.5, "reward.num_workers": 2,
        "train.batch_size": 16, "train.micro_batch_size": 16, "train.total_steps": 4, "data.eval_path": "null",
        **BIT_EXACT,
    }
    straight = build_trainer(small_config(tmp_path / "a", arith_data, **extra))
    straight.fit()
    build_trainer(small_config(tmp_path / "b", arith_data, **{**extra, "train.total_steps": 2})).fit()
    resumed = build_trainer(small_config(tmp_path / "b", arith_data, **extra))
    resumed.fit()
    assert resumed.step == 4
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    records = read_records(straight.metrics.path)
    assert STABLE(records) == STABLE(read_records(resumed.metrics.path))
    assert {"reward/arith/mean", "reward/reward_model/mean", "timing/reward", "timing/reward_exposed",
            "reward/overlap_ratio", "critic/vf_loss"} <= set(records[-1])
    state = json.loads((tmp_path / "b" / "run" / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["reward"]["reward_model"]["normalizer"]["count"] == 2 * 16


def test_rlhf_example_smoke(tmp_path):
    """examples/rlhf/run.py --smoke: SFT -> reward model -> PPO, two steps each."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rlhf_run", TINY_MODEL.parents[2] / "examples" / "rlhf" / "run.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    threads = torch.get_num_threads()
    try:
        figures = example.main(["--smoke", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)  # the example's configs ask for one thread
    assert set(figures) == {"sft_loss", "rm_pairs", "rm_accuracy", "learned_reward", "true_accuracy", "minutes"}
    assert (tmp_path / "reward-model" / "config.json").is_file()
