"""Malformed input of every kind gets one clear message, not a traceback or a hang.

Each case runs `hybridrl train` (in-process through `main()`, a few as real subprocesses) and
checks: the exit status is an error (2), the message names the problem and the fix, and no
traceback is printed unless `--debug` is given. The cases cover datasets, configs, reward
functions and checkpoints.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import TINY_MODEL
from hybridrl.cli.main import main

REWARDS = '''
import math, time

def raises(prompts, responses, **columns):
    return [1.0 / (len(r) - len(r)) for r in responses]

def wrong_count(prompts, responses, **columns):
    return [1.0]

def nan_on_third(prompts, responses, **columns):
    return [math.nan if i == 2 else 0.0 for i in range(len(responses))]

def slow(prompts, responses, **columns):
    time.sleep(60)
    return [1.0] * len(responses)

def no_responses(x):
    return [0.0]
'''


@dataclass
class Case:
    name: str
    overrides: list[str]  # `train` arguments after the base config, {d} is the case's data directory
    expect: list[str]  # substrings of the error: the problem and the fix
    config: str | None = None  # replaces the base config file's text
    setup: Callable[[Path], None] | None = None  # prepares files in the case directory


def rows(n=40):
    return [{"prompt": f"{i}+{i}=", "ground_truth": str(2 * i)} for i in range(n)]


def write_jsonl(path: Path, items) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in items))


def make_data(d: Path) -> None:
    write_jsonl(d / "good.jsonl", rows())
    write_jsonl(d / "renamed.jsonl", [{"question": r["prompt"], "ground_truth": r["ground_truth"]} for r in rows()])
    write_jsonl(d / "misspelled.jsonl", [{"promt": r["prompt"], "ground_truth": r["ground_truth"]} for r in rows()])
    write_jsonl(d / "int_prompt.jsonl", [rows(1)[0], {"prompt": 5, "ground_truth": "3"}])
    write_jsonl(d / "no_truth.jsonl", [{"prompt": r["prompt"]} for r in rows()])
    write_jsonl(d / "all_bad.jsonl", [{"prompt": ""} for _ in range(4)])
    write_jsonl(d / "tiny.jsonl", rows(3))
    write_jsonl(d / "bad_chat.jsonl", [{"prompt": [{"content": "1+1="}], "ground_truth": "2"}])
    write_jsonl(d / "long.jsonl", [{"prompt": "1+" * 100 + "1=", "ground_truth": "101"}])
    (d / "empty.jsonl").write_text("")
    (d / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9", "ground_truth": "1"}\n')
    (d / "broken.jsonl").write_text('{"prompt": "1+1=", "ground_truth": "2"}\n{"prompt": "2+2=", \n')
    (d / "object.json").write_text('{"prompt": "1+1="}')
    (d / "data.csv").write_text("prompt,ground_truth\n1+1=,2\n")
    (d / "a_directory").mkdir()
    pq.write_table(pa.Table.from_pylist(rows()), d / "good.parquet")
    (d / "truncated.parquet").write_bytes((d / "good.parquet").read_bytes()[:300])
    pq.write_table(pa.Table.from_pylist([{"prompt": [1, 2, 3], "ground_truth": "2"}] * 4), d / "list_prompt.parquet")
    (d / "rewards.py").write_text(REWARDS)
    (d / "list.yaml").write_text("- model\n- data\n")
    (d / "invalid.yaml").write_text("model: {path: x\ndata: [\n")
    (d / "evil.yaml").write_text(f"model: !!python/object/apply:os.system ['touch {d}/pwned']\n")
    (d / "no_config_model").mkdir()
    (d / "a_file").write_text("not a directory")


def reward(fn: str) -> str:
    return "reward.functions=[{function: {d}/rewards.py:" + fn + "}]"


CASES = [
    # ---- datasets
    Case("renamed_column", ["data.train_path={d}/renamed.jsonl"], ["field 'prompt'", "no row has this column", "the columns are ['ground_truth', 'question']", "Set data.prompt_key to one of the columns"]),
    Case("misspelled_column", ["data.train_path={d}/misspelled.jsonl"], ["no row has this column", "Set data.prompt_key=promt"]),
    Case("wrong_type", ["data.train_path={d}/int_prompt.jsonl", "train.batch_size=2", "train.micro_batch_size=2"], ["int_prompt.jsonl", "row 1", "field 'prompt'", "got int 5", "data.on_bad_row=drop"]),
    Case("wrong_type_parquet", ["data.train_path={d}/list_prompt.parquet"], ["list_prompt.parquet", "row 0", "field 'prompt'", "message 0 is int 1, not a dict", 'Write each message as {"role": "user"']),
    Case("empty_file", ["data.train_path={d}/empty.jsonl"], ["empty.jsonl", "holds no rows", "Write at least one example"]),
    Case("invalid_utf8", ["data.train_path={d}/latin1.jsonl"], ["latin1.jsonl", "line 1", "invalid UTF-8", "Re-encode the file as UTF-8"]),
    Case("overlong_prompt", ["data.train_path={d}/long.jsonl"], ["long.jsonl", "row 0", "data.max_prompt_length"]),
    Case("truncated_parquet", ["data.train_path={d}/truncated.parquet"], ["truncated.parquet", "not a valid parquet file", "write it again"]),
    Case("broken_json_line", ["data.train_path={d}/broken.jsonl"], ["broken.jsonl", "line 2", "not valid JSON", "one complete JSON object"]),
    Case("json_object_not_list", ["data.train_path={d}/object.json"], ["object.json", "expected a JSON list of objects", "[{...}, {...}]"]),
    Case("unsupported_extension", ["data.train_path={d}/data.csv"], ["data.csv", "unsupported file extension '.csv'", ".jsonl"]),
    Case("missing_data_file", ["data.train_path={d}/nope.jsonl"], ["nope.jsonl", "file not found", "Check the path"]),
    Case("data_is_a_directory", ["data.train_path={d}/a_directory"], ["a_directory", "is a directory", "Point to one file"]),
    Case("reward_column_missing", ["data.train_path={d}/no_truth.jsonl"], ["arith", "ground_truth", "add the column to the dataset"]),
    Case("all_rows_dropped", ["data.train_path={d}/all_bad.jsonl", "data.on_bad_row=drop"], ["all 4 rows are bad", "Fix the data"]),
    Case("dataset_smaller_than_a_step", ["data.train_path={d}/tiny.jsonl", "train.batch_size=8"], ["each step needs 4 prompts", "only 3", "lower train.batch_size or add data"]),
    Case("chat_message_without_role", ["data.train_path={d}/bad_chat.jsonl", "train.batch_size=2", "train.micro_batch_size=2"], ["bad_chat.jsonl", "row 0", "'role'"]),
    # ---- configs
    Case("unknown_key", ["train.lr_shedule=cosine"], ["unknown config key train.lr_shedule", "did you mean train.lr_schedule?"]),
    Case("unknown_section", ["trainr.save_every=1"], ["unknown config key trainr", "did you mean trainer?"]),
    Case("batch_not_divisible_by_n", ["train.batch_size=5"], ["train.batch_size (5) must be divisible by rollout.n (2)", "e.g. train.batch_size=4"]),
    Case("mini_not_divisible_by_micro", ["train.batch_size=8", "train.micro_batch_size=3"], ["train.mini_batch_size (8) must be divisible by train.micro_batch_size (3)", "e.g. train.micro_batch_size=2"]),
    Case("negative_lr", ["train.lr=-1e-4"], ["train.lr must not be negative, got -0.0001"]),
    Case("zero_batch", ["train.batch_size=0"], ["train.batch_size must be positive, got 0"]),
    Case("negative_grace", ["trainer.preemption_grace_s=-5"], ["trainer.preemption_grace_s must not be negative"]),
    Case("wrong_value_type", ["train.batch_size=lots"], ["train.batch_size must be an integer, got 'lots'"]),
    Case("bad_choice", ["rollout.backend=hff"], ["rollout.backend is 'hff'", "did you mean 'hf'?", "choose one of"]),
    Case("algorithm_typo", ["algorithm.name=grpoo"], ["algorithm.name 'grpoo' is not known", "did you mean 'grpo'?"]),
    Case("top_p_out_of_range", ["rollout.top_p=1.5"], ["rollout.top_p must be in (0, 1], got 1.5"]),
    Case("group_of_one", ["rollout.n=1"], ["rollout.n must be at least 2", "e.g. rollout.n=8"]),
    Case("override_without_equals", ["train.lr"], ["override 'train.lr' must look like section.key=value"]),
    Case("missing_model_path", ["model.path=./no/such/model"], ["model path ./no/such/model does not exist", "set model.path"]),
    Case("empty_model_path", ["model.path="], ["model.path is empty", "set it to a HF Hub id or a local model directory"]),
    Case("model_dir_without_config", ["model.path={d}/no_config_model"], ["has no config.json", "not a HuggingFace model directory"]),
    Case("missing_config_file", [], ["config file", "does not exist", "pass the path of a YAML file"], config="MISSING"),
    Case("invalid_yaml", [], ["is not valid YAML at line 2, column 5", "Fix the syntax"], config="{d}/invalid.yaml"),
    Case("yaml_not_a_mapping", [], ["must hold a mapping of sections", "got list"], config="{d}/list.yaml"),
    Case("yaml_python_tag_not_executed", [], ["is not valid YAML", "python/object/apply", "never executed"], config="{d}/evil.yaml"),
    Case("unwritable_output_dir", ["trainer.output_dir={d}/a_file/run"], ["could not create the output directory", "a_file", "writable trainer.output_dir"]),
    # ---- reward functions
    Case("reward_raises", [reward("raises")], ["reward function", "raises", "ZeroDivisionError", "sample 0 (prompt:", "Fix the function"]),
    Case("reward_wrong_count", [reward("wrong_count")], ["wrong_count", "returned 1 scores for 4 responses", "one finite float per response"]),
    Case("reward_nan", [reward("nan_on_third")], ["nan_on_third", "returned nan for sample 2 (prompt:", "one finite float per response"]),
    Case("reward_bad_signature", [reward("no_responses")], ["no_responses", "cannot receive the responses", "fn(prompts, responses, **columns)"]),
    Case("reward_attribute_typo", [reward("slo")], ["has no attribute 'slo'", "did you mean 'slow'?"]),
    Case("reward_file_missing", ["reward.functions=[{function: {d}/nope.py:score}]"], ["nope.py", "does not exist"]),
    Case("reward_spec_unknown_key", ["reward.functions=[{name: arith, wieght: 2}]"], ["unknown key 'wieght'", "did you mean 'weight'?"]),
    Case("reward_timeout_not_positive", ["reward.timeout_s=0"], ["reward.timeout_s must be positive or null"]),
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad_inputs")
    make_data(d)
    (d / "base.yaml").write_text(
        f"model: {{path: {TINY_MODEL}}}\n"
        f"data: {{train_path: {d / 'good.jsonl'}, max_prompt_length: 16}}\n"
        "rollout: {backend: hf, n: 2, max_tokens: 4}\n"
        "train: {batch_size: 4, micro_batch_size: 4, total_steps: 1, lr: 1.0e-4}\n"
        f"trainer: {{output_dir: {d / 'run'}, save_every: 0, progress: false}}\n"
    )
    return d


def argv(case: Case, d: Path, out: Path) -> list[str]:
    config = str(d / "base.yaml") if case.config is None else case.config.replace("{d}", str(d))
    if case.config == "MISSING":
        config = str(d / "missing.yaml")
    overrides = [o.replace("{d}", str(d)) for o in case.overrides]
    if not any(o.startswith("trainer.output_dir=") for o in overrides) and case.config is None:
        overrides.append(f"trainer.output_dir={out}")
    return ["train", config, *overrides]


def check_message(err: str, case: Case) -> None:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    for part in case.expect:
        assert part in lines[0], f"{case.name}: {part!r} not in {lines[0]!r}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bad_input_is_one_clear_message(case, data_dir, tmp_path, capsys):
    code = main(argv(case, data_dir, tmp_path / "run"))
    err = capsys.readouterr().err
    assert code == 2, err
    check_message(err, case)
    assert not (data_dir / "pwned").exists()


def test_there_are_at_least_30_cases():
    assert len(CASES) >= 30


# ---- checkpoints ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpointed(data_dir, tmp_path_factory) -> Path:
    """A finished 2-step run with checkpoints at steps 1 and 2."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    assert main(["train", str(data_dir / "base.yaml"), f"trainer.output_dir={out}", "train.total_steps=2", "trainer.save_every=1"]) == 0
    return out


def copy_run(checkpointed: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(checkpointed, out)
    return out


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def other_model(tmp_path: Path) -> Path:
    from hybridrl.models.tiny import build_char_tokenizer, build_tiny_qwen2

    tokenizer = build_char_tokenizer()
    path = tmp_path / "other-model"
    build_tiny_qwen2(tokenizer, hidden_size=64, num_layers=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


CHECKPOINT_CASES = {
    # name: (prepare(run_dir, tmp_path) -> extra overrides, expected substrings)
    "truncated_file_named": (
        lambda run, tmp: (truncate(run / "checkpoints/step_000002/optimizer.pt"), [f"trainer.resume={run / 'checkpoints/step_000002'}"])[1],
        ["cannot be trusted", "optimizer.pt has", "truncated", "Resume from another one"],
    ),
    "all_damaged": (
        lambda run, tmp: ([truncate(run / f"checkpoints/step_00000{i}/model/model.safetensors") for i in (1, 2)], [])[1],
        ["holds checkpoints but none is intact", "trainer.resume=off"],
    ),
    "corrupt_manifest": (
        lambda run, tmp: ((run / "checkpoints/step_000002/manifest.json").write_text("{"), [f"trainer.resume={run / 'checkpoints/step_000002'}"])[1],
        ["cannot be trusted", "manifest.json is corrupt"],
    ),
    "missing_resume_path": (
        lambda run, tmp: [f"trainer.resume={tmp / 'nowhere'}"],
        ["no such checkpoint directory", "use auto, off, or a path"],
    ),
    "wrong_model": (
        lambda run, tmp: [f"model.path={other_model(tmp)}"],
        ["do not fit the model", "size mismatch", "written for another model", "check model.path"],
    ),
    "other_algorithm": (
        lambda run, tmp: ["algorithm.name=ppo"],
        ["has no critic/", "resume a ppo run's checkpoint", "trainer.resume=off"],
    ),
    "other_data": (
        lambda run, tmp: ["data.train_path={d}/tiny.jsonl", "train.total_steps=4"],
        ["does not fit this run's data", "out of range", "Point data.train_path at that data", "trainer.resume=off"],
    ),
}


@pytest.mark.parametrize("name", list(CHECKPOINT_CASES))
def test_bad_checkpoint_is_one_clear_message(name, data_dir, checkpointed, tmp_path, capsys):
    prepare, expect = CHECKPOINT_CASES[name]
    run = copy_run(checkpointed, tmp_path)
    overrides = [o.replace("{d}", str(data_dir)) for o in prepare(run, tmp_path)]
    code = main(["train", str(data_dir / "base.yaml"), f"trainer.output_dir={run}", "train.total_steps=3", *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    check_message(err, Case(name, [], expect))


# ---- a few as real subprocesses ---------------------------------------------------------------

SUBPROCESS_CASES = ["unknown_key", "wrong_type", "truncated_parquet", "reward_nan"]


def cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "hybridrl.cli.main", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_bad_input_in_a_subprocess(name, data_dir, tmp_path):
    case = next(c for c in CASES if c.name == name)
    out = cli(*argv(case, data_dir, tmp_path / "run"), cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    check_message(out.stderr, case)
    if name == "unknown_key":  # --debug shows the traceback
        debug = cli("--debug", *argv(case, data_dir, tmp_path / "run"), cwd=tmp_path)
        assert debug.returncode != 0 and "Traceback" in debug.stderr and "ConfigError" in debug.stderr


def test_slow_reward_times_out_instead_of_hanging(data_dir, tmp_path):
    """A slow reward with reward.timeout_s is not an error: each late sample gets the timeout score,
    the step record counts them and a warning names the setting; the process does not wait for it."""
    out = cli("train", str(data_dir / "base.yaml"), f"trainer.output_dir={tmp_path / 'run'}", reward("slow").replace("{d}", str(data_dir)),
              "reward.timeout_s=0.2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "timed out in the reward (reward.timeout_s)" in out.stderr and "Traceback" not in out.stderr
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["reward/timeouts"] == 4.0
