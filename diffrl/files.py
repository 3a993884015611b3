"""Small file helpers shared by the loops and the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> None:
    """Write `path` so that a crash or a power loss leaves the old file or the new one, never half
    or an empty one: a temporary file, flushed to the disk, renamed over `path`, and the rename
    itself made durable."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def umask_mode(path: Path) -> None:
    """Give `path` the mode a plain `open(path, "w")` would (0666 less the umask): some writers
    (safetensors through a temporary file) leave 0600, unreadable to the user's other accounts."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def write_json(path: Path, payload: dict) -> None:
    """`payload` as indented JSON, written atomically (`atomic_write_text`)."""
    atomic_write_text(path, json.dumps(payload, indent=2))
