"""The synthetic arithmetic task: correct answers, disjoint splits, file output, derived rows."""

import re

import pytest

from hybridrl.data import (
    arith_sft_rows,
    load_prompt_dataset,
    make_arith_preference_rows,
    make_arith_rows,
    make_arith_unpaired_rows,
    write_arith_dataset,
)
from hybridrl.models.tiny import build_char_tokenizer

PROMPT = re.compile(r"^(\d+)([+\-*])(\d+)=$")


def solve(prompt):
    """The answer by int arithmetic on the parsed prompt (no eval)."""
    a, op, b = PROMPT.match(prompt).groups()
    a, b = int(a), int(b)
    return {"+": a + b, "-": a - b, "*": a * b}[op], (a, b)


@pytest.mark.parametrize("digits", [1, 2, 3])
def test_answers_are_correct_and_operands_in_range(digits):
    rows = make_arith_rows(300, seed=0, digits=digits, ops=("+", "-", "*"))
    assert len(rows) == 300
    ops_seen = set()
    for row in rows:
        answer, (a, b) = solve(row["prompt"])
        assert row["ground_truth"] == str(answer)
        assert 0 <= a < 10**digits and 0 <= b < 10**digits
        ops_seen.add(PROMPT.match(row["prompt"]).group(2))
    assert ops_seen == {"+", "-", "*"}
    assert any(row["ground_truth"].startswith("-") for row in rows)  # "-" can go negative


@pytest.mark.parametrize("digits", [1, 2])
def test_train_and_test_are_disjoint_for_any_size_and_seed(digits):
    train_pairs = set()
    test_pairs = set()
    for seed in range(3):
        for n in (1, 50, 400):
            train_pairs |= {solve(r["prompt"])[1] for r in
                            make_arith_rows(n, seed=seed, digits=digits, split="train")}
            test_pairs |= {solve(r["prompt"])[1] for r in
                           make_arith_rows(n, seed=seed, digits=digits, split="test")}
    assert train_pairs and test_pairs and not train_pairs & test_pairs


def test_deterministic_in_seed():
    assert make_arith_rows(20, seed=5) == make_arith_rows(20, seed=5)
    assert make_arith_rows(20, seed=5) != make_arith_rows(20, seed=6)
    assert make_arith_rows(10, seed=5) == make_arith_rows(20, seed=5)[:10]


def test_bad_arguments():
    with pytest.raises(ValueError, match="ops"):
        make_arith_rows(3, seed=0, ops=("/",))
    with pytest.raises(ValueError, match="split"):
        make_arith_rows(3, seed=0, split="val")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_write_and_load_back(tmp_path, fmt):
    paths = write_arith_dataset(tmp_path / "arith", num_train=40, num_test=10, seed=0, fmt=fmt)
    assert {s: p.name for s, p in paths.items()} == {"train": f"train.{fmt}", "test": f"test.{fmt}"}
    assert not list((tmp_path / "arith").glob("*.tmp"))
    tok = build_char_tokenizer()
    train = load_prompt_dataset(paths["train"], tok, required_columns=["ground_truth"])
    assert len(train) == 40
    assert [ex.columns["ground_truth"] for ex in train] == [
        r["ground_truth"] for r in make_arith_rows(40, seed=0, split="train")]


def test_sft_preference_and_unpaired_rows():
    rows = make_arith_rows(101, seed=0, ops=("+", "-", "*"))
    sft = arith_sft_rows(rows, "<eos>")
    assert sft[0] == {"prompt": rows[0]["prompt"], "response": rows[0]["ground_truth"] + "<eos>"}

    prefs = make_arith_preference_rows(rows, seed=1)
    assert prefs == make_arith_preference_rows(rows, seed=1)
    for row, pref in zip(rows, prefs):
        assert pref["prompt"] == row["prompt"] and pref["chosen"] == row["ground_truth"]
        wrong = int(pref["rejected"])
        assert wrong != int(row["ground_truth"])
        swapped = sorted(pref["rejected"]) == sorted(row["ground_truth"])
        assert swapped or 1 <= abs(wrong - int(row["ground_truth"])) <= 3
        assert pref["rejected"] == str(wrong)  # a well-formed number (no leading zero)

    unpaired = make_arith_unpaired_rows(rows, seed=2)
    labels = [u["label"] for u in unpaired]
    assert labels.count(True) == 51 and labels.count(False) == 50
    for row, u in zip(rows, unpaired):
        assert (u["completion"] == row["ground_truth"]) == u["label"]
