import json
import re
from pathlib import Path

import pytest

from diffrl.data import PromptRecord, load_prompts


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    return write(path, "".join(json.dumps(row) + "\n" for row in rows))


# ------------------------------------------------------------------------------------- formats
def test_txt_one_prompt_per_non_empty_line_stripped(tmp_path):
    path = write(tmp_path / "shapes.txt", "a red circle\n\n   a blue square  \r\n\t\nthree green triangles")
    records = load_prompts([str(path)])
    assert [r.prompt for r in records] == ["a red circle", "a blue square", "three green triangles"]
    assert [r.source for r in records] == [f"{path}:1", f"{path}:3", f"{path}:5"]
    assert all(r.negative_prompt is None for r in records)
    assert all(r.metadata == {"data_source": "shapes"} for r in records)
    assert records[0].data_source == "shapes"


def test_jsonl_rows_keep_every_other_field_as_metadata(tmp_path):
    path = write_jsonl(
        tmp_path / "ocr.jsonl",
        [
            {"prompt": "a sign that says OPEN", "ocr_text": "OPEN", "negative_prompt": "blurry"},
            {
                "prompt": "  a mug  ",
                "spec": {"shapes": [{"kind": "circle", "color": "red"}]},
                "data_source": "mugs",
            },
        ],
    )
    first, second = load_prompts([path])
    assert first == PromptRecord(
        "a sign that says OPEN", "blurry", {"ocr_text": "OPEN", "data_source": "ocr"}, f"{path}:1"
    )
    assert second.prompt == "a mug"
    assert second.negative_prompt is None
    assert second.metadata == {
        "spec": {"shapes": [{"kind": "circle", "color": "red"}]},
        "data_source": "mugs",
    }


def test_jsonl_custom_prompt_key_and_blank_lines(tmp_path):
    path = write(tmp_path / "caps.jsonl", '\n{"caption": "a cat", "prompt": "unused"}\n\n')
    (record,) = load_prompts([path], prompt_key="caption")
    assert record.prompt == "a cat"
    assert record.metadata == {"prompt": "unused", "data_source": "caps"}
    assert record.source == f"{path}:2"


def test_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "mixed.parquet"
    table = pa.table(
        {
            "prompt": ["a red circle", "text: HELLO"],
            "negative_prompt": [None, "low quality"],
            "ocr_text": [None, "HELLO"],
            "count": [1, 2],
            "data_source": ["shapes", None],
        }
    )
    pq.write_table(table, path)
    first, second = load_prompts([path])
    assert first == PromptRecord(
        "a red circle", None, {"ocr_text": None, "count": 1, "data_source": "shapes"}, f"{path}:1"
    )
    assert second.negative_prompt == "low quality"
    assert second.metadata == {"ocr_text": "HELLO", "count": 2, "data_source": "mixed"}  # null -> the stem
    assert json.loads(json.dumps(second.metadata)) == second.metadata


def test_files_concatenate_in_order_and_a_single_path_is_accepted(tmp_path):
    a = write(tmp_path / "a.txt", "one\ntwo\n")
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "three"}])
    records = load_prompts([a, str(b)])
    assert [(r.prompt, r.data_source) for r in records] == [("one", "a"), ("two", "a"), ("three", "b")]
    assert load_prompts(a) == load_prompts([a])


def test_builtin_prompt_file_loads():
    path = (
        Path(__file__).resolve().parents[2] / "diffrl" / "config" / "presets" / "data" / "simple_prompts.txt"
    )
    records = load_prompts([path])
    assert records and all(r.prompt and r.data_source == "simple_prompts" for r in records)


def test_records_pickle(tmp_path):
    import pickle

    (record,) = load_prompts([write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "k": [1]}])])
    assert pickle.loads(pickle.dumps(record)) == record


# -------------------------------------------------------------------------------------- errors
def raises(exc, match, files, **kwargs):
    with pytest.raises(exc, match=match) as info:
        load_prompts(files, **kwargs)
    return str(info.value)


def test_missing_file(tmp_path):
    message = raises(FileNotFoundError, "prompt file not found", [tmp_path / "nope.jsonl"])
    assert "nope.jsonl" in message and "data.train_files" in message


def test_no_files():
    raises(ValueError, "no prompt files given", [])


def test_empty_files(tmp_path):
    for path in (
        write(tmp_path / "e.txt", ""),
        write(tmp_path / "blank.txt", "\n  \n\n"),
        write(tmp_path / "e.jsonl", "\n"),
    ):
        message = raises(ValueError, "no prompts in the file", [path])
        assert str(path) in message
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "e.parquet")
    raises(ValueError, "no prompts in the file", [tmp_path / "e.parquet"])


def test_unsupported_extension_lists_the_supported_ones(tmp_path):
    message = raises(
        ValueError, "unsupported prompt file extension '.csv'", [write(tmp_path / "p.csv", "a\n")]
    )
    assert ".txt" in message and ".jsonl" in message and ".parquet" in message
    assert "write one object per line and name the file .jsonl" in raises(
        ValueError, "unsupported", [write(tmp_path / "p.json", "[]")]
    )
    raises(ValueError, "is a directory", [tmp_path])


def test_row_without_the_prompt_key_names_line_keys_and_suggestion(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"promt": "typo", "ocr_text": "A"}])
    message = raises(ValueError, re.escape(f"{path}:2: no prompt key 'prompt'"), [path])
    assert "['promt', 'ocr_text']" in message
    assert "did you mean 'promt'" in message and "data.prompt_key" in message

    path = write_jsonl(tmp_path / "c.jsonl", [{"caption": "a cat"}])
    assert "did you mean 'caption'" in raises(ValueError, "jsonl:1: no prompt key", [path])

    path = write_jsonl(tmp_path / "n.jsonl", [{"zzz": "a cat"}])
    message = raises(ValueError, "jsonl:1: no prompt key", [path])
    assert "did you mean" not in message and "set data.prompt_key" in message


def test_parquet_without_the_prompt_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"Prompt": ["a"], "x": [1]}), path)
    message = raises(ValueError, "no prompt column 'prompt'", [path])
    assert "did you mean 'Prompt'" in message
    assert load_prompts([path], prompt_key="Prompt")[0].prompt == "a"


def test_non_string_null_and_empty_prompts(tmp_path):
    path = write(tmp_path / "p.jsonl", '{"prompt": "ok"}\n{"prompt": 3}\n')
    raises(ValueError, re.escape(f"{path}:2: the prompt 'prompt' must be a string, got number 3"), [path])
    path = write(tmp_path / "q.jsonl", '{"prompt": null}\n')
    raises(ValueError, "jsonl:1: the prompt 'prompt' must be a string, got null", [path])
    path = write(tmp_path / "r.jsonl", '{"prompt": "ok"}\n\n{"prompt": "   "}\n')
    raises(ValueError, "jsonl:3: the prompt 'prompt' is empty", [path])
    path = write(tmp_path / "s.jsonl", '{"prompt": "ok", "negative_prompt": ["x"]}\n')
    raises(ValueError, "jsonl:1: 'negative_prompt' must be a string or null, got array", [path])
    path = write(tmp_path / "t.jsonl", '{"prompt": "ok", "data_source": 7}\n')
    raises(ValueError, "jsonl:1: 'data_source' must be a non-empty string", [path])

    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"prompt": ["a", None]}), tmp_path / "n.parquet")
    raises(ValueError, "row 2: the prompt 'prompt' must be a string, got null", [tmp_path / "n.parquet"])


def test_invalid_json_and_non_objects(tmp_path):
    path = write(tmp_path / "p.jsonl", '{"prompt": "ok"}\n{"prompt": "a",}\n')
    message = raises(ValueError, re.escape(f"{path}:2: invalid JSON"), [path])
    assert "one JSON object" in message
    path = write(tmp_path / "q.jsonl", '["a red circle"]\n')
    raises(ValueError, "q.jsonl:1: expected a JSON object, got a JSON array", [path])


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes(b"fine\n\xff\xfe bad\n")
    raises(ValueError, "p.txt:2: not valid UTF-8", [path])


def test_unreadable_parquet(tmp_path):
    pytest.importorskip("pyarrow")
    raises(ValueError, "not a readable parquet file", [write(tmp_path / "p.parquet", "not parquet")])
