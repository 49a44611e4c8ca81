"""Safe defaults: no remote code unless asked, checkpoints are data (weights_only / safetensors),
and nothing in a dataset or a config is ever executed."""

import hashlib
import json
import os

import pytest
import torch
import transformers

from conftest import TINY_MODEL, small_config
from hybridrl import RolloutEngine
from hybridrl.checkpoint import CheckpointError
from hybridrl.cli.commands import build_trainer
from hybridrl.config import Config, ConfigError, load_config
from hybridrl.data import load_prompt_dataset

FAST = {"data.eval_path": "null", "train.batch_size": 8, "train.micro_batch_size": 8, "train.total_steps": 1, "trainer.save_every": 1}


def test_trust_remote_code_is_off_unless_set(monkeypatch):
    assert Config().model.trust_remote_code is False
    assert load_config(None, [f"model.path={TINY_MODEL}", "data.train_path=x.jsonl"]).model.trust_remote_code is False
    seen = []
    for cls in (transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        real = cls.from_pretrained.__func__

        def recording(klass, *args, _real=real, **kwargs):
            seen.append(kwargs.get("trust_remote_code"))
            return _real(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(recording))
    RolloutEngine.from_hf(str(TINY_MODEL), backend="hf")
    assert seen == [False, False]


@pytest.fixture()
def checkpoint(tmp_path, arith_data):
    trainer = build_trainer(small_config(tmp_path, arith_data, **FAST))
    trainer.fit()
    return tmp_path / "run" / "checkpoints" / "step_000001"


def test_checkpoints_load_as_data_only(tmp_path, arith_data, checkpoint, monkeypatch):
    model_files = {p.name for p in (checkpoint / "model").iterdir()}
    assert "model.safetensors" in model_files and not {f for f in model_files if f.endswith((".bin", ".pt", ".pth"))}
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(k.get("weights_only")) or real_load(*a, **k))
    resumed = build_trainer(small_config(tmp_path, arith_data, **{**FAST, "train.total_steps": 2}))
    resumed.fit()
    assert resumed.step == 2 and loads and all(w is True for w in loads)


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path, arith_data, checkpoint):
    marker = tmp_path / "pwned"
    evil = checkpoint / "optimizer.pt"
    torch.save({"state": RunsCode(marker)}, evil)
    manifest = json.loads((checkpoint / "manifest.json").read_text())  # as a careful attacker would
    manifest["files"]["optimizer.pt"] = {"size": evil.stat().st_size, "sha256": hashlib.sha256(evil.read_bytes()).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    trainer = build_trainer(small_config(tmp_path, arith_data, **{**FAST, "train.total_steps": 2}))
    with pytest.raises(CheckpointError, match=r"optimizer.pt holds more than tensors .* not loaded \(weights_only=True\)"):
        trainer.fit()
    assert not marker.exists()


def test_dataset_text_is_data_not_code(tmp_path):
    marker = tmp_path / "pwned"
    payloads = [f"__import__('os').system('touch {marker}')", "{{ 7*7 }}{% for x in range(3) %}x{% endfor %}", "!!python/object/apply:os.system"]
    rows = [{"prompt": text} for text in payloads] + [{"prompt": [{"role": "user", "content": text}]} for text in payloads]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    engine = RolloutEngine.from_hf(str(TINY_MODEL), backend="hf")
    dataset = load_prompt_dataset(path, engine.tokenizer)
    assert [ex.prompt for ex in dataset] == payloads * 2  # chat content is inserted verbatim, not rendered as a template
    assert not marker.exists()


def test_config_tags_that_would_run_code_are_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.yaml"
    path.write_text(f"model: {{path: !!python/object/apply:os.system ['touch {marker}']}}\n")
    with pytest.raises(ConfigError, match="never executed"):
        load_config(path)
    assert not marker.exists()
