"""The synthetic arithmetic task: prompts like "12+34=" with the answer as ground truth.

Train and test problems are disjoint for any sizes and seeds: an operand pair (a, b) belongs to
the test split iff a fixed hash of the pair falls in the lowest TEST_PERCENT percent, so a test
problem can never be drawn for training (whatever the operator).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np

OPERATIONS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}
TEST_PERCENT = 10  # share of the (a, b) pair space reserved for the test split
SPLIT_IDS = {"train": 0, "test": 1}  # mixed into the seed so the splits draw different streams

Split = Literal["train", "test"]


def is_test_pair(a: int, b: int) -> bool:
    """Whether the operand pair (a, b) belongs to the test split (a fixed, seed-free hash)."""
    digest = hashlib.blake2b(f"{a},{b}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 100 < TEST_PERCENT


def make_arith_rows(
    num_rows: int,
    *,
    seed: int,
    digits: int = 2,
    ops: Sequence[str] = ("+",),
    split: Split = "train",
) -> list[dict[str, str]]:
    """`num_rows` rows `{"prompt": "12+34=", "ground_truth": "46"}`.

    a and b are drawn uniformly (with replacement) from 0 .. 10**digits - 1, keeping only pairs of
    `split`; the operator uniformly from `ops`. "-" may give negative answers ("-5").
    """
    if split not in SPLIT_IDS:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    unknown = [op for op in ops if op not in OPERATIONS]
    if unknown or not ops:
        raise ValueError(f"ops must be a non-empty subset of {list(OPERATIONS)}, got {list(ops)}.")
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}.")
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}.")
    rng = np.random.default_rng([seed, SPLIT_IDS[split]])
    want_test = split == "test"
    rows = []
    while len(rows) < num_rows:
        a, b = (int(x) for x in rng.integers(0, 10**digits, size=2))
        op = ops[int(rng.integers(len(ops)))]
        if is_test_pair(a, b) != want_test:
            continue
        rows.append({"prompt": f"{a}{op}{b}=", "ground_truth": str(OPERATIONS[op](a, b))})
    return rows


def write_arith_dataset(
    out_dir: str | os.PathLike,
    *,
    num_train: int,
    num_test: int,
    seed: int,
    digits: int = 2,
    ops: Sequence[str] = ("+",),
    fmt: Literal["jsonl", "parquet"] = "jsonl",
) -> dict[str, Path]:
    """Write `train.<fmt>` and `test.<fmt>` under `out_dir`; returns {split: path}."""
    if fmt not in ("jsonl", "parquet"):
        raise ValueError(f"fmt must be 'jsonl' or 'parquet', got {fmt!r}.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, num_rows in (("train", num_train), ("test", num_test)):
        rows = make_arith_rows(num_rows, seed=seed, digits=digits, ops=ops, split=split)
        paths[split] = _write_rows(rows, out / f"{split}.{fmt}")
    return paths


def _write_rows(rows: list[dict[str, Any]], path: Path) -> Path:
    # Write then rename, so a crash never leaves a half-written file under the final name.
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), tmp)
    else:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(tmp, path)
    return path


def arith_sft_rows(rows: Sequence[dict[str, str]], eos_token: str) -> list[dict[str, str]]:
    """SFT rows: the answer followed by the EOS token text, so the model learns to stop."""
    return [{"prompt": row["prompt"], "response": row["ground_truth"] + eos_token} for row in rows]


def make_arith_preference_rows(
    rows: Sequence[dict[str, str]], *, seed: int
) -> list[dict[str, str]]:
    """Preference rows: the correct answer is chosen, a plausible wrong one rejected."""
    rng = np.random.default_rng(seed)
    return [
        {
            "prompt": row["prompt"],
            "chosen": row["ground_truth"],
            "rejected": wrong_answer(row["ground_truth"], rng),
        }
        for row in rows
    ]


def make_arith_unpaired_rows(
    rows: Sequence[dict[str, str]], *, seed: int
) -> list[dict[str, Any]]:
    """KTO rows: a shuffled half (rounded up) with the correct answer (label True), the rest with
    a wrong one (label False)."""
    rng = np.random.default_rng(seed)
    num_wrong = len(rows) // 2
    labels = np.array([True] * (len(rows) - num_wrong) + [False] * num_wrong)
    rng.shuffle(labels)
    return [
        {
            "prompt": row["prompt"],
            "completion": row["ground_truth"] if label else wrong_answer(row["ground_truth"], rng),
            "label": bool(label),
        }
        for row, label in zip(rows, labels)
    ]


def wrong_answer(answer: str, rng: np.random.Generator) -> str:
    """A plausible wrong answer: two digits swapped, or off by 1..3; never equal to `answer`."""
    value = int(answer)
    sign, digits = ("-" if value < 0 else ""), str(abs(value))
    distinct = [(i, j) for i in range(len(digits)) for j in range(i + 1, len(digits))
                if digits[i] != digits[j] and not (i == 0 and digits[j] == "0")]
    if distinct and rng.random() < 0.5:
        i, j = distinct[int(rng.integers(len(distinct)))]
        swapped = list(digits)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        return sign + "".join(swapped)
    offset = int(rng.integers(1, 4)) * (1 if rng.random() < 0.5 else -1)
    return str(value + offset)
