"""Tiny random models of every family, saved as complete diffusers directories, offline.

Tests and CPU demos load them through the same `from_pretrained` path as real checkpoints, so
the real loading code runs. Each family module defines `build_tiny(path, seed=0) -> Path`, which
writes a deterministic (from `seed`) pipeline directory: a few-layer transformer, a tiny VAE, tiny
text encoders and tokenizers built locally.
"""

from __future__ import annotations

import importlib
from pathlib import Path

TINY_BUILDERS: dict[str, str] = {
    "sd3": "diffrl.models.sd3",
    "flux": "diffrl.models.flux",
    "qwen_image": "diffrl.models.qwen_image",
    "wan": "diffrl.models.wan",
}


def build_tiny(family: str, path: str | Path, seed: int = 0) -> Path:
    """Write a tiny random `family` pipeline to `path` and return it."""
    if family not in TINY_BUILDERS:
        raise ValueError(f"unknown family {family!r}; tiny builders exist for {', '.join(TINY_BUILDERS)}")
    return importlib.import_module(TINY_BUILDERS[family]).build_tiny(Path(path), seed=seed)
