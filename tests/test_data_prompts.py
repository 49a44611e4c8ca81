"""load_prompt_dataset: rendering, tokenisation, and bad rows (error and drop modes)."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridrl.data import DataError, PromptDataset, load_prompt_dataset
from hybridrl.models.tiny import build_char_tokenizer

# A chat template with role markers (<|im_start|>, <|im_end|> are single special tokens).
ROLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ROWS = [
    {"prompt": "1+2=", "ground_truth": "3"},
    {"prompt": [{"role": "user", "content": "2+2="}], "ground_truth": "4"},
]


@pytest.fixture
def tok():
    return build_char_tokenizer()


@pytest.fixture
def role_tok():
    tok = build_char_tokenizer()
    tok.chat_template = ROLE_TEMPLATE
    return tok


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load_one_bad(tmp_path, tok, bad_row, **kwargs):
    """Load a file whose row 1 is `bad_row`; return the DataError message."""
    path = write_jsonl(tmp_path / "train.jsonl", [ROWS[0], bad_row, ROWS[0]])
    with pytest.raises(DataError) as err:
        load_prompt_dataset(path, tok, **kwargs)
    return str(err.value)


def test_string_and_chat_prompts(tok):
    ds = load_prompt_dataset(ROWS, tok)
    assert isinstance(ds, PromptDataset) and len(ds) == 2 and ds.num_dropped == 0
    assert ds.source_name == "<in-memory dataset>"
    assert [ex.prompt for ex in ds] == ["1+2=", "2+2="]  # the tiny template concatenates
    assert ds[0].prompt_ids == tok("1+2=", add_special_tokens=False)["input_ids"]
    assert ds[1].columns == {"ground_truth": "4"} and ds[1].index == 1


def test_chat_template_with_role_markers(role_tok):
    ds = load_prompt_dataset(ROWS, role_tok)
    assert ds[0].prompt == "1+2="  # strings are used as is
    assert ds[1].prompt == "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    im_start, im_end = role_tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ds[1].prompt_ids[0] == im_start and ds[1].prompt_ids.count(im_end) == 1
    assert role_tok.decode(ds[1].prompt_ids) == ds[1].prompt
    no_gen = load_prompt_dataset(ROWS, role_tok, add_generation_prompt=False)
    assert no_gen[1].prompt == "<|im_start|>user\n2+2=<|im_end|>\n"


def test_bos_added_only_when_the_tokenizer_is_configured_to(tok):
    tok.bos_token = "<|im_start|>"
    assert load_prompt_dataset(ROWS[:1], tok)[0].prompt_ids[0] != tok.bos_token_id
    tok.add_bos_token = True
    ids = load_prompt_dataset(ROWS[:1], tok)[0].prompt_ids
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    # A template that writes the BOS itself gets no second one.
    tok.chat_template = "<|im_start|>" + ROLE_TEMPLATE
    ids = load_prompt_dataset(ROWS[1:], tok)[0].prompt_ids
    assert ids[:2] == [tok.bos_token_id, tok.bos_token_id]  # template BOS + the role marker
    assert ids.count(tok.bos_token_id) == 3  # + the generation prompt marker; nothing doubled


def test_sources_jsonl_parquet_hf(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": "1+2=", "ground_truth": "3"}, {"prompt": "9+9=", "ground_truth": "18"}]
    jsonl = write_jsonl(tmp_path / "train.jsonl", rows)
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    for source in (jsonl, parquet, datasets.Dataset.from_list(rows)):
        ds = load_prompt_dataset(source, tok, required_columns=["ground_truth"])
        assert [(ex.prompt, ex.columns["ground_truth"]) for ex in ds] == [
            ("1+2=", "3"), ("9+9=", "18")]
    assert load_prompt_dataset(jsonl, tok).source_name == str(jsonl)


def test_wrong_type_message_matches_the_documented_form(tmp_path, tok):
    message = load_one_bad(tmp_path, tok, {"prompt": 5})
    assert message.endswith(
        "train.jsonl, row 1 (0-based), field 'prompt': expected a string or a list of chat "
        "messages, got int 5. Fix the row, or set data.on_bad_row=drop to skip bad rows.")


@pytest.mark.parametrize("bad_row, what", [
    ({"question": "1+2="}, "the column is missing"),
    ({"prompt": None}, "the column is null"),
    ({"prompt": "  \n"}, "empty or whitespace"),
    ({"prompt": {"text": "hi"}}, "got dict"),
    ({"prompt": []}, "the list of chat messages is empty"),
    ({"prompt": ["hi"]}, "message 0 is str 'hi', not a dict"),
    ({"prompt": [{"content": "hi"}]}, "message 0 has no 'role'"),
    ({"prompt": [{"role": "user"}]}, "message 0 has no 'content'"),
    ({"prompt": [{"role": "user", "content": ["a"]}]}, "message 0 'content' must be a string"),
])
def test_bad_prompt_rows_name_file_row_field(tmp_path, tok, bad_row, what):
    message = load_one_bad(tmp_path, tok, bad_row)
    assert "train.jsonl, row 1 (0-based), field 'prompt'" in message
    assert what in message
    assert "data.on_bad_row=drop" in message


def test_prompt_too_long_says_length_limit_and_fixes(tmp_path, tok):
    message = load_one_bad(tmp_path, tok, {"prompt": "x" * 20}, max_prompt_length=10)
    assert "train.jsonl, row 1 (0-based), field 'prompt'" in message
    assert "20 tokens, longer than data.max_prompt_length=10" in message
    assert "Raise data.max_prompt_length" in message and "data.on_bad_row=drop" in message


def test_missing_required_column(tmp_path, tok):
    message = load_one_bad(tmp_path, tok, {"prompt": "5+5="}, required_columns=["ground_truth"])
    assert "train.jsonl, row 1 (0-based), field 'ground_truth': the column is missing" in message


def test_required_column_missing_everywhere_suggests_closest(tok):
    rows = [{"prompt": "1+1=", "groundtruth": "2"}]
    with pytest.raises(DataError, match=r"row 0 \(0-based\), field 'ground_truth': no row has this "
                       r"column.*rename column 'groundtruth' to 'ground_truth'"):
        load_prompt_dataset(rows, tok, required_columns=["ground_truth"])


def test_prompt_column_missing_everywhere_lists_columns_and_suggests_key(tmp_path, tok):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompts": "1+1=", "answer": "2"}] * 3)
    with pytest.raises(DataError) as err:
        load_prompt_dataset(path, tok, on_bad_row="drop")  # a wrong key is never dropped
    message = str(err.value)
    assert "train.jsonl, row 0 (0-based), field 'prompt': no row has this column" in message
    assert "['answer', 'prompts']" in message and "Set data.prompt_key=prompts" in message


def test_chat_prompt_without_template_names_the_fix(tmp_path, tok):
    tok.chat_template = None
    with pytest.raises(DataError) as err:
        load_prompt_dataset(ROWS, tok, on_bad_row="drop")  # a config problem: never dropped
    message = str(err.value)
    assert "row 1 (0-based), field 'prompt'" in message and "no chat template" in message
    assert "model.chat_template" in message


def test_template_that_raises_is_a_bad_row(tok):
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(DataError, match="template rejected the messages: roles must alternate"):
        load_prompt_dataset(ROWS, tok)
    ds = load_prompt_dataset(ROWS, tok, on_bad_row="drop")
    assert len(ds) == 1 and ds.drop_reasons == {"chat template rejected messages": 1}


def test_drop_mode_counts_reasons_and_logs_one_line(tmp_path, tok, caplog):
    rows = [
        {"prompt": "1+1=", "ground_truth": "2"},
        {"prompt": "", "ground_truth": "0"},
        {"prompt": 7, "ground_truth": "7"},
        {"prompt": "x" * 50, "ground_truth": "0"},
        {"prompt": "2+2="},
        {"prompt": " ", "ground_truth": "0"},
        {"prompt": "3+3=", "ground_truth": "6"},
    ]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="hybridrl.data"):
        ds = load_prompt_dataset(path, tok, on_bad_row="drop", max_prompt_length=20,
                                 required_columns=["ground_truth"])
    assert [ex.index for ex in ds] == [0, 6]
    assert ds.num_dropped == 5
    assert ds.drop_reasons == {"empty prompt": 2, "prompt wrong type": 1, "prompt too long": 1,
                               "missing ground_truth": 1}
    records = [r for r in caplog.records if r.name == "hybridrl.data"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    line = records[0].getMessage()
    assert "\n" not in line and "dropped 5 of 7 rows" in line and "empty prompt: 2" in line
    assert "row 1 (0-based)" in line  # the first dropped row


def test_all_rows_dropped_raises(tmp_path, tok):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": ""}, {"prompt": 3}])
    with pytest.raises(DataError, match=r"train\.jsonl: all 2 rows are bad"):
        load_prompt_dataset(path, tok, on_bad_row="drop")


def test_on_bad_row_must_be_known(tok):
    with pytest.raises(ValueError, match="'error' or 'drop'"):
        load_prompt_dataset(ROWS, tok, on_bad_row="skip")
