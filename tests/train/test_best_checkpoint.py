"""RUN/checkpoints/best: published atomically, never pruned by the retention of step checkpoints,
found again after a crash between its two renames, and its score remembered across starts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffrl.train.best_checkpoint import (
    BEST,
    BestTracker,
    best_checkpoint,
    publish_best,
    read_best,
    staging_root,
)
from diffrl.train.checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint


def _model(value: float) -> nn.Module:
    model = nn.Linear(2, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _save(root, step, value, *, best=None, keep_last=2):
    extra = {"step": step, "data": {"epoch": 0, "position": 0, "num_records": 4}}  # a sampler position
    if best is not None:
        extra["best"] = {"metric": "val/accuracy", "score": best, "step": step}
    return save_checkpoint(
        root,
        step,
        model=_model(value),
        optimizer=None,
        scheduler=None,
        trainable_only=False,
        extra=extra,
        keep_last=keep_last,
    )


def _keep_best(root, step, value, score):
    """What the loop does for a new best: save into the staging root, then publish."""
    staged = _save(staging_root(root), step, value, best=score, keep_last=1)
    return publish_best(root, staged)


def _weight(path) -> float:
    model = _model(0.0)
    load_checkpoint(
        path, model=model, optimizer=None, scheduler=None, trainable_only=False, restore_rng=False
    )
    return float(model.weight[0, 0].detach())


def test_the_best_survives_the_retention_of_step_checkpoints_and_is_replaced_whole(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 1, 1.0)
    best = _keep_best(root, 2, 2.0, 0.6)
    for step in (3, 4, 5, 6):  # keep_last=2 prunes every step folder but the two newest
        _save(root, step, float(step))
    assert sorted(p.name for p in root.iterdir()) == [BEST, "step_00000005", "step_00000006"]
    assert best == root / BEST and verify_checkpoint(best)["step"] == 2 and _weight(best) == 2.0
    assert read_best(root).step == 2 and read_best(root).score == 0.6

    _keep_best(root, 5, 5.0, 0.7)
    assert sorted(p.name for p in root.iterdir()) == [BEST, "step_00000005", "step_00000006"]
    assert _weight(root / BEST) == 5.0 and read_best(root).step == 5


def test_a_crash_between_the_renames_leaves_the_previous_best_found_and_the_next_publish_clean(tmp_path):
    root = tmp_path / "checkpoints"
    _keep_best(root, 2, 2.0, 0.6)
    (root / BEST).rename(root / ".best-replaced")  # the crash: old best aside, new one not in place
    assert best_checkpoint(root) == root / ".best-replaced" and read_best(root).step == 2
    _keep_best(root, 4, 4.0, 0.7)
    assert sorted(p.name for p in root.iterdir()) == [BEST]
    assert _weight(root / BEST) == 4.0


def test_an_incomplete_staged_checkpoint_never_replaces_the_best(tmp_path):
    root = tmp_path / "checkpoints"
    _keep_best(root, 2, 2.0, 0.6)
    half = staging_root(root) / "step_00000004"
    half.mkdir()
    with pytest.raises(RuntimeError, match="not a complete checkpoint"):
        publish_best(root, half)
    assert _weight(root / BEST) == 2.0


def test_the_tracker_resumes_the_best_score_and_keeps_only_strictly_better(tmp_path):
    root = tmp_path / "checkpoints"
    assert BestTracker(root).beaten_by({"val/accuracy": 0.1}, "val/accuracy") == 0.1  # nothing kept yet
    _keep_best(root, 2, 2.0, 0.6)
    tracker = BestTracker(root)  # a new start of the run
    assert tracker.beaten_by({"val/accuracy": 0.6}, "val/accuracy") is None
    assert tracker.beaten_by({"val/accuracy": float("nan")}, "val/accuracy") is None
    assert tracker.beaten_by({"val/accuracy": 0.61}, "val/accuracy") == 0.61
    # another metric than the kept one's: its score is not comparable, the next validation wins
    assert tracker.beaten_by({"val/rewards/mean": -5.0}, "val/rewards/mean") == -5.0
    with pytest.raises(ValueError, match=r"trainer.best_metric='val/acc'.*val/accuracy"):
        tracker.beaten_by({"val/accuracy": 0.7, "val/accuracy_se": 0.01}, "val/acc")
