"""Local datasets: JSONL, JSON and Parquet files with prompt and answer fields."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from erpo.data import DataError, read_examples

ROWS = [{"question": "1+2=", "gold": 3, "extra": "x"}, {"question": "4+4=", "gold": "8", "extra": None}]


def _write(tmp_path, ext):
    path = tmp_path / f"d.{ext}"
    if ext == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif ext == "json":
        path.write_text(json.dumps(ROWS))
    else:
        pq.write_table(pa.Table.from_pylist([{k: str(v) if v is not None else None for k, v in r.items()} for r in ROWS]), path)
    return str(path)


@pytest.mark.parametrize("ext", ["jsonl", "json", "parquet"])
def test_every_format_reads_the_same_examples(tmp_path, ext):
    examples = read_examples(_write(tmp_path, ext), "question", "gold")
    assert [(e.prompt, e.answer) for e in examples] == [("1+2=", "3"), ("4+4=", "8")]


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_missing_field_names_it_and_the_fix(tmp_path, ext):
    with pytest.raises(DataError, match="has no 'text' field.*set prompt_field=NAME"):
        read_examples(_write(tmp_path, ext), "text", "gold")
    with pytest.raises(DataError, match="has no 'answer' field.*set answer_field=NAME"):
        read_examples(_write(tmp_path, ext), "question", "answer")


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_default_prompt_field_falls_back_to_question(tmp_path, ext):
    """With the default prompt_field, a record's "question" (or "problem") is its prompt."""
    examples = read_examples(_write(tmp_path, ext), "prompt", "gold")
    assert [(e.prompt, e.answer) for e in examples] == [("1+2=", "3"), ("4+4=", "8")]


@pytest.mark.parametrize("name, content", [("d.parquet", b"not parquet"), ("d.jsonl", b'\xff\xfe{"prompt": 1}\n')])
def test_unreadable_file_is_a_data_error(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=f"dataset {path} could not be read"):
        read_examples(str(path), "prompt", "answer")


@pytest.mark.parametrize("ext", ["jsonl", "json"])
def test_null_field_is_reported_as_null_not_missing(tmp_path, ext):
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "4+4=", "answer": None}, {"prompt": None, "answer": "1"}]
    path = tmp_path / f"d.{ext}"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) if ext == "jsonl" else json.dumps(rows))
    with pytest.raises(DataError, match=r"record 1 has 'answer': null") as info:
        read_examples(str(path), "prompt", "answer")
    assert "no 'answer' field" not in str(info.value) and "answer_field=" not in str(info.value)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[::2]) if ext == "jsonl" else json.dumps(rows[::2]))
    with pytest.raises(DataError, match=r"record 1 has 'prompt': null"):
        read_examples(str(path), "prompt", "answer")
