"""The bad-row discipline shared by every dataset loader: raise on the first bad row, or drop and
count bad rows and log one summary line."""

from __future__ import annotations

import difflib
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Literal, TypeVar

from hybridrl.data.errors import DataError, describe

logger = logging.getLogger("hybridrl.data")

OnBadRow = Literal["error", "drop"]
T = TypeVar("T")

DROP_FIX = "Fix the row, or set data.on_bad_row=drop to skip bad rows."


@dataclass
class ParsedRows(Generic[T]):
    """The examples parsed from the good rows, and what was dropped."""

    examples: list[T]
    num_dropped: int = 0
    drop_reasons: dict[str, int] = field(default_factory=dict)  # reason -> number of rows


def parse_rows(
    rows: list[dict[str, Any]],
    parse_row: Callable[[dict[str, Any], int], T],
    *,
    source: str,
    on_bad_row: OnBadRow,
) -> ParsedRows[T]:
    """Apply `parse_row(row, index)` to every row; bad rows raise or are dropped per `on_bad_row`.

    `parse_row` raises `DataError` for a bad row. Only errors with a `drop_reason` are droppable;
    others (configuration problems) always raise. If every row is dropped, raises `DataError`.
    """
    if on_bad_row not in ("error", "drop"):
        raise ValueError(f"data.on_bad_row must be 'error' or 'drop', got {on_bad_row!r}")
    examples: list[T] = []
    reasons: Counter[str] = Counter()
    first_error: DataError | None = None
    for index, row in enumerate(rows):
        try:
            examples.append(parse_row(row, index))
        except DataError as err:
            if on_bad_row == "error" or err.drop_reason is None:
                raise
            reasons[err.drop_reason] += 1
            first_error = first_error or err
    num_dropped = sum(reasons.values())
    if num_dropped:
        summary = ", ".join(f"{reason}: {count}" for reason, count in reasons.most_common())
        if not examples:
            raise DataError(
                f"all {len(rows)} rows are bad and were dropped ({summary}); the first: "
                f"{str(first_error).removesuffix(' ' + first_error.fix)}",  # its fix suggests dropping
                source=source,
                fix="Fix the data, or check the column names and length limits in the config.",
            )
        logger.warning(
            "%s: dropped %d of %d rows (%s); first dropped: %s",
            source, num_dropped, len(rows), summary, first_error,
        )
    return ParsedRows(examples, num_dropped, dict(reasons))


def require_column_somewhere(
    rows: list[dict[str, Any]], key: str, *, source: str, fix_option: str | None
) -> None:
    """Raise if `key` is missing (or null) in every row: a wrong column name, not bad rows.

    The message lists the columns that exist and suggests the closest one; `fix_option` is the
    config option that names the column (e.g. "data.prompt_key"), if there is one.
    """
    if any(row.get(key) is not None for row in rows):
        return
    columns = sorted({column for row in rows for column in row})
    close = difflib.get_close_matches(key, columns, n=1, cutoff=0.4)
    if fix_option and close:
        fix = f"Set {fix_option}={close[0]}, or rename the column."
    elif fix_option:
        fix = f"Set {fix_option} to one of the columns, or rename the column."
    elif close:
        fix = f"Add the column, or rename column '{close[0]}' to '{key}'."
    else:
        fix = f"Add a '{key}' column to the data."
    raise DataError(
        f"no row has this column (checked all {len(rows)} rows); the columns are {columns}",
        source=source, row=0, field=key, fix=fix,
    )


def get_column(row: dict[str, Any], key: str, *, source: str, index: int) -> Any:
    """`row[key]`, or a droppable `DataError` if it is missing or null."""
    value = row.get(key)
    if value is None:
        problem = "the column is null" if key in row else "the column is missing"
        raise DataError(
            f"{problem} (the row has columns {sorted(row)})",
            source=source, row=index, field=key, drop_reason=f"missing {key}", fix=DROP_FIX,
        )
    return value


def check_text(value: Any, *, source: str, index: int, field: str, what: str) -> str:
    """A non-empty string, or a droppable `DataError`."""
    if not isinstance(value, str):
        raise DataError(
            f"expected a string, got {describe(value)}",
            source=source, row=index, field=field, drop_reason=f"{what} not a string", fix=DROP_FIX,
        )
    if not value.strip():
        raise DataError(
            f"the {what} is empty or whitespace", source=source, row=index, field=field,
            drop_reason=f"empty {what}", fix=DROP_FIX,
        )
    return value


def check_length(
    num_tokens: int, max_length: int | None, *, source: str, index: int, field: str,
    what: str, option: str,
) -> None:
    """A droppable `DataError` if `num_tokens > max_length` (`option` names the config limit)."""
    if max_length is not None and num_tokens > max_length:
        raise DataError(
            f"the {what} is {num_tokens} tokens, longer than {option}={max_length}",
            source=source, row=index, field=field, drop_reason=f"{what} too long",
            fix=f"Raise {option}, shorten the row, or set data.on_bad_row=drop to skip "
            "too-long rows.",
        )
