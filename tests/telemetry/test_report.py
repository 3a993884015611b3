"""The end-of-run report, from a hand-written metrics.jsonl and grids."""

import json

import numpy as np
import pytest
from PIL import Image

from diffrl.telemetry.plots import nice_ticks
from diffrl.telemetry.report import finished_run, smooth, validation_metrics, write_report


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
    assert curve.shape == (420, 800, 3)
    assert ((curve == (31, 119, 180)).all(axis=-1)).sum() > 50  # the smoothed train-reward line


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


# ------------------------------------------------------------------ captions and the category table
def _shapes_validation(seed: int, wrong: set[int]):
    """A small validation of the shapes world scored by the real `shapes` reward: rendered images,
    the ones in `wrong` drawn from a corrupted scene; returns prompts, sources, pixels, scores and
    the verifier's own verdicts."""
    import torch

    from diffrl.rewards.multi import MultiReward
    from diffrl.toy.grammar import parse_prompt
    from diffrl.toy.render import corrupt, render
    from diffrl.toy.verify import verify

    prompts = ["a square", "a square", "three circles", "three circles", "a blue square", "a red circle"]
    sources = ["single_object", "single_object", "counting", "counting", "colors", "colors"]
    rng = np.random.default_rng(seed)
    images = []
    for i, prompt in enumerate(prompts):
        scene = parse_prompt(prompt)
        drawn = corrupt(scene, rng) if i in wrong else scene
        images.append(render(drawn, 32, rng))
    verdicts = [
        bool(verify(image, parse_prompt(p)).correct) for image, p in zip(images, prompts, strict=True)
    ]
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()
    metadata = [{"scene": parse_prompt(p).to_dict()} for p in prompts]
    scores = MultiReward({"shapes": {}})(pixels, prompts, metadata)
    return prompts, sources, pixels, scores, verdicts


def test_sample_rows_and_captions_carry_the_verifiers_verdict():
    from diffrl.telemetry.validation_samples import grid_layout, sample_caption, validation_samples

    prompts, sources, _, scores, verdicts = _shapes_validation(0, wrong={1, 2, 5})
    assert verdicts == [True, False, False, True, True, False]  # the renderer and verifier agree
    rows = validation_samples(prompts, sources, scores.total_B, scores.extras)
    assert [r["correct"] for r in rows] == verdicts
    assert [r["prompt"] for r in rows] == prompts
    assert sample_caption(rows[0]) == "a square\npass"
    assert sample_caption(rows[2]) == "three circles\nfail"
    no_verdict = validation_samples(prompts[:1], sources[:1], scores.total_B[:1], {})
    assert sample_caption(no_verdict[0]) == f"a square\nreward {float(scores.total_B[0]):.2f}"
    # one grid row per category, distinct prompts before repeats, blanks filling each row
    layout = grid_layout(rows, columns=3)
    assert layout == [0, 1, None, 2, 3, None, 4, 5, None]


def test_validation_grid_draws_each_caption_under_its_enlarged_tile(tmp_path):
    from diffrl.telemetry.validation_samples import validation_grid, validation_samples

    prompts, sources, pixels, scores, _ = _shapes_validation(0, wrong={1, 2, 5})
    rows = validation_samples(prompts, sources, scores.total_B, scores.extras)
    grid = validation_grid(pixels, rows, tmp_path / "step_000000.jsonl")
    assert [json.loads(line) for line in (tmp_path / "step_000000.jsonl").read_text().splitlines()] == rows
    tile = 96  # 32² samples enlarged 3× by pixel repetition
    first = grid[2 : 2 + tile, 2 : 2 + tile]
    np.testing.assert_array_equal(first, pixels[0].permute(1, 2, 0).numpy().repeat(3, 0).repeat(3, 1))
    caption = grid[2 + tile : 2 + tile + 20, 2 : 2 + tile]
    assert (caption < 100).any() and (caption == 255).mean() > 0.5  # black text on a white strip
    assert grid.shape[1] == 2 + 8 * (tile + 2)  # 8 tiles a row: one row per category


def test_category_table_matches_the_verifier(tmp_path):
    from diffrl.telemetry.report import category_table
    from diffrl.telemetry.validation_samples import validation_samples

    prompts, sources, _, before_scores, before_v = _shapes_validation(0, wrong={1, 2, 3, 5})
    _, _, _, after_scores, after_v = _shapes_validation(0, wrong={2})
    before = validation_samples(prompts, sources, before_scores.total_B, before_scores.extras)
    after = validation_samples(prompts, sources, after_scores.total_B, after_scores.extras)
    table = category_table(before, after)
    for source in set(sources):
        index = [i for i, s in enumerate(sources) if s == source]
        b, a = np.array(before_v)[index].astype(float), np.array(after_v)[index].astype(float)
        entry = table["per_category"][source]
        assert entry["n"] == len(index)
        assert entry["before"] == pytest.approx(b.mean()) and entry["after"] == pytest.approx(a.mean())
        assert entry["change_se"] == pytest.approx(np.std(a - b, ddof=1) / np.sqrt(len(index)))
    means = [table["per_category"][s] for s in sorted(set(sources))]
    assert table["mean"]["after"] == pytest.approx(np.mean([e["after"] for e in means]))

    # the run's report prints the same table and records it in report.json
    run = tmp_path / "run"
    (run / "validation").mkdir(parents=True)
    lines = []
    for step, rows in ((0, before), (4, after)):
        (run / "validation" / f"step_{step:06d}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows)
        )
        per = {
            f"val/{s}/accuracy": table["per_category"][s]["before" if step == 0 else "after"]
            for s in set(sources)
        }
        lines.append(json.dumps({"step": step, "val/rewards/mean": 0.5, "rewards/mean": 0.5, **per}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    text = write_report(run)
    report = json.loads((run / "report.json").read_text())
    for source, entry in table["per_category"].items():
        assert report["per_category"][source] == pytest.approx(entry, nan_ok=True)
    counting = table["per_category"]["counting"]
    assert f"counting{counting['n']:>17}{counting['before']:>9.3f}{counting['after']:>9.3f}" in text


def test_smooth_is_a_trailing_mean():
    from diffrl.telemetry.report import smooth

    curve = {1: 0.0, 2: 1.0, 3: 0.5, 5: 1.0}
    assert smooth(curve, 2) == pytest.approx({1: 0.0, 2: 0.5, 3: 0.75, 5: 0.75})
    assert smooth(curve, 1) == curve


@pytest.mark.parametrize(
    "lo, hi, integer, expected",
    [
        (0.0, 1.0, False, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]),
        (-0.0469, 0.984, False, [-0.25, 0.0, 0.25, 0.5, 0.75, 1.0]),
        (0.4062, 0.4792, False, [0.4, 0.42, 0.44, 0.46, 0.48]),
        (0.0, 20.0, True, [0, 5, 10, 15, 20]),
        (1.0, 37.0, True, [0, 10, 20, 30, 40]),
        (1.0, 3.0, True, [1, 2, 3]),
        (0.5, 0.5, False, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]),
    ],
)
def test_nice_ticks_are_round_evenly_spaced_and_cover_the_data(lo, hi, integer, expected):
    ticks = nice_ticks(lo, hi, integer=integer)
    assert ticks == expected
    assert ticks[0] <= lo and ticks[-1] >= hi
    assert len(ticks) <= 6
    # labels print as the round numbers (no 0.30000000000000004)
    assert all(len(f"{t:g}") <= 5 for t in ticks)


def test_nice_ticks_refuses_an_empty_or_reversed_range():
    with pytest.raises(ValueError, match="lo <= hi"):
        nice_ticks(1.0, 0.0)
    with pytest.raises(ValueError, match="finite"):
        nice_ticks(0.0, float("nan"))


def test_validation_grid_shows_each_condition_image_left_of_its_result(tmp_path):
    from diffrl.telemetry.validation_samples import validation_grid, validation_samples

    prompts, sources, pixels, scores, _ = _shapes_validation(0, wrong=set())
    rows = validation_samples(prompts, sources, scores.total_B, scores.extras)
    conditions = 255 - pixels  # any images of the samples' shape
    grid = validation_grid(pixels, rows, conditions=conditions)
    tile = 96  # enlarged 3x, as without conditions: the tile is as high, and 2 x 32 + 2 wide
    first = grid[2 : 2 + tile, 2 : 2 + 3 * 66]
    np.testing.assert_array_equal(
        first[:, :tile], conditions[0].permute(1, 2, 0).numpy().repeat(3, 0).repeat(3, 1)
    )
    assert (first[:, tile : tile + 6] == 160).all()  # the grey bar
    np.testing.assert_array_equal(
        first[:, tile + 6 :], pixels[0].permute(1, 2, 0).numpy().repeat(3, 0).repeat(3, 1)
    )
    with pytest.raises(ValueError, match="must have the samples' shape"):
        validation_grid(pixels, rows, conditions=conditions[:, :, :16])


def test_reward_curve_series_draw_no_trend_between_two_validations_and_name_hidden_lines():
    """Issue 52 (re-walk 9): a line between two validations read as a trend, a validation line lay
    hidden under another with the same values, and a one-step run was labelled "mean of 3 steps"."""
    from diffrl.telemetry.report import reward_curve_series

    two = {
        0: {"val/rewards/mean": 0.4, "val/accuracy": 0.4},
        1: {"val/rewards/mean": 0.5, "val/accuracy": 0.5},
    }
    series = {label: (data, connect) for label, data, _, _, connect in reward_curve_series({1: 0.3}, two)}
    assert set(series) == {"rewards/mean", "val/rewards/mean", "val/accuracy (= val/rewards/mean)"}
    assert series["val/rewards/mean"] == ({0: 0.4, 1: 0.5}, False)  # two points, no line
    three = {**two, 2: {"val/rewards/mean": 0.6, "val/accuracy": 0.55}}
    curve = {s: 0.1 * s for s in range(1, 21)}
    series = {label: (data, connect) for label, data, _, _, connect in reward_curve_series(curve, three)}
    assert series["val/accuracy"][1] and series["val/rewards/mean"][1]  # three validations: lines
    assert series["rewards/mean, mean of 4 steps"][0] == smooth(curve, 4)
