"""The one error type for bad input data: it always says where, what, and how to fix it."""

from __future__ import annotations

IN_MEMORY = "<in-memory dataset>"  # the source name of data passed as Python objects


class DataError(ValueError):
    """Bad input data, with a message naming the source, row, field, the problem and the fix.

    Example message:
        data/train.jsonl, row 17 (0-based), field 'prompt': expected a string or a list of chat
        messages, got int 5. Fix the row, or set data.on_bad_row=drop to skip bad rows.

    `drop_reason` is set on errors about a single row (a short label such as "empty prompt"):
    only those may be skipped under `on_bad_row="drop"`. Errors about the whole source or the
    configuration (a missing file, no chat template) have `drop_reason=None` and always raise.
    """

    def __init__(
        self,
        problem: str,
        *,
        source: str,
        fix: str,
        row: int | None = None,
        field: str | None = None,
        line: int | None = None,
        drop_reason: str | None = None,
    ) -> None:
        self.problem = problem
        self.source = source
        self.fix = fix
        self.row = row
        self.field = field
        self.line = line
        self.drop_reason = drop_reason
        super().__init__(self._format())

    def _format(self) -> str:
        where = [self.source]
        if self.line is not None:
            where.append(f"line {self.line}")
        if self.row is not None:
            where.append(f"row {self.row} (0-based)")
        if self.field is not None:
            where.append(f"field '{self.field}'")
        return f"{', '.join(where)}: {self.problem.rstrip('.')}. {self.fix}"

    def __reduce__(self):
        # Keyword-only arguments do not survive the default exception pickling, and errors cross
        # process boundaries when data is loaded in worker processes.
        kwargs = dict(
            source=self.source, fix=self.fix, row=self.row, field=self.field,
            line=self.line, drop_reason=self.drop_reason,
        )
        return (_rebuild, (self.problem, kwargs))


def _rebuild(problem: str, kwargs: dict) -> DataError:
    return DataError(problem, **kwargs)


def describe(value: object, limit: int = 60) -> str:
    """A short 'type value' description of a bad value, for error messages: `int 5`."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(value).__name__} {text}"
