"""read_rows: every supported source, and a DataError naming file, line/row and fix for bad ones."""

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridrl.data import DataError, read_rows

ROWS = [{"prompt": "1+2=", "ground_truth": "3"}, {"prompt": "2+2=", "ground_truth": "4"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_reads_jsonl_json_parquet_list_and_hf_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    jsonl = write_jsonl(tmp_path / "d.jsonl", ROWS)
    js = tmp_path / "d.json"
    js.write_text(json.dumps(ROWS))
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)

    for source in (jsonl, str(js), parquet):
        rows, name = read_rows(source)
        assert rows == ROWS and name == str(source)
    for source in (ROWS, datasets.Dataset.from_list(ROWS)):
        rows, name = read_rows(source)
        assert rows == ROWS and name == "<in-memory dataset>"


def test_jsonl_skips_blank_lines_and_keeps_unicode_line_separators(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a\u2028b"}\n\n   \n{"prompt": "c"}\n')
    rows, _ = read_rows(path)
    assert rows == [{"prompt": "a\u2028b"}, {"prompt": "c"}]


def test_missing_file_names_path_and_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as err:
        read_rows("nope/train.jsonl")
    message = str(err.value)
    assert "nope/train.jsonl" in message and "not found" in message
    assert f"working directory is {tmp_path}" in message


def test_unknown_extension_lists_supported(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("prompt\n1+1=\n")
    with pytest.raises(DataError, match=r"train\.csv.*'\.csv'.*\.jsonl, \.json, \.parquet"):
        read_rows(path)


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.json"])
def test_empty_file(tmp_path, name):
    path = tmp_path / name
    path.write_text("\n" if name.endswith("l") else "[]")
    with pytest.raises(DataError, match=rf"{name}: the file holds no rows"):
        read_rows(path)


def test_empty_in_memory_list():
    with pytest.raises(DataError, match="<in-memory dataset>: the list holds no rows"):
        read_rows([])


def test_invalid_json_line_names_line_and_row(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b",\n')
    with pytest.raises(DataError) as err:
        read_rows(path)
    assert "train.jsonl, line 3, row 1 (0-based): not valid JSON" in str(err.value)


def test_jsonl_line_not_an_object(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"train\.jsonl, line 2, row 1 \(0-based\): expected a JSON "
                       r"object, got list"):
        read_rows(path)


def test_invalid_utf8_gives_byte_offset_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError) as err:
        read_rows(path)
    assert "train.jsonl, line 2: invalid UTF-8 at byte offset 31" in str(err.value)
    assert "Re-encode" in str(err.value)


def test_truncated_parquet(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS * 50), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"train\.parquet: not a valid parquet file"):
        read_rows(path)


def test_json_not_a_list_of_objects(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"data": ROWS}))
    with pytest.raises(DataError, match=r"train\.json: expected a JSON list of objects, got a dict "
                       r"with keys \['data'\]"):
        read_rows(path)
    path.write_text(json.dumps([ROWS[0], "oops"]))
    with pytest.raises(DataError, match=r"train\.json, row 1 \(0-based\): expected a JSON object"):
        read_rows(path)


def test_json_lines_saved_as_json_suggests_rename(tmp_path):
    path = write_jsonl(tmp_path / "train.json", ROWS)
    with pytest.raises(DataError, match="rename it to .jsonl"):
        read_rows(path)


def test_in_memory_row_not_a_dict():
    with pytest.raises(DataError, match=r"<in-memory dataset>, row 1 \(0-based\): expected a dict"):
        read_rows([ROWS[0], 5])


def test_dataset_dict_asks_for_a_split():
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)})
    with pytest.raises(DataError, match=r"dataset\['train'\]"):
        read_rows(dd)


def test_data_error_pickles_with_its_fields():
    err = DataError("bad", source="f.jsonl", row=3, field="prompt", fix="Fix it.", drop_reason="x")
    copy = pickle.loads(pickle.dumps(err))
    assert str(copy) == str(err) == "f.jsonl, row 3 (0-based), field 'prompt': bad. Fix it."
    assert (copy.row, copy.field, copy.drop_reason) == (3, "prompt", "x")


def test_data_package_imports_no_torch():
    # Stub the top-level package so only hybridrl.data's own imports are checked (the top-level
    # __init__ re-exports the engines, which do need torch).
    package_dir = Path(__file__).resolve().parents[1] / "hybridrl"
    code = (
        "import sys, types\n"
        f"stub = types.ModuleType('hybridrl'); stub.__path__ = [{str(package_dir)!r}]\n"
        "sys.modules['hybridrl'] = stub\n"
        "import hybridrl.data\n"
        "assert 'torch' not in sys.modules, 'hybridrl.data imported torch'\n"
        "assert 'transformers' not in sys.modules, 'hybridrl.data imported transformers'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
