"""DPO, KTO and SFT through the same TrainerEngine: learning, exact resume."""

import json

import pytest
import torch

from conftest import BIT_EXACT, TINY_MODEL
from hybridrl.cli.commands import build_trainer
from hybridrl.config import load_config
from hybridrl.data import arith_sft_rows, make_arith_preference_rows, make_arith_rows, make_arith_unpaired_rows
from hybridrl.metrics import read_records
from hybridrl.models.tiny import EOS_TOKEN


@pytest.fixture(scope="module")
def offline_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("offline")
    rows = make_arith_rows(256, seed=1, split="train")
    sets = {
        "dpo": make_arith_preference_rows(rows, seed=1),
        "kto": make_arith_unpaired_rows(rows, seed=1),
        # The SFT'd tiny model already fits this distribution: one fixed batch makes the fall certain.
        "sft": arith_sft_rows(rows[:32], EOS_TOKEN),
    }
    paths = {}
    for name, data in sets.items():
        paths[name] = d / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in data))
    return paths


def config(tmp_path, offline_data, algorithm, **overrides):
    base = {
        "model.path": str(TINY_MODEL), "algorithm.name": algorithm, "data.train_path": str(offline_data[algorithm]),
        "data.max_length": 32, "train.batch_size": 32, "train.micro_batch_size": 16, "train.total_steps": 12,
        "train.lr": 5e-4, "trainer.output_dir": str(tmp_path / "run"), "trainer.save_every": 0, "trainer.progress": False,
    }
    base.update(overrides)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


@pytest.mark.parametrize("algorithm, key", [("dpo", "dpo/loss"), ("kto", "kto/loss"), ("sft", "sft/loss")])
def test_loss_falls(tmp_path, offline_data, algorithm, key):
    trainer = build_trainer(config(tmp_path, offline_data, algorithm))
    trainer.fit()
    records = read_records(trainer.metrics.path)
    assert len(records) == 12
    first = sum(r[key] for r in records[:3]) / 3
    last = sum(r[key] for r in records[-3:]) / 3
    assert last < first, f"{algorithm}: {key} {first:.4f} -> {last:.4f}"
    if algorithm == "dpo":
        assert records[0]["dpo/reward_accuracy"] <= records[-1]["dpo/reward_accuracy"]
        assert abs(records[0]["dpo/loss"] - 0.6931) < 0.01  # policy == reference at the first step: log 2


def test_dpo_resume_is_bit_exact(tmp_path, offline_data):
    straight = build_trainer(config(tmp_path / "a", offline_data, "dpo", **{**BIT_EXACT, "train.total_steps": 4}))
    straight.fit()
    build_trainer(config(tmp_path / "b", offline_data, "dpo", **{**BIT_EXACT, "train.total_steps": 2, "trainer.save_every": 2})).fit()
    resumed = build_trainer(config(tmp_path / "b", offline_data, "dpo", **{**BIT_EXACT, "train.total_steps": 4, "trainer.save_every": 2}))
    resumed.fit()
    assert resumed.step == 4
    for a, b in zip(straight.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)
    drop = ("timing/", "perf/", "memory/")
    clean = lambda rs: [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rs]
    assert clean(read_records(straight.metrics.path)) == clean(read_records(resumed.metrics.path))


def test_rpo_term_keeps_chosen_likelihood_up(tmp_path, offline_data):
    plain = build_trainer(config(tmp_path / "a", offline_data, "dpo", **{"train.total_steps": 6}))
    plain.fit()
    rpo = build_trainer(config(tmp_path / "b", offline_data, "dpo", **{"train.total_steps": 6, "algorithm.rpo_alpha": 1.0}))
    rpo.fit()
    last_plain = read_records(plain.metrics.path)[-1]
    last_rpo = read_records(rpo.metrics.path)[-1]
    assert "dpo/nll_chosen" in last_rpo and "dpo/nll_chosen" not in last_plain
    # The NLL term pulls the chosen answers' implicit reward above plain DPO's.
    assert last_rpo["dpo/rewards/chosen"] > last_plain["dpo/rewards/chosen"]
