"""Prompt datasets for RL: each row is a prompt (a string or chat messages) plus any other columns
the reward needs (e.g. `ground_truth`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

from hybridrl.data.chat import (
    check_messages,
    encode_prompt_text,
    render_chat,
)
from hybridrl.data.errors import DataError, describe
from hybridrl.data.rows import (
    DROP_FIX,
    OnBadRow,
    check_length,
    check_text,
    get_column,
    parse_rows,
    require_column_somewhere,
)
from hybridrl.data.sources import read_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class PromptExample:
    """One prompt, rendered and tokenised."""

    prompt: str  # the text the model sees (chat prompts rendered with the template)
    prompt_ids: list[int]  # token ids of `prompt`
    columns: dict[str, Any]  # every other column of the row, e.g. ground_truth
    index: int  # row index in the source (0-based)


class PromptDataset(Sequence[PromptExample]):
    """The prompts that passed validation, with counts of the rows that were dropped."""

    def __init__(
        self,
        examples: list[PromptExample],
        source_name: str,
        num_dropped: int = 0,
        drop_reasons: dict[str, int] | None = None,
    ) -> None:
        self.examples = examples
        self.source_name = source_name  # file path, or "<in-memory dataset>"
        self.num_dropped = num_dropped  # rows skipped under on_bad_row="drop"
        self.drop_reasons = drop_reasons or {}  # reason -> number of rows dropped for it

    def __len__(self) -> int:
        return len(self.examples)

    @overload
    def __getitem__(self, i: int) -> PromptExample: ...
    @overload
    def __getitem__(self, i: slice) -> list[PromptExample]: ...
    def __getitem__(self, i):
        return self.examples[i]

    def __repr__(self) -> str:
        return (
            f"PromptDataset({self.source_name!r}, {len(self)} prompts, "
            f"{self.num_dropped} dropped)"
        )


def load_prompt_dataset(
    source: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompt_key: str = "prompt",
    max_prompt_length: int | None = None,
    on_bad_row: OnBadRow = "error",
    required_columns: Sequence[str] = (),
    add_generation_prompt: bool = True,
) -> PromptDataset:
    """Read, validate and tokenise a prompt dataset (see `read_rows` for the accepted sources).

    Bad rows (missing/empty/mistyped prompt, malformed chat messages, a prompt longer than
    `max_prompt_length` tokens, a missing required column) raise `DataError` under
    `on_bad_row="error"`, or are skipped and counted under `"drop"`.
    """
    rows, source_name = read_rows(source)
    require_column_somewhere(rows, prompt_key, source=source_name, fix_option="data.prompt_key")
    for column in required_columns:
        require_column_somewhere(rows, column, source=source_name, fix_option=None)

    def parse_row(row: dict[str, Any], index: int) -> PromptExample:
        text, ids = encode_prompt(
            tokenizer, row, prompt_key, source=source_name, index=index,
            add_generation_prompt=add_generation_prompt,
        )
        check_length(
            len(ids), max_prompt_length, source=source_name, index=index, field=prompt_key,
            what="prompt", option="data.max_prompt_length",
        )
        for column in required_columns:
            get_column(row, column, source=source_name, index=index)
        columns = {key: value for key, value in row.items() if key != prompt_key}
        return PromptExample(prompt=text, prompt_ids=ids, columns=columns, index=index)

    parsed = parse_rows(rows, parse_row, source=source_name, on_bad_row=on_bad_row)
    return PromptDataset(parsed.examples, source_name, parsed.num_dropped, parsed.drop_reasons)


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    row: dict[str, Any],
    prompt_key: str,
    *,
    source: str,
    index: int,
    add_generation_prompt: bool = True,
) -> tuple[str, list[int]]:
    """The prompt of a row as (text, token ids): a string as is, chat messages rendered."""
    value = get_column(row, prompt_key, source=source, index=index)
    if isinstance(value, str):
        text = check_text(value, source=source, index=index, field=prompt_key, what="prompt")
    elif isinstance(value, list):
        messages = check_messages(value, source=source, row=index, field=prompt_key)
        text = render_chat(
            tokenizer, messages, add_generation_prompt=add_generation_prompt,
            source=source, row=index, field=prompt_key,
        )
    else:
        raise DataError(
            f"expected a string or a list of chat messages, got {describe(value)}",
            source=source, row=index, field=prompt_key, drop_reason="prompt wrong type",
            fix=DROP_FIX,
        )
    return text, encode_prompt_text(tokenizer, text)
