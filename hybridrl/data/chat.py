"""Turning prompt and completion fields into text and token ids, with chat templates.

Tokenisation rule (one rule for every loader): text is tokenised with `add_special_tokens=False`,
and a BOS token is prepended only when the tokenizer has one, is configured to add it
(`tokenizer.add_bos_token`), and the text does not already start with it. Chat templates usually
write the BOS themselves, so rendered chat text gets no second one; plain-string prompts get the
same BOS the model saw in pre-training. Completions never get a BOS.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridrl.data.errors import DataError, describe

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Messages = list[dict[str, Any]]

NO_TEMPLATE_FIX = (
    "Set model.chat_template to a jinja chat template (or use a tokenizer that has one), "
    "or give the prompts as plain strings."
)


def encode_prompt_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a prompt (or of a whole sequence's first segment): BOS per the module rule."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    wants_bos = bos_id is not None and getattr(tokenizer, "add_bos_token", False)
    if wants_bos and not text.startswith(bos):
        ids.insert(0, bos_id)
    return ids


def encode_continuation(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of text that follows other text (a completion, a later chat segment): no BOS."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def append_eos(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[int]:
    """`ids` ending in EOS: appended unless the text already ended with it."""
    eos_id = tokenizer.eos_token_id
    assert eos_id is not None, "tokenizer has no eos_token; models.from_hf sets one"
    return ids if ids and ids[-1] == eos_id else [*ids, eos_id]


def check_messages(value: Any, *, source: str, row: int, field: str) -> Messages:
    """Validate a list of chat messages `{"role": str, "content": str}`; return it."""
    def bad(problem: str) -> DataError:
        return DataError(
            problem, source=source, row=row, field=field, drop_reason="malformed chat messages",
            fix='Write each message as {"role": "user", "content": "..."}, or set '
            "data.on_bad_row=drop to skip bad rows.",
        )

    if not value:
        raise bad("the list of chat messages is empty")
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise bad(f"message {i} is {describe(message)}, not a dict")
        for key in ("role", "content"):
            if key not in message or message[key] is None:
                raise bad(f"message {i} has no '{key}' (keys: {sorted(message)})")
            if not isinstance(message[key], str):
                raise bad(f"message {i} '{key}' must be a string, got {describe(message[key])}")
    return value


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Messages,
    *,
    add_generation_prompt: bool,
    source: str,
    row: int,
    field: str,
) -> str:
    """Render messages to text with the tokenizer's chat template."""
    if tokenizer.chat_template is None:
        # A configuration problem, not a bad row: no drop_reason, so it always raises.
        raise DataError(
            "the row holds chat messages but the tokenizer has no chat template",
            source=source, row=row, field=field, fix=NO_TEMPLATE_FIX,
        )
    import jinja2  # only needed with a chat template (transformers needs it then too)

    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except jinja2.TemplateError as err:  # e.g. raise_exception('roles must alternate')
        raise DataError(
            f"the chat template rejected the messages: {err}",
            source=source, row=row, field=field, drop_reason="chat template rejected messages",
            fix="Fix the conversation to suit the template, or set data.on_bad_row=drop.",
        ) from None
