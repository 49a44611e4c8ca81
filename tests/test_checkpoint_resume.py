"""Exact resume, atomic checkpoints, export."""

import json
import logging
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import BIT_EXACT, small_config
from hybridrl.checkpoint import CheckpointError, CheckpointManager, export_checkpoint
from hybridrl.cli.commands import build_trainer
from hybridrl.metrics import read_records

VOLATILE = ("timing/", "perf/", "memory/")


def stable(record):
    return {k: v for k, v in record.items() if not k.startswith(VOLATILE)}


def run(cfg):
    trainer = build_trainer(cfg)
    trainer.fit()
    return trainer


@pytest.mark.parametrize("algorithm,backend", [("grpo", "hf"), ("ppo", "hf"), ("grpo", "native")])
def test_resume_is_bit_exact(tmp_path, arith_data, algorithm, backend):
    # deterministic: on a GPU the packed attention's backward adds with atomics otherwise (set_determinism);
    # the native engine draws its sampling noise from the seeds the trainer passes per request, not from a generator
    extra = {"algorithm.name": algorithm, "rollout.backend": backend, "train.total_steps": 4, "trainer.eval_every": 0,
             "train.deterministic": True}
    if algorithm == "ppo":
        extra |= {"train.mini_batch_size": 16, "train.ppo_epochs": 2}  # off-policy passes, shuffled mini-batches
    straight = run(small_config(tmp_path / "a", arith_data, **extra))

    half = small_config(tmp_path / "b", arith_data, **{**extra, "train.total_steps": 2})
    run(half)
    resumed = run(small_config(tmp_path / "b", arith_data, **extra))  # trainer.resume=auto picks step 2
    assert resumed.step == 4 and resumed.rollout.backend_name == backend

    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), f"weights differ after resume: {name}"
    if algorithm == "ppo":
        for a, b in zip(straight.critic.state_dict().values(), resumed.critic.state_dict().values()):
            assert torch.equal(a, b)
    rec_a = read_records(straight.metrics.path)
    rec_b = read_records(resumed.metrics.path)
    assert [r["step"] for r in rec_b] == [1, 2, 3, 4]
    assert [stable(r) for r in rec_a] == [stable(r) for r in rec_b]


def test_resume_with_other_config_warns(tmp_path, arith_data, caplog):
    run(small_config(tmp_path, arith_data, **{"train.total_steps": 2}))
    with caplog.at_level(logging.WARNING, logger="hybridrl.trainer"):
        run(small_config(tmp_path, arith_data, **{"train.total_steps": 3, "train.lr": 5e-5}))
    assert "different config" in caplog.text and "train.lr: 0.0001 -> 5e-05" in caplog.text


def test_damaged_latest_falls_back(tmp_path, arith_data, caplog):
    cfg = small_config(tmp_path, arith_data, **{"train.total_steps": 4, "trainer.save_every": 2, "trainer.keep_last": 3})
    run(cfg)
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in CheckpointManager(root).list_steps()] == ["step_000002", "step_000004"]
    weights = root / "step_000004" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated, as by a crash or full disk
    with caplog.at_level(logging.WARNING):
        assert CheckpointManager(root).latest_intact().name == "step_000002"
    assert "is damaged" in caplog.text and "truncated" in caplog.text
    with pytest.raises(CheckpointError, match="cannot be trusted"):
        CheckpointManager(root).resolve(str(root / "step_000004"))
    # A directory left by a crash mid-save (no manifest) is never trusted either.
    shutil.copytree(root / "step_000002", root / "step_000006")
    (root / "step_000006" / "manifest.json").unlink()
    assert CheckpointManager(root).verify(root / "step_000006") is not None


def test_keep_last_and_latest_marker(tmp_path, arith_data):
    run(small_config(tmp_path, arith_data, **{"train.total_steps": 4, "trainer.save_every": 1, "trainer.keep_last": 2}))
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in CheckpointManager(root).list_steps()] == ["step_000003", "step_000004"]
    assert (root / "latest").read_text().strip() == "step_000004"
    manifest = json.loads((root / "step_000004" / "manifest.json").read_text())
    assert {"model/model.safetensors", "optimizer.pt", "scheduler.pt", "state.json", "config.yaml"} <= set(manifest["files"])


def superseded(run_dir):
    dirs = sorted(run_dir.glob("superseded-*"))
    assert len(dirs) == 1, dirs
    return dirs[0]


def test_rewinding_sets_later_checkpoints_and_records_aside(tmp_path, arith_data, caplog):
    cfg = small_config(tmp_path, arith_data, **{"train.total_steps": 4, "trainer.save_every": 1, "trainer.keep_last": 4,
                                                "trainer.eval_every": 0})
    first = run(cfg)
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    first_records = read_records(first.metrics.path)

    with caplog.at_level(logging.WARNING, logger="hybridrl.trainer"):
        build_trainer(cfg).resume_from_checkpoint(root / "step_000002")
    aside = superseded(run_dir)
    assert [p.name for p in CheckpointManager(root).list_steps()] == ["step_000001", "step_000002"]
    assert (root / "latest").read_text().strip() == "step_000002"
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["step_000003", "step_000004"]
    assert CheckpointManager.verify(aside / "checkpoints" / "step_000004") is None  # moved whole, still intact
    assert read_records(aside / "metrics.jsonl") == first_records[2:]
    assert [r["step"] for r in read_records(run_dir / "metrics.jsonl")] == [1, 2]
    assert "set aside in" in caplog.text and "step_000003, step_000004, metrics.jsonl (2 records past step 2)" in caplog.text
    assert "later metric records dropped" not in caplog.text  # set aside, not dropped

    # A crash before the rewound run's next save resumes from where it was rewound to, not from the set-aside step 4.
    assert CheckpointManager(root).resolve("auto").name == "step_000002"
    again = run(cfg)
    assert again.step == 4
    assert [r["step"] for r in read_records(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    assert len(list(run_dir.glob("superseded-*"))) == 1  # resuming the step-2 checkpoint moved nothing more


def test_damaged_newest_is_set_aside_on_resume(tmp_path, arith_data):
    cfg = small_config(tmp_path, arith_data, **{"train.total_steps": 4, "trainer.save_every": 2, "trainer.keep_last": 2,
                                                "trainer.eval_every": 0})
    run(cfg)
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    weights = root / "step_000004" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    resumed = run(small_config(tmp_path, arith_data, **{"train.total_steps": 6, "trainer.save_every": 3,
                                                        "trainer.keep_last": 2, "trainer.eval_every": 0}))
    assert resumed.step == 6
    # The damaged step 4 no longer counts against keep_last (it would have left [4 (damaged), 6]): both kept are intact.
    assert [p.name for p in CheckpointManager(root).list_steps()] == ["step_000003", "step_000006"]
    assert all(CheckpointManager.verify(p) is None for p in CheckpointManager(root).list_steps())
    aside = superseded(run_dir)
    assert CheckpointManager.verify(aside / "checkpoints" / "step_000004") is not None  # kept for a look, as it was
    assert [r["step"] for r in read_records(aside / "metrics.jsonl")] == [3, 4]


def test_resume_off_keeps_the_earlier_run(tmp_path, arith_data):
    run(small_config(tmp_path, arith_data, **{"train.total_steps": 2, "trainer.eval_every": 0}))
    run_dir = tmp_path / "run"
    restarted = run(small_config(tmp_path, arith_data, **{"train.total_steps": 1, "trainer.eval_every": 0,
                                                          "trainer.resume": "off"}))
    assert restarted.step == 1
    aside = superseded(run_dir)
    assert [p.name for p in (aside / "checkpoints").iterdir()] == ["step_000002"]
    assert [r["step"] for r in read_records(aside / "metrics.jsonl")] == [1, 2]
    assert [r["step"] for r in read_records(run_dir / "metrics.jsonl")] == [1]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000001"


def test_set_aside_moves_only_what_the_run_leaves(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        (root / f"step_00000{step}").mkdir(parents=True)
    (root / "latest").write_text("step_000003\n")
    manager = CheckpointManager(root)
    assert manager.set_aside(3, tmp_path / "aside", keep=root / "step_000003") == []
    assert not (tmp_path / "aside").exists()  # nothing to move, nothing made
    assert manager.set_aside(1, tmp_path / "aside", keep=root / "step_000001") == ["step_000002", "step_000003"]
    assert (root / "latest").read_text().strip() == "step_000001"
    # Resuming a checkpoint from elsewhere at step 1: this run's own step 1 is another run's, and goes too.
    assert manager.set_aside(1, tmp_path / "aside2", keep=tmp_path / "aside" / "step_000002") == ["step_000001"]
    assert not (root / "latest").exists() and manager.list_steps() == []


def test_export_loads_in_transformers_with_same_greedy_output(tmp_path, arith_data):
    trainer = run(small_config(tmp_path, arith_data, **{"train.total_steps": 2}))
    out = export_checkpoint(tmp_path / "run" / "checkpoints", tmp_path / "exported")
    model = AutoModelForCausalLM.from_pretrained(out)
    prompts = ["12+34=", "8+9=", "40+2="]
    ours = trainer.rollout.generate(prompts, n=1, max_tokens=6, temperature=0.0)
    tok = trainer.tokenizer
    for prompt, sample in zip(prompts, ours):
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        theirs = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        assert theirs[0, ids.shape[1] :].tolist()[: len(sample.response_ids)] == sample.response_ids
    with pytest.raises(CheckpointError, match="not empty"):
        export_checkpoint(tmp_path / "run" / "checkpoints", tmp_path / "exported")


def _fused_trainer(cfg):
    """The native engine with q|k|v and gate|up fused in place (its GPU default), on CPU."""
    from hybridrl import RolloutEngine, TrainerEngine
    from hybridrl.trainer.engine import reward_from_config

    actor = RolloutEngine.from_hf(cfg.model.path, backend="native", device="cpu", fuse_weights=True)
    return TrainerEngine(actor=actor, reward_fn=reward_from_config(cfg), config=cfg)


def test_training_on_weights_fused_in_place(tmp_path, arith_data):
    """Trained through the fused parameters: they stay shared with the engine, rollouts see every
    update (log-probs match the trainer's), resume is bit-exact and the export loads in transformers."""
    from hybridrl.rollout.native.fused import span

    extra = {"rollout.backend": "native", "train.total_steps": 4, "trainer.eval_every": 0, "train.lr": 1e-3, **BIT_EXACT}
    straight = _fused_trainer(small_config(tmp_path / "a", arith_data, **extra))
    straight.fit()
    for layer in straight.model.model.layers:
        a = layer.self_attn
        assert span([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]) is not None
        assert span([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]) is not None
    records = read_records(straight.metrics.path)
    assert all(r["rollout/logprob_diff/mean"] < 1e-4 for r in records), [r["rollout/logprob_diff/mean"] for r in records]
    straight.rollout.generate(["12+34="], n=1, max_tokens=2, temperature=0.0)
    fused, layer0 = straight.rollout.backend.decoder.fused, straight.model.model.layers[0]
    assert fused.copied == 0 and fused.qkv_w[0].data_ptr() == layer0.self_attn.q_proj.weight.data_ptr()

    _fused_trainer(small_config(tmp_path / "b", arith_data, **{**extra, "train.total_steps": 2})).fit()
    resumed = _fused_trainer(small_config(tmp_path / "b", arith_data, **extra))
    resumed.fit()
    assert resumed.step == 4
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), f"weights differ after resume: {name}"

    out = export_checkpoint(tmp_path / "a" / "run" / "checkpoints", tmp_path / "exported")
    exported = AutoModelForCausalLM.from_pretrained(out)
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), exported.state_dict().items()):
        assert torch.equal(a, b), name
