"""The best validation's checkpoint, kept beside the newest ones (`trainer.keep_best`).

`RUN/checkpoints/best/` is a whole checkpoint (the format of `diffrl.train.checkpoint`) of the step
whose validation scored highest on trainer.best_metric so far; its extra.json says so:
`"best": {"metric": "val/accuracy", "score": 0.52, "step": 20}`. The retention rule
(trainer.keep_checkpoints) prunes only the `step_<N>` folders beside it, so it stays; and because
its parent is `checkpoints`, everything that takes RUN/checkpoints/step_N takes it too (`diffrl
export`, `diffrl eval`, `trainer.resume=PATH`).

A new best is written as any checkpoint is (into `.best-staging/step_<N>/`, renamed when whole by
`save_checkpoint`), then `publish_best` renames the previous best aside (`.best-replaced`), the new
one into place, and deletes the old. A crash between the two renames leaves the previous best whole
under `.best-replaced`, which `best_checkpoint` finds and the next publish replaces.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffrl.train.checkpoint_files import COMPLETE_MARKER

log = logging.getLogger(__name__)

BEST = "best"
_STAGING = ".best-staging"
_REPLACED = ".best-replaced"


@dataclass(frozen=True)
class BestRecord:
    """What a best checkpoint's extra.json says about itself."""

    metric: str
    score: float
    step: int


def best_checkpoint(checkpoints_root: str | Path) -> Path | None:
    """RUN/checkpoints/best when it is whole (its `complete` marker), else the previous best that a
    crashed publish left renamed aside, else None. Not verified here: loading it verifies it."""
    root = Path(checkpoints_root)
    for candidate in (root / BEST, root / _REPLACED):
        if (candidate / COMPLETE_MARKER).is_file():
            return candidate
    return None


def read_best(checkpoints_root: str | Path) -> BestRecord | None:
    """The record of the run's best checkpoint (None when there is none, or when its extra.json
    cannot be read: a warning says so, and the next validation's checkpoint replaces it)."""
    path = best_checkpoint(checkpoints_root)
    if path is None:
        return None
    try:
        best = json.loads((path / "extra.json").read_text())["best"]
        return BestRecord(str(best["metric"]), float(best["score"]), int(best["step"]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning(
            "the best checkpoint %s does not say its score (%s): the next validation replaces it", path, err
        )
        return None


def staging_root(checkpoints_root: str | Path) -> Path:
    """An empty folder for the workers to save the new best into (a crashed save's leftover removed)."""
    staging = Path(checkpoints_root) / _STAGING
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def publish_best(checkpoints_root: str | Path, staged: str | Path) -> Path:
    """Put the complete checkpoint `staged` (under `staging_root`) in place as RUN/checkpoints/best."""
    root, staged = Path(checkpoints_root), Path(staged)
    if not (staged / COMPLETE_MARKER).is_file():
        raise RuntimeError(f"{staged} is not a complete checkpoint: the best checkpoint was not replaced")
    best, aside = root / BEST, root / _REPLACED
    if (best / COMPLETE_MARKER).is_file() and aside.exists():
        shutil.rmtree(aside)  # the earlier publish had finished but for this deletion
    elif aside.exists() and best.exists():
        shutil.rmtree(best)  # not whole: a crash mid-publish; the whole one is `aside`
    if best.exists():
        best.rename(aside)
    staged.rename(best)
    _fsync_dir(root)
    shutil.rmtree(aside, ignore_errors=True)
    shutil.rmtree(root / _STAGING, ignore_errors=True)
    return best


def _fsync_dir(path: Path) -> None:
    """Make the renames in `path` durable (its directory entries)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BestTracker:
    """Which validation is the best so far on one metric (higher is better), resumed from the best
    checkpoint's own record; a record of another metric (trainer.best_metric changed) is replaced
    by the next validation."""

    def __init__(self, checkpoints_root: str | Path):
        self.root = Path(checkpoints_root)
        self.record = read_best(self.root)

    def beaten_by(self, metrics: Mapping[str, Any], metric: str) -> float | None:
        """`metrics[metric]` when this validation scores higher than the best so far, else None.
        A validation that lacks the metric is an error naming the ones it has."""
        if metric not in metrics:
            logged = sorted(k for k in metrics if k.startswith("val/") and not k.endswith("_se"))
            raise ValueError(
                f"trainer.best_metric={metric!r} is not a metric the validation logs; it logs "
                f"{', '.join(logged[:12])}{' ...' if len(logged) > 12 else ''}: set trainer.best_metric to one of "
                "them, or auto"
            )
        score = float(metrics[metric])
        if score != score:  # NaN: never the best
            return None
        if self.record is not None and self.record.metric == metric and score <= self.record.score:
            return None
        return score

    def kept(self, metric: str, score: float, step: int) -> None:
        self.record = BestRecord(metric, score, step)


__all__ = [
    "BEST",
    "BestRecord",
    "BestTracker",
    "best_checkpoint",
    "publish_best",
    "read_best",
    "staging_root",
]
