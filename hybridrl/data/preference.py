"""Preference data for DPO and reward models (chosen vs rejected) and unpaired data for KTO."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridrl.data.completions import encode_completion
from hybridrl.data.errors import DataError, describe
from hybridrl.data.prompts import encode_prompt
from hybridrl.data.rows import (
    DROP_FIX,
    OnBadRow,
    check_length,
    get_column,
    parse_rows,
    require_column_somewhere,
)
from hybridrl.data.sources import read_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class PreferenceExample:
    """A prompt with a preferred and a dispreferred completion."""

    prompt_ids: list[int]
    chosen_ids: list[int]  # completion only (not the prompt); ends with EOS for string data
    rejected_ids: list[int]
    index: int  # row index in the source (0-based)


@dataclass
class UnpairedExample:
    """A prompt with one completion labelled desirable (True) or undesirable (False)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    label: bool
    index: int  # row index in the source (0-based)


def load_preference_dataset(
    source: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    max_length: int | None = None,
    on_bad_row: OnBadRow = "error",
) -> list[PreferenceExample]:
    """Read and tokenise (prompt, chosen, rejected) rows; `max_length` bounds prompt + completion.

    Prompts are strings or chat messages; completions are strings or assistant-message lists
    (see `encode_completion`). A row whose chosen and rejected are identical is a bad row.
    """
    rows, source_name = read_rows(source)
    keys = {prompt_key: "data.prompt_key", chosen_key: "data.chosen_key",
            rejected_key: "data.rejected_key"}
    for key, option in keys.items():
        require_column_somewhere(rows, key, source=source_name, fix_option=option)

    def parse_row(row: dict[str, Any], index: int) -> PreferenceExample:
        prompt_text, prompt_ids = encode_prompt(
            tokenizer, row, prompt_key, source=source_name, index=index
        )
        completions = {}
        for key in (chosen_key, rejected_key):
            completions[key] = encode_completion(
                tokenizer, row, key, prompt_key=prompt_key, prompt_text=prompt_text,
                source=source_name, index=index,
            )
            check_length(
                len(prompt_ids) + len(completions[key]), max_length, source=source_name,
                index=index, field=key, what=f"prompt + {key}", option="data.max_length",
            )
        if completions[chosen_key] == completions[rejected_key]:
            raise DataError(
                f"'{chosen_key}' and '{rejected_key}' are identical, so there is no preference",
                source=source_name, row=index, field=rejected_key,
                drop_reason="chosen == rejected", fix=DROP_FIX,
            )
        return PreferenceExample(
            prompt_ids, completions[chosen_key], completions[rejected_key], index
        )

    return parse_rows(rows, parse_row, source=source_name, on_bad_row=on_bad_row).examples


def load_unpaired_dataset(
    source: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompt_key: str = "prompt",
    completion_key: str = "completion",
    label_key: str = "label",
    max_length: int | None = None,
    on_bad_row: OnBadRow = "error",
) -> list[UnpairedExample]:
    """Read and tokenise (prompt, completion, label) rows for KTO.

    The label must be a bool, or the int 0 or 1; anything else (including "true" or 1.0) is a bad
    row, since a silently misread label flips the training signal.
    """
    rows, source_name = read_rows(source)
    keys = {prompt_key: "data.prompt_key", completion_key: "data.completion_key",
            label_key: "data.label_key"}
    for key, option in keys.items():
        require_column_somewhere(rows, key, source=source_name, fix_option=option)

    def parse_row(row: dict[str, Any], index: int) -> UnpairedExample:
        prompt_text, prompt_ids = encode_prompt(
            tokenizer, row, prompt_key, source=source_name, index=index
        )
        completion_ids = encode_completion(
            tokenizer, row, completion_key, prompt_key=prompt_key, prompt_text=prompt_text,
            source=source_name, index=index,
        )
        check_length(
            len(prompt_ids) + len(completion_ids), max_length, source=source_name, index=index,
            field=completion_key, what="prompt + completion", option="data.max_length",
        )
        label = _check_label(row, label_key, source=source_name, index=index)
        return UnpairedExample(prompt_ids, completion_ids, label, index)

    return parse_rows(rows, parse_row, source=source_name, on_bad_row=on_bad_row).examples


def _check_label(row: dict[str, Any], key: str, *, source: str, index: int) -> bool:
    value = get_column(row, key, source=source, index=index)
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise DataError(
        f"expected a bool (or the int 0 or 1), got {describe(value)}",
        source=source, row=index, field=key, drop_reason="bad label", fix=DROP_FIX,
    )
