"""Remembering a passed start-up check, so that the same setup is not checked twice.

`diffrl train`'s quick check (trainer.check_at_start) samples, scores and re-evaluates a few
trajectories on the run's own model: seconds on the toy model, up to a minute and a half on an
SD3.5-M recipe, where compiling the blocks dominates. A resumed run, or the same recipe started
again under another run name or for more steps, would pay that again for an answer it already has.

A passed check is recorded under a key made of everything its outcome can depend on: the resolved
config less the run's bookkeeping (`BOOKKEEPING`: its name, folder, length, logging, checkpoint
cadence), the files of the model directory and of the prompt files (path, size, modification
time), diffrl's own source files (size, modification time: an edited checkout re-checks), the
torch version and the device. Any other change runs the check again; a failed check is never
recorded. `diffrl check` always runs it. The records are small JSON files in
`$DIFFRL_CHECK_CACHE` (default `$DIFFRL_CACHE/checks`, i.e. ~/.cache/diffrl/checks); deleting one
makes the next start check again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from diffrl.config.schema import Config

# diffrl's own source: an edited checkout checks again
PACKAGE_DIR = Path(__file__).resolve().parents[1]

# trainer.* keys that change what the run records or how long it runs, not what the check measures
BOOKKEEPING = (
    "run_name",
    "output_dir",
    "resume",
    "total_steps",
    "save_freq",
    "test_freq",
    "val_before_train",
    "keep_checkpoints",
    "keep_best",
    "best_metric",
    "loggers",
    "project_name",
    "profile_steps",
    "check_at_start",
)


def cache_dir() -> Path:
    if folder := os.environ.get("DIFFRL_CHECK_CACHE"):
        return Path(folder)
    return Path(os.environ.get("DIFFRL_CACHE", Path.home() / ".cache" / "diffrl")) / "checks"


def _files(paths: Iterable[Path], pattern: str = "*") -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) of each file under `paths` matching `pattern`, sorted; a missing
    path is left out."""
    out = []
    for root in paths:
        root = Path(root)
        found = [root] if root.is_file() else sorted(p for p in root.rglob(pattern) if p.is_file())
        for path in found:
            stat = path.stat()
            out.append((str(path.resolve()), stat.st_size, stat.st_mtime_ns))
    return out


def check_key(cfg: Config, model_dir: Path, device: str) -> str:
    """The record's name: a digest of what a quick check's outcome depends on (module docstring)."""
    import torch
    from omegaconf import OmegaConf

    settings = OmegaConf.to_container(OmegaConf.structured(cfg))
    for key in BOOKKEEPING:
        settings["trainer"].pop(key, None)
    data = cfg.data
    prompt_files = [Path(p) for p in (*data.train_files, *data.val_files) if p]
    facts: dict[str, Any] = {
        "config": settings,
        "model": _files([model_dir]),
        "prompts": _files(prompt_files),
        "diffrl": _files([PACKAGE_DIR], "*.py"),  # not __pycache__: compiling is no change
        "torch": torch.__version__,
        "device": device,
    }
    blob = json.dumps(facts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def passed_before(key: str) -> dict | None:
    """The record of an earlier pass under `key`, or None (none, or unreadable: check again)."""
    try:
        record = json.loads((cache_dir() / f"{key}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("passed") is True else None


def remember_pass(key: str, checks: int, seconds: float) -> None:
    """Record a pass (atomically: written beside and renamed). A cache that cannot be written
    costs the next start a check, nothing else, so an error here is not the run's."""
    folder = cache_dir()
    record = {
        "passed": True,
        "checks": checks,
        "seconds": round(seconds, 1),
        "at": time.strftime("%Y-%m-%d %H:%M"),
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
        staging = folder / f".{key}.{os.getpid()}.tmp"
        staging.write_text(json.dumps(record) + "\n", encoding="utf-8")
        staging.replace(folder / f"{key}.json")
    except OSError:
        pass
