"""Prompt files: .txt (one prompt per line), .jsonl (one JSON object per line), .parquet (one row each).

Every row becomes a `PromptRecord`: the prompt, an optional negative prompt, and every other field
of the row as `metadata`, which travels with the prompt to the reward functions (an OCR target text,
a shapes spec, a `data_source` for per-source validation metrics). Rows are checked while loading,
so a bad file fails before any model or worker starts, with the file, the line (or row) and the fix.

For image-edit models a row also carries its condition image(s) in the field `image_key`
(`data.image_key`, "image" by default; read only when the model takes condition images): a path
relative to the prompt file, bytes in a parquet column, or a list of them. Each is opened and
checked while loading (`diffrl.data.images.read_condition_image`) and kept as
`PromptRecord.images`, not in the metadata.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffrl.data.images import ConditionImage, read_condition_image
from diffrl.files import open_regular

SUPPORTED_EXTENSIONS = (".txt", ".jsonl", ".parquet")
NEGATIVE_PROMPT_KEY = "negative_prompt"
DATA_SOURCE_KEY = "data_source"

#: Longest line (one row of a .txt or .jsonl file) read, in bytes. A line is read with at most this
#: many bytes in memory, so a runaway line (a whole dataset without newlines) fails at once instead
#: of driving the tokenizer out of memory; rows carry a prompt and a little metadata, far below it.
MAX_ROW_BYTES = 1 << 20
#: Longest prompt, in characters. Text encoders read a few hundred tokens
#: (rollout.pipeline.max_sequence_length); 10,000 characters is already far beyond any of them.
MAX_PROMPT_CHARS = 10_000

_FORMATS = ".txt (one prompt per line), .jsonl (one JSON object per line) or .parquet (one row per prompt)"
# Column names that usually hold the prompt, offered when the configured key is missing.
_COMMON_PROMPT_KEYS = ("prompt", "prompts", "caption", "text", "instruction", "query", "input")


@dataclass(frozen=True)
class PromptRecord:
    """One prompt and what the rewards need to score its images.

    `metadata` holds every field of the row except the prompt and the negative prompt, plus
    `data_source` (the file's stem unless the row names one). `source` is `file:line` (1-based line
    for .txt/.jsonl, 1-based row for .parquet), for error messages and provenance.
    """

    prompt: str
    negative_prompt: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict, hash=False)
    source: str = "<memory>"
    images: tuple[ConditionImage, ...] = ()  # condition images (image-edit models), in row order

    @property
    def data_source(self) -> str | None:
        return self.metadata.get(DATA_SOURCE_KEY)


def load_prompts(
    files: Sequence[str | os.PathLike] | str | os.PathLike,
    prompt_key: str = "prompt",
    image_key: str | None = None,
) -> list[PromptRecord]:
    """Every prompt of `files`, in file order then row order.

    `prompt_key` names the field holding the prompt in .jsonl/.parquet rows (`data.prompt_key`); a
    .txt file is all prompts. `image_key` (`data.image_key`, for models that take condition images;
    None = rows carry none) names the field holding each row's condition image(s), read and checked
    here. Raises FileNotFoundError for a missing file or image and ValueError for an unsupported
    extension, a file without prompts, or a bad row (naming the file, the line and the fix).
    """
    if isinstance(files, str | os.PathLike):
        files = [files]
    files = list(files)
    if not files:
        raise ValueError(f"no prompt files given: list at least one {_FORMATS} file")
    if not isinstance(prompt_key, str) or not prompt_key:
        raise ValueError(
            f"prompt_key={prompt_key!r} is invalid: it must name the field that holds the prompt"
        )
    if image_key is not None and (not isinstance(image_key, str) or not image_key or image_key == prompt_key):
        raise ValueError(
            f"image_key={image_key!r} is invalid: it must name the field that holds the condition image(s), "
            f"other than the prompt's ({prompt_key!r})"
        )
    records: list[PromptRecord] = []
    for file in files:
        records.extend(_load_file(Path(file), prompt_key, image_key))
    return records


# --------------------------------------------------------------------------------------- files
def _load_file(path: Path, prompt_key: str, image_key: str | None) -> list[PromptRecord]:
    if not path.exists():
        raise FileNotFoundError(
            f"prompt file not found: {path} (resolved to {path.resolve()}); "
            "check the path in data.train_files / data.val_files"
        )
    if path.is_dir():
        raise ValueError(f"{path} is a directory: list the prompt files in it ({_FORMATS}) one by one")
    suffix = path.suffix.lower()
    if suffix == ".txt" and image_key is not None:
        raise ValueError(
            f"{path}: a .txt prompt file holds prompts only, and this model takes condition images: write "
            f'the rows as .jsonl, e.g. {{"prompt": "make the sky red", "{image_key}": "images/1.png"}}, '
            "or as .parquet with the images' bytes in a column"
        )
    if suffix == ".txt":
        records = _load_txt(path)
    elif suffix == ".jsonl":
        records = _load_jsonl(path, prompt_key, image_key)
    elif suffix == ".parquet":
        records = _load_parquet(path, prompt_key, image_key)
    else:
        hint = ""
        if suffix == ".json":
            hint = "; for JSON write one object per line and name the file .jsonl"
        elif suffix in (".csv", ".tsv"):
            hint = "; convert it to .parquet or .jsonl"
        raise ValueError(
            f"{path}: unsupported prompt file extension {suffix or '(none)'!r}; supported: {_FORMATS}{hint}"
        )
    if not records:
        raise ValueError(
            f"{path}: no prompts in the file (it is empty or has only blank lines); "
            "add prompts or remove it from data.train_files / data.val_files"
        )
    return records


def _read_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based number, line) of the file (UTF-8, a BOM allowed), split on newlines only so numbers
    match an editor's; streamed, holding at most MAX_ROW_BYTES of one line in memory."""
    with open_regular(path, "prompt file") as file:
        number = 0
        while True:
            data = file.readline(MAX_ROW_BYTES + 1)
            if not data:
                return
            number += 1
            if len(data) > MAX_ROW_BYTES:
                raise ValueError(
                    f"{path}:{number}: the line is longer than {MAX_ROW_BYTES} bytes (the limit per row, "
                    "diffrl.data.prompts.MAX_ROW_BYTES); each prompt goes on its own line: check the file's "
                    "newlines, or shorten the row"
                )
            try:
                text = data.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{path}:{number}: not valid UTF-8 ({err.reason}); save the file as UTF-8"
                ) from None
            yield number, text.removesuffix("\n").removesuffix("\r")


def read_text_prompts(path: Path, what: str) -> list[str]:
    """The non-blank lines of a text file of prompts (`diffrl sample --prompts-file`), checked as
    a .txt prompt file's are (a regular file, line and prompt lengths, UTF-8)."""
    if not path.exists():
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist")
    return [record.prompt for record in _load_txt(path)]


def _load_txt(path: Path) -> list[PromptRecord]:
    records = []
    for number, line in _read_lines(path):
        prompt = line.strip()
        if prompt:
            _check_length(prompt, "the prompt", f"{path}:{number}")
            records.append(PromptRecord(prompt, None, {DATA_SOURCE_KEY: path.stem}, f"{path}:{number}"))
    return records


def _load_jsonl(path: Path, prompt_key: str, image_key: str | None) -> list[PromptRecord]:
    records = []
    for number, line in _read_lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path}:{number}: invalid JSON ({err.msg} at column {err.colno}); each line of a .jsonl "
                f'file must be one JSON object, e.g. {{"{prompt_key}": "a red circle"}}'
            ) from None
        if not isinstance(row, dict):
            raise ValueError(
                f"{path}:{number}: expected a JSON object, got a JSON {_json_type(row)}; write each row "
                f'as an object, e.g. {{"{prompt_key}": "a red circle"}}'
            )
        records.append(_record(row, prompt_key, path, number, "line", image_key))
    return records


def _load_parquet(path: Path, prompt_key: str, image_key: str | None) -> list[PromptRecord]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    try:
        with open_regular(path, "prompt file") as file:
            table = pq.read_table(file)
    except (pa.ArrowInvalid, OSError) as err:
        raise ValueError(f"{path}: not a readable parquet file ({err})") from None
    if table.num_rows == 0:
        return []  # reported as an empty file
    if prompt_key not in table.column_names:
        raise ValueError(
            f"{path}: no prompt column {prompt_key!r} (columns: {table.column_names}); "
            f"{_key_fix(prompt_key, table.column_names)}"
        )
    return [
        _record(row, prompt_key, path, number, "row", image_key)
        for number, row in enumerate(table.to_pylist(), start=1)
    ]


# ----------------------------------------------------------------------------------------- rows
def _record(
    row: dict[str, Any], prompt_key: str, path: Path, number: int, unit: str, image_key: str | None = None
) -> PromptRecord:
    where = f"{path}:{number}" if unit == "line" else f"{path} {unit} {number}"
    if prompt_key not in row:
        keys = list(row)
        raise ValueError(
            f"{where}: no prompt key {prompt_key!r} (the row has keys {keys}); "
            f"{_key_fix(prompt_key, keys)}, or add {prompt_key!r} to every row"
        )
    prompt = row[prompt_key]
    if not isinstance(prompt, str):
        got = "null" if prompt is None else f"{_json_type(prompt)} {_short(prompt)}"
        raise ValueError(f"{where}: the prompt {prompt_key!r} must be a string, got {got}")
    prompt = prompt.strip()
    if not prompt:
        raise ValueError(f"{where}: the prompt {prompt_key!r} is empty; give the row a prompt or remove it")
    _check_length(prompt, f"the prompt {prompt_key!r}", where)
    negative = row.get(NEGATIVE_PROMPT_KEY)
    if negative is not None and not isinstance(negative, str):
        raise ValueError(
            f"{where}: {NEGATIVE_PROMPT_KEY!r} must be a string or null, got {_json_type(negative)} {_short(negative)}"
        )
    if negative is not None:
        _check_length(negative, repr(NEGATIVE_PROMPT_KEY), where)
    images = _condition_images(row.get(image_key), path, where, image_key) if image_key is not None else ()
    metadata = {k: v for k, v in row.items() if k not in (prompt_key, NEGATIVE_PROMPT_KEY, image_key)}
    source = metadata.get(DATA_SOURCE_KEY)
    if source is None:  # absent, or a null cell of a parquet column
        metadata[DATA_SOURCE_KEY] = path.stem
    elif not isinstance(source, str) or not source:
        raise ValueError(
            f"{where}: {DATA_SOURCE_KEY!r} must be a non-empty string (it names validation metrics), "
            f"got {_short(source)}; leave it out to use the file name {path.stem!r}"
        )
    return PromptRecord(prompt, negative, metadata, f"{path}:{number}", images)


def _condition_images(value: Any, path: Path, where: str, key: str) -> tuple[ConditionImage, ...]:
    """The row's condition images: none when the field is absent or null (the model family's rule on
    the count reports a row that needs one), one, or a list (a JSON array or a parquet list column)."""
    if value is None:
        return ()
    values = value if isinstance(value, list | tuple) else [value]
    return tuple(
        read_condition_image(item, path.parent, f"{where} ({key}[{i}])" if len(values) > 1 else where, key)
        for i, item in enumerate(values)
    )


def _check_length(text: str, what: str, where: str) -> None:
    if len(text) > MAX_PROMPT_CHARS:
        raise ValueError(
            f"{where}: {what} has {len(text)} characters, more than the limit of {MAX_PROMPT_CHARS} "
            "(diffrl.data.prompts.MAX_PROMPT_CHARS; text encoders read a few hundred tokens): shorten it"
        )


def _key_fix(key: str, keys: Sequence[str]) -> str:
    """How to fix a missing prompt key: the likely intended key when there is one."""
    keys = [k for k in keys if isinstance(k, str)]
    matches = [k for k in keys if k.lower() == key.lower()]
    matches += [k for k in difflib.get_close_matches(key, keys, n=3, cutoff=0.6) if k not in matches]
    matches += [k for k in keys if k.lower() in _COMMON_PROMPT_KEYS and k not in matches]
    if not matches:
        return "set data.prompt_key to the key that holds the prompt"
    return f"did you mean {' or '.join(repr(k) for k in matches[:3])}? Then set data.prompt_key={matches[0]}"


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return names.get(type(value), type(value).__name__)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
