"""Token ids of a completion (a response, a chosen or rejected answer) that follows a prompt."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridrl.data.chat import append_eos, check_messages, encode_continuation, render_chat
from hybridrl.data.errors import DataError, describe
from hybridrl.data.rows import DROP_FIX, check_text, get_column

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def encode_completion(
    tokenizer: PreTrainedTokenizerBase,
    row: dict[str, Any],
    key: str,
    *,
    prompt_key: str,
    prompt_text: str,
    source: str,
    index: int,
) -> list[int]:
    """The completion `row[key]` as token ids, given the prompt's rendered text.

    A string completion is the raw text after the prompt, with EOS appended (unless the text ends
    with it). A list of assistant messages is rendered together with the (chat) prompt and the
    completion is what the template writes after the rendered prompt; it ends however the
    template ends a turn, so no EOS is added.
    """
    value = get_column(row, key, source=source, index=index)
    if isinstance(value, str):
        text = check_text(value, source=source, index=index, field=key, what=key)
        return append_eos(tokenizer, encode_continuation(tokenizer, text))
    if not isinstance(value, list):
        raise DataError(
            f"expected a string or a list of assistant messages, got {describe(value)}",
            source=source, row=index, field=key, drop_reason=f"{key} wrong type", fix=DROP_FIX,
        )
    messages = check_messages(value, source=source, row=index, field=key)
    prompt = row[prompt_key]
    if not isinstance(prompt, list):
        raise DataError(
            f"the {key} is a list of chat messages but '{prompt_key}' is a plain string",
            source=source, row=index, field=key, drop_reason="chat completion, string prompt",
            fix="Give both as chat messages or both as strings, or set data.on_bad_row=drop.",
        )
    roles = sorted({m["role"] for m in messages} - {"assistant"})
    if roles:
        raise DataError(
            f"completion messages must all be assistant turns, found roles {roles}",
            source=source, row=index, field=key, drop_reason=f"{key} not assistant turns",
            fix="Move the other turns into the prompt, or set data.on_bad_row=drop.",
        )
    full = render_chat(
        tokenizer, prompt + messages, add_generation_prompt=False,
        source=source, row=index, field=key,
    )
    if not full.startswith(prompt_text):
        # The template renders a conversation differently from its prefix: no drop_reason,
        # since every row would fail the same way.
        raise DataError(
            "the chat template's rendering of prompt + completion does not start with its "
            f"rendering of the prompt alone (prompt renders as {prompt_text[-80:]!r}, "
            f"the whole as {full[:len(prompt_text) + 20][-100:]!r})",
            source=source, row=index, field=key,
            fix="Use a chat template whose rendering of a conversation extends that of its "
            "prompt (set model.chat_template), or give completions as plain strings.",
        )
    return encode_continuation(tokenizer, full[len(prompt_text):])
