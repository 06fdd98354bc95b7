"""Local datasets: JSONL, JSON and Parquet files with prompt and answer fields; the embedded
tasks (task=add, the demo default, and the harder task=mixed)."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from erpo.config import ConfigError, TrainConfig
from erpo.data import (MIXED_LEVELS, DataError, arithmetic_split, difficulty_of, load_examples, mixed_split,
                       read_examples)

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


# ---------------------------------------------------------------------- the mixed task


def test_mixed_split_levels_answers_and_disjointness():
    train, held_out = mixed_split(60, 12, seed=3)
    assert len(train) == 60 and len(held_out) == 12
    for ex in train + held_out:
        a, op, b = ex.prompt[:-1].partition(next(c for c in "+-*" if c in ex.prompt))
        assert ex.prompt.endswith("=") and int(ex.answer) == eval(ex.prompt[:-1]) >= 0  # noqa: S307 (digits and one op)
        assert difficulty_of(ex.prompt) == f"{len(a)}{op}{len(b)}"
    assert [difficulty_of(ex.prompt) for ex in held_out] == [lv for lv in MIXED_LEVELS for _ in range(2)]
    assert [difficulty_of(ex.prompt) for ex in train] == [lv for lv in MIXED_LEVELS for _ in range(10)]
    assert not {ex.prompt for ex in train} & {ex.prompt for ex in held_out}
    assert len({ex.prompt for ex in train}) == 60
    assert mixed_split(60, 12, seed=3) == (train, held_out)  # a pure function of the seed
    assert mixed_split(60, 12, seed=4)[1] != held_out


def test_task_key_selects_the_family_and_add_stays_the_default():
    """task=add (the default, configs/demo.yaml) is the a+b split exactly as before; task=mixed the new family."""
    cfg = TrainConfig()
    assert cfg.demo.task == "add"
    assert (load_examples(cfg, "train"), load_examples(cfg, "eval")) == arithmetic_split(49, 1500, 200, 0)
    mixed = TrainConfig(task="mixed", task_train_size=600, task_eval_size=60)
    assert (load_examples(mixed, "train"), load_examples(mixed, "eval")) == mixed_split(600, 60, 0)
    with pytest.raises(ConfigError, match="task='mul' is not one of add, mixed"):
        TrainConfig(task="mul").validate()
    with pytest.raises(ConfigError, match="task=mixed needs task_train_size and task_eval_size of at least 6"):
        mixed_split(600, 5, 0)
    with pytest.raises(ConfigError, match="level 2\\+1 has fewer than .* lower task_train_size"):
        mixed_split(6 * 900, 6, 0)  # 90 x 9 problems of 2+1 only


def test_eval_reports_and_the_cache_command_name_the_task():
    from erpo.eval_command import _planned_settings
    from erpo.start import rebuild_command

    add, mixed = TrainConfig(), TrainConfig(task="mixed")
    assert _planned_settings(add, "m", 6, 8)["data"] == "arithmetic"  # reports made before the key read the same
    assert _planned_settings(mixed, "m", 6, 8)["data"] == "arithmetic:mixed"
    assert " task=mixed " in rebuild_command(mixed) and "task=" not in rebuild_command(add)


def test_eval_data_of_another_file_reads_math_style_records_after_a_run_on_other_fields(tmp_path):
    """A run trained with prompt_field=q answer_field=gold, evaluated on a MATH-style file
    (problem, solution with a \\boxed{} answer): the records read as they are (issue 29.6:
    it demanded q, then gold); a file with the run's fields still reads by them, and a file
    with neither names the run's fields."""
    math = tmp_path / "math.jsonl"
    math.write_text(json.dumps({"problem": "1+1?", "solution": "so \\boxed{2}"}) + "\n"
                    + json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n")
    ours = tmp_path / "ours.jsonl"
    ours.write_text(json.dumps({"q": "3+3?", "gold": "6", "prompt": "no", "answer": "no"}) + "\n")
    neither = tmp_path / "neither.jsonl"
    neither.write_text(json.dumps({"x": "1"}) + "\n")
    run = dict(dataset=str(ours), prompt_field="q", answer_field="gold")
    assert [(e.prompt, e.answer) for e in load_examples(TrainConfig(**run, eval_dataset=str(math)), "eval")] == [
        ("1+1?", "2"), ("2+2?", "4")]
    assert [(e.prompt, e.answer) for e in load_examples(TrainConfig(**run, eval_dataset=str(ours)), "eval")] == [
        ("3+3?", "6")]
    with pytest.raises(DataError, match="has no 'q' field.*set prompt_field=NAME"):
        load_examples(TrainConfig(**run, eval_dataset=str(neither)), "eval")
