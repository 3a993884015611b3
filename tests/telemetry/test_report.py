"""The end-of-run report, from a hand-written metrics.jsonl and grids."""

import json

import numpy as np
import pytest
from PIL import Image

from diffrl.telemetry.report import finished_run, validation_metrics, write_report


def test_validation_accuracy_is_the_mean_over_categories():
    metrics = {
        "val/rewards/mean": 0.5,
        "val/counting/accuracy": 0.2,
        "val/colors/accuracy": 0.8,
        "val/colors/reward_mean": 0.9,
        "rewards/mean": 0.1,
    }
    val = validation_metrics(metrics)
    assert val["val/accuracy"] == pytest.approx(0.5)
    assert "rewards/mean" not in val


def test_report_compares_first_and_last_validation_and_draws_both_pictures(tmp_path):
    rows = [{"step": 0, "val/rewards/mean": 0.25, "val/position/accuracy": 0.1}]
    rows += [{"step": s, "rewards/mean": 0.1 * s} for s in range(1, 5)]
    rows += [{"step": 4, "val/rewards/mean": 0.75, "val/position/accuracy": 0.6}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "validation").mkdir()
    for step, value in ((0, 0), (4, 255)):
        Image.fromarray(np.full((20, 30, 3), value, np.uint8)).save(
            tmp_path / "validation" / f"step_{step:06d}.png"
        )

    text = write_report(tmp_path)

    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["before_step"], report["after_step"]) == (0, 4)
    assert report["before"]["val/accuracy"] == pytest.approx(0.1)
    assert report["after"]["val/accuracy"] == pytest.approx(0.6)
    assert "val/rewards/mean: 0.25 (step 0) → 0.75 (step 4)" in text
    assert "val/accuracy: 0.1 (step 0) → 0.6 (step 4)" in text
    pair = np.asarray(Image.open(tmp_path / "before_after.png"))
    # Before (black) on the left, after (white) on the right, same size.
    assert pair.shape[1] > 60 and pair[30, 15].max() == 0 and pair[30, -20].min() == 255
    curve = np.asarray(Image.open(tmp_path / "reward_curve.png").convert("RGB"))
    assert curve.shape == (400, 640, 3)
    assert ((curve == (31, 119, 180)).all(axis=-1)).sum() > 50  # the train-reward line is drawn


def test_a_single_validation_is_reported_once_not_as_a_change(tmp_path):
    rows = [{"step": 1, "rewards/mean": 0.1}, {"step": 2, "rewards/mean": 0.2}]
    rows.append({"step": 2, "val/rewards/mean": 0.623, "val/a/accuracy": 0.5, "val/b/accuracy": 1.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = write_report(tmp_path)
    assert "val/rewards/mean: 0.623 (step 2, the only validation)" in text
    assert "val/accuracy: 0.75 (step 2, the only validation)" in text
    assert "→" not in text


def test_logged_accuracy_is_used_as_logged():
    # val/rewards/... never counts as a category, and a logged val/accuracy is not recomputed
    metrics = {"val/rewards/accuracy": 0.0, "val/a/accuracy": 0.5, "val/accuracy": 0.5}
    assert validation_metrics(metrics)["val/accuracy"] == 0.5
    assert validation_metrics({"val/rewards/accuracy": 0.0, "val/a/accuracy": 0.25})["val/accuracy"] == 0.25


def test_finished_run_is_recognised_from_its_summary(tmp_path):
    assert finished_run(tmp_path / "missing", 10) is None
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 10, "validation": {}}))
    message = finished_run(tmp_path, 10)
    assert message is not None and "already finished at step 10" in message and str(tmp_path) in message
    assert finished_run(tmp_path, 11) is None  # more steps asked for: the run continues
    (tmp_path / "summary.json").write_text("{not json")
    assert finished_run(tmp_path, 10) is None
