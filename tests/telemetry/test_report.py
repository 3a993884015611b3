"""The end-of-run report, from a hand-written metrics.jsonl and grids."""

import json

import numpy as np
import pytest
from PIL import Image

from diffrl.telemetry.report import validation_metrics, write_report


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
    assert "0.250 (step 0) → 0.750 (step 4)" in text
    pair = np.asarray(Image.open(tmp_path / "before_after.png"))
    # Before (black) on the left, after (white) on the right, same size.
    assert pair.shape[1] > 60 and pair[30, 15].max() == 0 and pair[30, -20].min() == 255
    curve = np.asarray(Image.open(tmp_path / "reward_curve.png").convert("RGB"))
    assert curve.shape == (400, 640, 3)
    assert ((curve == (31, 119, 180)).all(axis=-1)).sum() > 50  # the train-reward line is drawn
