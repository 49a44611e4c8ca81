"""The command line: help, clear errors without tracebacks, make-data, export."""

import subprocess
import sys

import pytest

from hybridrl.cli.main import main


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "hybridrl.cli.main", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_help_lists_commands():
    out = cli("--help")
    assert out.returncode == 0
    for word in ("train", "demo", "export", "make-data", "resume"):
        assert word in out.stdout
    assert "KEY=VALUE" in cli("train", "--help").stdout


@pytest.mark.parametrize(
    "yaml_text, overrides, message",
    [
        ("model: {path: x}\ndata: {train_path: y}\n", ["train.lr_shedule=cosine"], "did you mean train.lr_schedule"),
        ("model: {path: x}\ndata: {train_path: y}\n", ["train.batch_size=12", "rollout.n=8"], "must be divisible by rollout.n"),
        ("model: {path: ./no/such/model}\ndata: {train_path: y}\n", [], "model path ./no/such/model does not exist"),
    ],
)
def test_user_errors_are_one_message(tmp_path, yaml_text, overrides, message):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text)
    out = cli("train", str(cfg), *overrides, cwd=tmp_path)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    debug = cli("--debug", "train", str(cfg), *overrides, cwd=tmp_path)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_bad_dataset_row_names_file_row_field(tmp_path, tiny_model_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "ground_truth": "2"}\n{"prompt": 5, "ground_truth": "3"}\n')
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{path: {tiny_model_path}}}\ndata: {{train_path: {data}}}\nrollout: {{n: 2}}\ntrain: {{batch_size: 2, micro_batch_size: 2}}\n")
    out = cli("train", str(cfg), f"trainer.output_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "train.jsonl" in out.stderr and "row 1" in out.stderr and "'prompt'" in out.stderr
    assert "Traceback" not in out.stderr


def test_make_data_and_export_errors(tmp_path, capsys):
    assert main(["make-data", "arith-preference", str(tmp_path / "pref"), "--num-train", "10", "--num-test", "5"]) == 0
    assert (tmp_path / "pref" / "train.jsonl").read_text().count("\n") == 10
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err
