"""Preference (DPO / reward model) and unpaired (KTO) datasets."""

import json

import pytest

from hybridrl.data import (
    DataError,
    load_preference_dataset,
    load_unpaired_dataset,
    make_arith_preference_rows,
    make_arith_rows,
    make_arith_unpaired_rows,
)
from hybridrl.models.tiny import build_char_tokenizer

ROLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GOOD = {"prompt": "1+2=", "chosen": "3", "rejected": "4"}


@pytest.fixture
def tok():
    tok = build_char_tokenizer()
    tok.chat_template = ROLE_TEMPLATE
    return tok


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def bad_message(tmp_path, tok, bad_row, loader=load_preference_dataset, good=GOOD, **kwargs):
    path = write_jsonl(tmp_path / "prefs.jsonl", [good, bad_row])
    with pytest.raises(DataError) as err:
        loader(path, tok, **kwargs)
    return str(err.value)


def test_string_completions_get_eos(tok):
    [ex] = load_preference_dataset([GOOD], tok)
    assert ex.prompt_ids == ids(tok, "1+2=")
    assert ex.chosen_ids == ids(tok, "3") + [tok.eos_token_id]
    assert ex.rejected_ids == ids(tok, "4") + [tok.eos_token_id]
    assert ex.index == 0


def test_chat_completions_are_the_suffix_after_the_rendered_prompt(tok):
    row = {
        "prompt": [{"role": "user", "content": "1+2="}],
        "chosen": [{"role": "assistant", "content": "3"}],
        "rejected": [{"role": "assistant", "content": "4"}],
    }
    [ex] = load_preference_dataset([row], tok)
    assert tok.decode(ex.prompt_ids) == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ex.chosen_ids) == "3<|im_end|>\n"
    assert tok.decode(ex.rejected_ids) == "4<|im_end|>\n"


def test_chat_prompt_with_string_completions(tok):
    row = {**GOOD, "prompt": [{"role": "user", "content": "1+2="}]}
    [ex] = load_preference_dataset([row], tok)
    assert tok.decode(ex.prompt_ids).endswith("<|im_start|>assistant\n")
    assert ex.chosen_ids == ids(tok, "3") + [tok.eos_token_id]


def test_template_whose_rendering_is_not_prefix_stable(tok):
    tok.chat_template = ROLE_TEMPLATE.replace("<|im_start|>assistant\n{% endif %}",
                                              "<|im_start|>assistant:{% endif %}")
    row = {"prompt": [{"role": "user", "content": "1+2="}],
           "chosen": [{"role": "assistant", "content": "3"}],
           "rejected": [{"role": "assistant", "content": "4"}]}
    with pytest.raises(DataError, match=r"row 0 \(0-based\), field 'chosen': the chat template's "
                       r"rendering.*model\.chat_template"):
        load_preference_dataset([row], tok, on_bad_row="drop")  # never dropped: every row fails


@pytest.mark.parametrize("bad_row, field, what", [
    ({"prompt": "1+1=", "rejected": "3"}, "chosen", "the column is missing"),
    ({"prompt": "1+1=", "chosen": "2", "rejected": 3}, "rejected", "got int 3"),
    ({"prompt": "1+1=", "chosen": "", "rejected": "3"}, "chosen", "the chosen is empty"),
    ({"prompt": "1+1=", "chosen": "2", "rejected": "2"}, "rejected", "are identical"),
    ({"prompt": 11, "chosen": "2", "rejected": "3"}, "prompt", "got int 11"),
    ({"prompt": "1+1=", "chosen": [{"role": "assistant", "content": "2"}], "rejected": "3"},
     "chosen", "'prompt' is a plain string"),
    ({"prompt": [{"role": "user", "content": "1+1="}],
      "chosen": [{"role": "user", "content": "2"}], "rejected": "3"},
     "chosen", "must all be assistant turns, found roles ['user']"),
    ({"prompt": [{"role": "user", "content": "1+1="}],
      "chosen": [{"role": "assistant"}], "rejected": "3"}, "chosen", "has no 'content'"),
])
def test_bad_preference_rows(tmp_path, tok, bad_row, field, what):
    message = bad_message(tmp_path, tok, bad_row)
    assert f"prefs.jsonl, row 1 (0-based), field '{field}'" in message
    assert what in message


def test_too_long(tmp_path, tok):
    message = bad_message(tmp_path, tok, {**GOOD, "rejected": "9" * 30}, max_length=10)
    assert "prefs.jsonl, row 1 (0-based), field 'rejected'" in message
    assert "prompt + rejected is 35 tokens, longer than data.max_length=10" in message


def test_missing_column_everywhere_suggests_key(tok):
    rows = [{"prompt": "1+1=", "chosen_response": "2", "rejected": "3"}]
    with pytest.raises(DataError, match=r"field 'chosen'.*Set data\.chosen_key=chosen_response"):
        load_preference_dataset(rows, tok)


def test_drop_mode(tok):
    rows = [GOOD, {**GOOD, "chosen": None}, {**GOOD, "rejected": "3"}, GOOD]
    examples = load_preference_dataset(rows, tok, on_bad_row="drop")
    assert [ex.index for ex in examples] == [0, 3]


def test_arith_preference_rows_load(tok):
    rows = make_arith_preference_rows(make_arith_rows(50, seed=0, ops=("+", "-")), seed=0)
    assert len(load_preference_dataset(rows, tok)) == 50


def test_unpaired_dataset_and_labels(tmp_path, tok):
    rows = [
        {"prompt": "1+2=", "completion": "3", "label": True},
        {"prompt": "1+2=", "completion": "4", "label": 0},
    ]
    a, b = load_unpaired_dataset(rows, tok)
    assert (a.label, b.label) == (True, False)
    assert a.completion_ids == ids(tok, "3") + [tok.eos_token_id] and b.index == 1
    good = rows[0]
    for bad_label in ("true", 2, 1.0, None):
        message = bad_message(tmp_path, tok, {**good, "label": bad_label},
                              loader=load_unpaired_dataset, good=good)
        assert "prefs.jsonl, row 1 (0-based), field 'label'" in message
    message = bad_message(tmp_path, tok, {"prompt": "1+1=", "completion": 2, "label": True},
                          loader=load_unpaired_dataset, good=good)
    assert "row 1 (0-based), field 'completion': expected a string" in message
    kto = make_arith_unpaired_rows(make_arith_rows(20, seed=0), seed=0)
    assert sum(ex.label for ex in load_unpaired_dataset(kto, tok)) == 10
