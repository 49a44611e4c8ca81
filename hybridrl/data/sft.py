"""Supervised fine-tuning data: token ids with a loss mask that is 1 only on what the model should
learn to write (the response, or the assistant turns of a conversation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridrl.data.chat import check_messages, encode_continuation, encode_prompt_text, render_chat
from hybridrl.data.completions import encode_completion
from hybridrl.data.errors import DataError, describe
from hybridrl.data.prompts import encode_prompt
from hybridrl.data.rows import (
    DROP_FIX,
    OnBadRow,
    check_length,
    parse_rows,
    require_column_somewhere,
)
from hybridrl.data.sources import read_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class SFTExample:
    """One training sequence."""

    input_ids: list[int]
    loss_mask: list[int]  # same length as input_ids; 1 where the token is trained on
    index: int  # row index in the source (0-based)


def load_sft_dataset(
    source: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompt_key: str = "prompt",
    response_key: str = "response",
    messages_key: str = "messages",
    max_length: int | None = None,
    on_bad_row: OnBadRow = "error",
) -> list[SFTExample]:
    """Read and tokenise SFT rows, each either prompt + response columns or a messages column.

    prompt + response: the loss covers the response tokens and the EOS appended to them.
    messages: the conversation is rendered turn by turn with the chat template; the loss covers
    each assistant turn as the template writes it after the generation prompt (its content and
    end-of-turn marker), and nothing else. Sequences longer than `max_length` tokens are bad rows
    (never silently truncated).
    """
    rows, source_name = read_rows(source)
    _require_sft_columns(rows, prompt_key, response_key, messages_key, source=source_name)

    def parse_row(row: dict[str, Any], index: int) -> SFTExample:
        if row.get(messages_key) is not None:
            field = messages_key
            input_ids, loss_mask = _encode_conversation(
                tokenizer, row[messages_key], source=source_name, index=index, field=field
            )
        else:
            field = response_key
            prompt_text, prompt_ids = encode_prompt(
                tokenizer, row, prompt_key, source=source_name, index=index
            )
            response_ids = encode_completion(
                tokenizer, row, response_key, prompt_key=prompt_key, prompt_text=prompt_text,
                source=source_name, index=index,
            )
            input_ids = prompt_ids + response_ids
            loss_mask = [0] * len(prompt_ids) + [1] * len(response_ids)
        check_length(
            len(input_ids), max_length, source=source_name, index=index, field=field,
            what="sequence", option="data.max_length",
        )
        return SFTExample(input_ids, loss_mask, index)

    return parse_rows(rows, parse_row, source=source_name, on_bad_row=on_bad_row).examples


def _require_sft_columns(
    rows: list[dict[str, Any]], prompt_key: str, response_key: str, messages_key: str,
    *, source: str,
) -> None:
    if any(row.get(messages_key) is not None for row in rows):
        return
    if any(row.get(prompt_key) is not None for row in rows):
        require_column_somewhere(rows, response_key, source=source, fix_option="data.response_key")
        return
    columns = sorted({column for row in rows for column in row})
    raise DataError(
        f"no row has a '{messages_key}' column, nor '{prompt_key}' + '{response_key}' columns; "
        f"the columns are {columns}",
        source=source, row=0, field=messages_key,
        fix="Set data.messages_key, or data.prompt_key and data.response_key, to the "
        "dataset's column names.",
    )


def _encode_conversation(
    tokenizer: PreTrainedTokenizerBase, value: Any, *, source: str, index: int, field: str
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a conversation, the mask 1 exactly on the assistant turns."""
    if not isinstance(value, list):
        raise DataError(
            f"expected a list of chat messages, got {describe(value)}",
            source=source, row=index, field=field, drop_reason="messages wrong type",
            fix=DROP_FIX,
        )
    messages = check_messages(value, source=source, row=index, field=field)
    if messages[0]["role"] == "assistant":
        raise DataError(
            "the conversation starts with an assistant turn, which conditions on nothing",
            source=source, row=index, field=field, drop_reason="starts with assistant",
            fix="Start with a system or user turn, or set data.on_bad_row=drop.",
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(
            "the conversation has no assistant turn, so there is nothing to train on",
            source=source, row=index, field=field, drop_reason="no assistant turn", fix=DROP_FIX,
        )

    def render(num_messages: int, add_generation_prompt: bool) -> str:
        return render_chat(
            tokenizer, messages[:num_messages], add_generation_prompt=add_generation_prompt,
            source=source, row=index, field=field,
        )

    # Render the conversation one turn longer each time; each rendering must extend the last,
    # and what an assistant turn adds after the generation prompt is what the model must write.
    segments: list[tuple[str, int]] = []  # (text, loss flag)
    rendered = ""
    for i, message in enumerate(messages):
        is_assistant = message["role"] == "assistant"
        if is_assistant:
            head = render(i, add_generation_prompt=True)
            _check_extends(rendered, head, source=source, index=index, field=field)
            segments.append((head[len(rendered):], 0))
            rendered = head
        longer = render(i + 1, add_generation_prompt=False)
        _check_extends(rendered, longer, source=source, index=index, field=field)
        segments.append((longer[len(rendered):], int(is_assistant)))
        rendered = longer

    input_ids: list[int] = []
    loss_mask: list[int] = []
    for text, flag in segments:
        if not text:
            continue
        # The first piece of text gets the BOS rule of a prompt; later pieces continue it.
        encode = encode_continuation if input_ids else encode_prompt_text
        ids = encode(tokenizer, text)
        input_ids += ids
        loss_mask += [flag] * len(ids)
    return input_ids, loss_mask


def _check_extends(prefix: str, text: str, *, source: str, index: int, field: str) -> None:
    if not text.startswith(prefix):
        # A property of the template (e.g. one that drops earlier reasoning), not of the row.
        raise DataError(
            "the chat template renders a conversation differently from how it renders the same "
            "conversation one turn shorter, so assistant turns cannot be located for the loss "
            "mask",
            source=source, row=index, field=field,
            fix="Use a chat template whose renderings extend turn by turn (set "
            "model.chat_template), or give the data as prompt + response columns.",
        )
