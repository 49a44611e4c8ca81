"""Read raw rows (one dict per example) from a file, an HF `datasets.Dataset`, or a list of dicts.

Every failure is a `DataError` that names the file and, where there is one, the line or row.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

from hybridrl.data.errors import IN_MEMORY, DataError, describe

SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".parquet")

Rows = list[dict[str, Any]]


def read_rows(source: str | os.PathLike | Sequence[dict] | Any) -> tuple[Rows, str]:
    """Return `(rows, source_name)`; `source_name` is the path, or "<in-memory dataset>"."""
    if isinstance(source, (str, os.PathLike)):
        return _read_file(Path(source)), str(source)
    if _is_hf_dataset(source):
        return _read_hf_dataset(source), IN_MEMORY
    if isinstance(source, (list, tuple)):
        return _check_in_memory_rows(source), IN_MEMORY
    raise DataError(
        f"cannot read rows from a {type(source).__name__}",
        source=IN_MEMORY,
        fix="Pass a path to a .jsonl, .json or .parquet file, a datasets.Dataset, "
        "or a list of dicts.",
    )


def _read_file(path: Path) -> Rows:
    name = str(path)
    if not path.exists():
        raise DataError(
            f"file not found (looked for {path.resolve()}; the working directory is {Path.cwd()})",
            source=name,
            fix="Check the path, or give an absolute one.",
        )
    if path.is_dir():
        raise DataError(
            "is a directory, not a data file", source=name,
            fix=f"Point to one file inside it ({', '.join(SUPPORTED_EXTENSIONS)}).",
        )
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_EXTENSIONS:
        raise DataError(
            f"unsupported file extension {suffix or '(none)'!r}",
            source=name,
            fix=f"Use one of: {', '.join(SUPPORTED_EXTENSIONS)} (a .jsonl file holds one JSON "
            "object per line; a .json file holds a list of objects).",
        )
    if suffix == ".parquet":
        rows = _read_parquet(path)
    else:
        text = _read_utf8(path)
        rows = _parse_jsonl(text, name) if suffix == ".jsonl" else _parse_json(text, name)
    if not rows:
        raise DataError(
            "the file holds no rows", source=name,
            fix="Write at least one example to it, or point to the right file.",
        )
    return rows


def _read_utf8(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")  # "-sig": tolerate a byte-order mark
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise DataError(
            f"invalid UTF-8 at byte offset {err.start} ({err.reason})",
            source=str(path),
            line=line,
            fix="Re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`).",
        ) from None


def _parse_jsonl(text: str, name: str) -> Rows:
    rows: Rows = []
    # Split on "\n" only: str.splitlines would also split on U+2028, which is legal in JSON strings.
    for line_number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue  # blank lines (e.g. a trailing newline) are not rows
        row = len(rows)
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(
                f"not valid JSON ({err.msg} at column {err.colno})",
                source=name, line=line_number, row=row,
                fix="Fix the line; each line of a .jsonl file must be one complete JSON object.",
            ) from None
        if not isinstance(value, dict):
            raise DataError(
                f"expected a JSON object, got {describe(value)}",
                source=name, line=line_number, row=row,
                fix='Make each line one object, e.g. {"prompt": "...", "ground_truth": "..."}.',
            )
        rows.append(value)
    return rows


def _parse_json(text: str, name: str) -> Rows:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        fix = "Fix the file; a .json file must hold one JSON list of objects."
        if err.msg == "Extra data":
            fix = "The file looks like JSON Lines (one object per line): rename it to .jsonl."
        raise DataError(
            f"not valid JSON ({err.msg} at column {err.colno})",
            source=name, line=err.lineno, fix=fix,
        ) from None
    if not isinstance(value, list):
        keys = f" with keys {sorted(value)[:10]}" if isinstance(value, dict) else ""
        raise DataError(
            f"expected a JSON list of objects, got a {type(value).__name__}{keys}",
            source=name,
            fix="Write the file as [{...}, {...}], or save one object per line as .jsonl.",
        )
    for row, item in enumerate(value):
        if not isinstance(item, dict):
            raise DataError(
                f"expected a JSON object, got {describe(item)}",
                source=name, row=row,
                fix="Make every element of the list an object with the dataset's columns.",
            )
    return value


def _read_parquet(path: Path) -> Rows:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(
            f"not a valid parquet file ({err})",
            source=str(path),
            fix="The file may be truncated or corrupt: write it again (e.g. with "
            "pyarrow.parquet.write_table or Dataset.to_parquet).",
        ) from None
    return table.to_pylist()


def _is_hf_dataset(source: Any) -> bool:
    # Import `datasets` only when the object plausibly comes from it: it is an optional extra.
    if not type(source).__module__.startswith("datasets"):
        return False
    import datasets

    if isinstance(source, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        raise DataError(
            f"got a {type(source).__name__} with splits {list(source.keys())}, not one split",
            source=IN_MEMORY,
            fix="Pass one split, e.g. dataset['train'].",
        )
    if isinstance(source, datasets.IterableDataset):
        raise DataError(
            "got a streaming IterableDataset; the loader needs random access",
            source=IN_MEMORY,
            fix="Load it without streaming=True, or materialise it with Dataset.from_list.",
        )
    return isinstance(source, datasets.Dataset)


def _read_hf_dataset(dataset: Any) -> Rows:
    rows = dataset.to_list()
    if not rows:
        raise DataError(
            "the dataset holds no rows", source=IN_MEMORY,
            fix="Check the split and any filtering applied to it.",
        )
    return rows


def _check_in_memory_rows(items: Sequence[Any]) -> Rows:
    if not items:
        raise DataError("the list holds no rows", source=IN_MEMORY, fix="Pass at least one row.")
    for row, item in enumerate(items):
        if not isinstance(item, dict):
            raise DataError(
                f"expected a dict, got {describe(item)}",
                source=IN_MEMORY, row=row,
                fix="Pass a list of dicts, one per example, keyed by column name.",
            )
    return list(items)
