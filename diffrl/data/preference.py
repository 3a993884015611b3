"""Preference datasets for offline Diffusion-DPO, and the on-disk cache of their encodings.

A row is a prompt and two image files, the preferred ("chosen") and the dispreferred
("rejected") one, in the columns `data.chosen_key` / `data.rejected_key` of a .jsonl or .parquet
prompt file (every non-prompt column is the record's metadata):

    {"prompt": "a red cube", "chosen": "images/0001_a.png", "rejected": "images/0001_b.png"}

Relative paths are relative to the data file. `check_pairs` runs in the preflight, before any
model starts: a missing column or file, or an image of the wrong size, names the row and the column.

The trainer encodes every image once (VAE, or nothing in pixel space) and every prompt once, and
keeps the result in `<run dir>/preference_cache/encodings.safetensors` with a fingerprint of what
it was computed from (`encodings_fingerprint`): a resumed run with the same data, model and image
size loads it instead of encoding again; any change recomputes it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from diffrl.data.images import open_image
from diffrl.data.prompts import PromptRecord

CACHE_DIR = "preference_cache"
CACHE_FILE = "encodings.safetensors"
_FINGERPRINT_KEY = "fingerprint"


def pair_paths(record: PromptRecord, chosen_key: str, rejected_key: str) -> tuple[Path, Path]:
    """The row's (chosen, rejected) image paths; relative paths are relative to the row's data file."""
    paths = []
    for key, setting in ((chosen_key, "data.chosen_key"), (rejected_key, "data.rejected_key")):
        if key not in record.metadata:
            raise ValueError(
                f"{record.source}: the row has no {key!r} column ({setting}); its columns are "
                f"{sorted(record.metadata)}. Preference rows need a prompt and two image files: set "
                f"{setting} to the column that holds the image"
            )
        path = Path(str(record.metadata[key]))
        if not path.is_absolute():
            path = Path(record.source.rsplit(":", 1)[0]).parent / path
        paths.append(path)
    return paths[0], paths[1]


def check_pairs(
    records: Sequence[PromptRecord], chosen_key: str, rejected_key: str, height: int, width: int
) -> list[tuple[Path, Path]]:
    """Every row's (chosen, rejected) paths, checked to exist and be height x width (headers only)."""
    pairs = []
    for record in records:
        pair = pair_paths(record, chosen_key, rejected_key)
        for path, key in zip(pair, (chosen_key, rejected_key), strict=True):
            if not path.exists():
                raise FileNotFoundError(
                    f"{record.source}: column {key!r}: image {path} not found (relative paths are "
                    "relative to the data file)"
                )
            with open_image(path, f"{record.source}: column {key!r}:") as image:
                if image.size != (width, height):
                    raise ValueError(
                        f"{record.source}: column {key!r}: {path} is {image.size[0]}x{image.size[1]} but "
                        f"training runs at {width}x{height} (rollout.pipeline.width x height): resize "
                        "the dataset's images, or change the size"
                    )
        pairs.append(pair)
    return pairs


def encodings_fingerprint(pairs: Sequence[tuple[Path, Path]], prompts: Sequence[str], **settings) -> str:
    """A digest of what the encodings depend on: every image's path, size in bytes and modification
    time, the prompts, and `settings` (model path, dtype, image size, text length)."""
    digest = hashlib.sha256()
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    for pair in pairs:
        for path in pair:
            stat = path.stat()
            digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    for prompt in prompts:
        digest.update(prompt.encode() + b"\0")
    return digest.hexdigest()


def save_encodings(path: Path, tensors: dict[str, torch.Tensor], fingerprint: str) -> None:
    """Write the cache atomically: a crash never leaves a half-written file that looks valid."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(
        {k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp), {_FINGERPRINT_KEY: fingerprint}
    )
    tmp.replace(path)


def load_encodings(path: Path, fingerprint: str) -> dict[str, torch.Tensor] | None:
    """The cached tensors, or None when there is no cache or it was computed from something else."""
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        if (f.metadata() or {}).get(_FINGERPRINT_KEY) != fingerprint:
            return None
    return load_file(str(path))


__all__ = [
    "CACHE_DIR",
    "CACHE_FILE",
    "check_pairs",
    "encodings_fingerprint",
    "load_encodings",
    "pair_paths",
    "save_encodings",
]
