"""SFT datasets: the loss mask covers exactly the response / assistant tokens."""

import json

import pytest

from hybridrl.data import DataError, arith_sft_rows, load_sft_dataset, make_arith_rows
from hybridrl.models.tiny import build_char_tokenizer

ROLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Add."},
    {"role": "user", "content": "1+2="},
    {"role": "assistant", "content": "3"},
    {"role": "user", "content": "2+3="},
    {"role": "assistant", "content": "5"},
]


@pytest.fixture
def tok():
    return build_char_tokenizer()


@pytest.fixture
def role_tok():
    tok = build_char_tokenizer()
    tok.chat_template = ROLE_TEMPLATE
    return tok


def masked_runs(tok, ex):
    """The decoded text of each maximal run of loss-masked tokens."""
    runs, current = [], []
    for token, flag in zip(ex.input_ids, ex.loss_mask):
        if flag:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(run) for run in runs]


def test_prompt_response_mask_is_exactly_the_response_and_eos(tok):
    [ex] = load_sft_dataset([{"prompt": "12+34=", "response": "46"}], tok)
    prompt_ids = tok("12+34=", add_special_tokens=False)["input_ids"]
    response_ids = tok("46", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ex.input_ids == prompt_ids + response_ids
    assert ex.loss_mask == [0] * len(prompt_ids) + [1] * len(response_ids)


def test_arith_sft_rows_get_one_eos(tok):
    rows = arith_sft_rows(make_arith_rows(5, seed=0), tok.eos_token)
    for row, ex in zip(rows, load_sft_dataset(rows, tok)):
        assert ex.input_ids.count(tok.eos_token_id) == 1 and ex.input_ids[-1] == tok.eos_token_id
        assert masked_runs(tok, ex) == [row["response"]]


def test_messages_mask_only_assistant_turns(role_tok):
    [ex] = load_sft_dataset([{"messages": CONVERSATION}], role_tok)
    assert len(ex.input_ids) == len(ex.loss_mask)
    rendered = role_tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert role_tok.decode(ex.input_ids) == rendered
    assert masked_runs(role_tok, ex) == ["3<|im_end|>\n", "5<|im_end|>\n"]


def test_messages_with_the_concatenating_template(tok):
    [ex] = load_sft_dataset([{"messages": CONVERSATION[1:3]}], tok)
    assert tok.decode(ex.input_ids) == "1+2=3"
    assert ex.loss_mask == [0, 0, 0, 0, 1]


def test_chat_prompt_with_response_column(role_tok):
    row = {"prompt": [{"role": "user", "content": "1+2="}], "response": "3"}
    [ex] = load_sft_dataset([row], role_tok)
    assert masked_runs(role_tok, ex) == ["3" + role_tok.eos_token]
    assert role_tok.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if not m]).endswith(
        "<|im_start|>assistant\n")


def test_mixed_rows_and_sources(tmp_path, role_tok):
    datasets = pytest.importorskip("datasets")
    rows = [{"messages": CONVERSATION[1:3]}, {"messages": CONVERSATION}]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from_file = load_sft_dataset(path, role_tok)
    from_hf = load_sft_dataset(datasets.Dataset.from_list(rows), role_tok)
    assert [ex.input_ids for ex in from_file] == [ex.input_ids for ex in from_hf]
    assert [ex.loss_mask for ex in from_file] == [ex.loss_mask for ex in from_hf]


def write_and_load(tmp_path, tok, bad_row, good=None, **kwargs):
    good = good or {"messages": CONVERSATION}
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad_row) + "\n")
    with pytest.raises(DataError) as err:
        load_sft_dataset(path, tok, **kwargs)
    return str(err.value)


@pytest.mark.parametrize("bad_row, field, what", [
    ({"messages": CONVERSATION[:2]}, "messages", "no assistant turn"),
    ({"messages": CONVERSATION[2:]}, "messages", "starts with an assistant turn"),
    ({"messages": "hi"}, "messages", "expected a list of chat messages, got str"),
    ({"messages": [{"role": "user", "content": 1}]}, "messages", "'content' must be a string"),
    ({"prompt": "1+1="}, "response", "the column is missing"),
    ({"prompt": "1+1=", "response": " "}, "response", "is empty"),
    ({"question": "1+1="}, "prompt", "the column is missing"),
])
def test_bad_sft_rows(tmp_path, role_tok, bad_row, field, what):
    message = write_and_load(tmp_path, role_tok, bad_row)
    assert f"sft.jsonl, row 1 (0-based), field '{field}'" in message
    assert what in message


def test_too_long_is_a_bad_row_not_truncated(tmp_path, role_tok):
    message = write_and_load(tmp_path, role_tok, {"prompt": "1+1=", "response": "2" * 40},
                             good={"prompt": "1+1=", "response": "2"}, max_length=30)
    assert "row 1 (0-based), field 'response'" in message
    assert "sequence is 45 tokens, longer than data.max_length=30" in message


def test_no_usable_columns_lists_them(role_tok):
    with pytest.raises(DataError, match=r"row 0 \(0-based\), field 'messages': no row has a "
                       r"'messages' column.*\['input', 'output'\].*data\.messages_key"):
        load_sft_dataset([{"input": "a", "output": "b"}], role_tok)


def test_template_that_is_not_incremental(role_tok):
    # Renders only the last turn: a conversation's rendering does not extend its prefix's.
    role_tok.chat_template = "{{ messages[-1]['content'] }}"
    with pytest.raises(DataError, match="renders a conversation differently"):
        load_sft_dataset([{"messages": CONVERSATION}], role_tok, on_bad_row="drop")


def test_drop_mode(role_tok):
    rows = [{"messages": CONVERSATION}, {"messages": CONVERSATION[:2]},
            {"prompt": "a", "response": 1}]
    examples = load_sft_dataset(rows, role_tok, on_bad_row="drop")
    assert [ex.index for ex in examples] == [0]
