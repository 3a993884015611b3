"""benchmarks/shapes_curves.py, shapes_groups.py and shapes_algorithms.py --split both: accuracy,
paired errors, peaks and falls against numpy on hand-written verdicts; group diversity and drift
against a brute-force loop; and the three scripts' path on a one-step CPU run, where the groups'
validation sampler must reproduce the run's own validation."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import shapes_algorithms as sa
import shapes_curves as sc
import shapes_groups as sg

from diffrl.toy.grammar import balanced_rows


def rows_of(verdicts_by_category, split="heldout"):
    """Validation rows of one split, `verdicts_by_category` {category: [0/1, ...]}, in index order."""
    rows = []
    for category, verdicts in verdicts_by_category.items():
        for v in verdicts:
            rows.append({"index": len(rows), "data_source": f"{split}_{category}", "correct": bool(v)})
    return rows


def test_accuracy_is_the_mean_over_categories_and_its_error_the_binomial_one_combined():
    cats = {"colors": [1, 1, 1, 0], "counting": [0, 0, 1, 0, 1, 0], "position": [0, 0]}
    acc, se = sc.accuracy_and_se(rows_of(cats), "heldout")
    means = [np.mean(v) for v in cats.values()]
    # the variance of a category's mean: its verdicts' sample variance (ddof 1) over their count
    var = sum(np.var(v, ddof=1) / len(v) for v in cats.values())
    assert acc == pytest.approx(np.mean(means))
    assert se == pytest.approx(math.sqrt(var) / 3)
    with pytest.raises(ValueError, match="no `train_<category>` samples"):
        sc.accuracy_and_se(rows_of(cats), "train")


def test_the_paired_error_is_that_of_the_per_sample_differences():
    a = {"colors": [1, 1, 0, 1, 0], "counting": [0, 1, 1, 0]}
    b = {"colors": [1, 0, 0, 1, 1], "counting": [0, 0, 0, 0]}
    diff, se = sc.paired_difference(rows_of(a), rows_of(b), "heldout")
    d = {c: np.array(b[c]) - np.array(a[c]) for c in a}
    assert diff == pytest.approx(np.mean([x.mean() for x in d.values()]))
    assert se == pytest.approx(math.sqrt(sum(x.var(ddof=1) / len(x) for x in d.values())) / 2)
    # Unpaired errors would be larger here: the two validations agree on most samples.
    assert se < math.hypot(
        sc.accuracy_and_se(rows_of(a), "heldout")[1], sc.accuracy_and_se(rows_of(b), "heldout")[1]
    )
    with pytest.raises(ValueError, match="different samples"):
        sc.paired_difference(rows_of(a), rows_of({"colors": [1], "counting": [0]}), "heldout")


def curve(per_step, n=40):
    """{step: rows}: one category, the first `k` of `n` samples correct at each step."""
    return {step: rows_of({"colors": [1] * k + [0] * (n - k)}) for step, k in per_step.items()}


def test_a_run_holds_unless_a_validation_after_the_peak_falls_more_than_two_paired_errors():
    # Peak 30/40 at step 20; step 40 loses 2 samples (z = -1.43), step 60 loses 10 (z = -3.6).
    summary = sc.split_summary(curve({0: 20, 20: 30, 40: 28, 60: 20}), "heldout")
    assert (summary["peak_step"], summary["peak"], summary["base"]) == (20, 0.75, 0.5)
    assert (summary["end_step"], summary["end"]) == (60, 0.5)
    d = np.array([0] * 20 + [-1] * 10 + [0] * 10)  # peak → step 60, per sample
    assert summary["end_minus_peak"] == pytest.approx(-0.25)
    assert summary["end_minus_peak_se"] == pytest.approx(round(d.std(ddof=1) / math.sqrt(40), 4))
    assert (summary["first_fall_step"], summary["holds"]) == (60, False)
    assert summary["worst_after_peak"]["step"] == 60
    assert summary["categories"] == {"colors": {"base": 0.5, "peak": 0.75, "end": 0.5}}
    held = sc.split_summary(curve({0: 20, 20: 30, 40: 28, 60: 29}), "heldout")
    assert (held["first_fall_step"], held["holds"]) == (None, True)
    # Ties: the first step of the best accuracy is the peak; an exact repeat is no fall.
    tie = sc.split_summary(curve({0: 20, 20: 30, 40: 30}), "heldout")
    assert (tie["peak_step"], tie["holds"], tie["worst_after_peak"]["change"]) == (20, True, 0.0)
    # A rising run's peak is its end: nothing after it to fall.
    rising = sc.split_summary(curve({0: 20, 20: 25, 40: 30}), "heldout")
    assert (rising["peak_step"], rising["worst_after_peak"], rising["holds"]) == (40, None, True)


def test_verdicts_are_read_in_index_order(tmp_path):
    (tmp_path / "validation").mkdir()
    rows = rows_of({"colors": [1, 0, 1]})
    lines = [json.dumps(r) for r in reversed(rows)]  # written out of order
    (tmp_path / "validation" / "step_000020.jsonl").write_text("\n".join(lines) + "\n")
    assert sc.verdicts(tmp_path) == {20: rows}
    with pytest.raises(FileNotFoundError, match="not a validated run"):
        sc.verdicts(tmp_path / "nope")


def test_training_metrics_clip_share_and_the_watchdogs_first_flags():
    metrics = {0: {"health/collapse": 0.0}}
    for s in range(1, 7):
        metrics[s] = {"rewards/mean": 0.1 * s, "actor/grad_norm": 0.5 * s, "health/collapse": float(s >= 5)}
    metrics[4]["health/reward_hacking"] = 1.0
    metrics[4]["health/val_drop_z"] = 3.0  # a z-score, not a signal
    got = sc.training_at(metrics, 4, window=2)
    assert got["reward"] == pytest.approx((0.3 + 0.4) / 2) and got["grad_norm"] == pytest.approx(1.75)
    assert got["kl"] is None  # not logged by this loss
    assert sc.training_at(metrics, 0, window=5)["reward"] == pytest.approx(0.1)  # before training: step 1
    assert sc.clip_share(metrics, 1.0) == round(4 / 6, 3)  # norms 1.5 ... 3.0 exceed 1.0
    assert sc.clip_share(metrics, 2.0) == round(2 / 6, 3)  # the run's own clip, not a fixed 1
    assert sc.clip_share(metrics, None) is None
    assert sc.health_first(metrics) == {"reward_hacking": 4, "collapse": 5}


def test_group_diversity_and_drift_against_a_loop():
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(2, 3, 3, 4, 4), dtype=np.uint8)  # G=2 groups of N=3
    got = sg.pairwise_diversity(torch.from_numpy(pixels))
    for g in range(2):
        x = pixels[g].reshape(3, -1).astype(np.float64) / 255
        pairs = [np.sqrt(np.mean((x[i] - x[j]) ** 2)) for i in range(3) for j in range(i + 1, 3)]
        assert float(got[g]) == pytest.approx(np.mean(pairs), rel=1e-5)
    same = torch.from_numpy(np.repeat(pixels[:, :1], 3, axis=1))
    assert torch.equal(sg.pairwise_diversity(same), torch.zeros(2))
    flat = torch.from_numpy(pixels.reshape(6, 3, 4, 4))
    base = torch.from_numpy(pixels[::-1].reshape(6, 3, 4, 4).copy())
    want = np.sqrt((((flat.double() - base.double()) / 255) ** 2).flatten(1).mean(1).numpy())
    assert sg.drift_from(flat, base).numpy() == pytest.approx(want, rel=1e-5)
    assert torch.equal(sg.drift_from(flat, flat), torch.zeros(6))
    with pytest.raises(ValueError, match="at least 2 samples"):
        sg.pairwise_diversity(torch.from_numpy(pixels[:, :1]))


def test_groups_steps_peak_and_last_name_checkpoints_at_or_before_them(tmp_path):
    for step in (10, 20, 30):
        (tmp_path / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step_{step:08d}" / "complete").write_text("")
    (tmp_path / "checkpoints" / "step_00000040").mkdir()  # no `complete`: a checkpoint cut short
    (tmp_path / "validation").mkdir()
    # held-out peaks at step 15, train at step 30
    for step, (train, held) in {0: (1, 1), 15: (2, 4), 30: (3, 2)}.items():
        rows = rows_of({"colors": [1] * train + [0] * (4 - train)}, "train")
        rows += [
            {**r, "index": r["index"] + 4}
            for r in rows_of({"colors": [1] * held + [0] * (4 - held)}, "heldout")
        ]
        (tmp_path / "validation" / f"step_{step:06d}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows)
        )
    ckpts = sg.checkpoint_steps(tmp_path)
    assert sorted(ckpts) == [10, 20, 30]
    assert sg.resolve_steps(tmp_path, ["0", "peak", "last"], ckpts) == [0, 10, 30]
    assert sg.resolve_steps(tmp_path, None, ckpts) == [0, 10, 20, 30]
    with pytest.raises(ValueError, match="'best'"):
        sg.resolve_steps(tmp_path, ["best"], ckpts)


def test_both_splits_file_and_its_curves(tmp_path):
    path = sa.write_both_splits(tmp_path / "both.jsonl", per_category=2)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    want = [
        {**r, "data_source": f"{s}_{r['data_source']}"}
        for s in ("train", "heldout")
        for r in balanced_rows(s, 2)
    ]
    assert rows == want and len(rows) == 24
    assert sa.write_both_splits(tmp_path / "both.jsonl", per_category=2).read_text() == path.read_text()
    val = {
        "val/train_colors/accuracy": 0.5,
        "val/train_counting/accuracy": 1.0,
        "val/heldout_colors/accuracy": 0.25,
    }
    val |= {"val/train_colors/reward_mean": 9.0, "val/accuracy": 0.6}  # neither is a split's accuracy
    assert sa.split_accuracy(val, "train") == pytest.approx(0.75)
    assert sa.split_accuracy(val, "heldout") == pytest.approx(0.25)
    assert sa.split_curves({0: val, 1: {"rewards/mean": 1.0}, 2: val}) == {
        "train": [{"step": 0, "accuracy": 0.75}, {"step": 2, "accuracy": 0.75}],
        "heldout": [{"step": 0, "accuracy": 0.25}, {"step": 2, "accuracy": 0.25}],
    }
    cfg_files = ["builtin:shapes_train.jsonl"]
    (override,) = sa.validation_override("both", cfg_files, str(tmp_path), 3)
    assert override == f"data.val_files={json.dumps([str(tmp_path / 'both_splits_3.jsonl')])}"
    with pytest.raises(SystemExit):
        sa.parse_args(["--split", "both", "--val-per-category", "0"])


def test_one_cpu_step_validated_on_both_splits_then_its_groups_and_curves(tmp_path, monkeypatch, capsys):
    """The tools' whole path: one tiny step of the default preset at a learning rate that changes the
    model, then the groups at the base and the checkpoint. The groups' validation sampler, given the
    run's rows and samples per row, must reproduce the run's own per-category validation accuracies
    (which shows that the checkpoint was loaded), and the curves must read the same accuracies."""
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    tiny = [
        "data.prompts_per_step=2",
        "rollout.n=4",
        "rollout.micro_batch_size=8",
        "actor.mini_batch_size=8",
        "actor.micro_batch_size=8",
        "rollout.val.n=2",
        "actor.optim.lr=1e-2",
    ]
    argv = ["default", "--steps", "1", "--val-every", "1", "--split", "both", "--val-per-category", "1"]
    (res,) = sa.main([*argv, "--out", str(tmp_path), "--", *tiny])
    run = Path(res["run_dir"])
    assert res["split"] == "both" and [p["step"] for p in res["split_curves"]["heldout"]] == [0, 1]

    groups = sg.main([str(run), "--steps", "0", "last", "--per-category", "1", "--n", "2"])
    assert [g["step"] for g in groups] == [0, 1]
    vals = sc.verdicts(run)
    for g in groups:
        for split in ("train", "heldout"):
            want = {c: float(np.mean(v)) for c, v in sc.by_category(vals[g["step"]], split).items()}
            assert g["validation"][split]["per_category"] == pytest.approx(want)
    assert groups[0]["validation"]["heldout"]["drift"] == 0.0
    assert groups[1]["validation"]["heldout"]["drift"] > 0.0  # the checkpoint samples other images
    assert (run / "groups" / "groups_step_000001.png").is_file()

    capsys.readouterr()
    (summary,) = sc.main([str(run), "--plot-dir", str(tmp_path / "plots"), "--out", str(tmp_path / "c.md")])
    for split in ("train", "heldout"):
        got = {s: v["accuracy"] for s, v in summary["splits"][split]["curve"].items()}
        assert got == {p["step"]: pytest.approx(p["accuracy"], abs=1e-4) for p in res["split_curves"][split]}
    assert summary["steps_run"] == 1 and summary["grad_clip"] == 1.0 and len(summary["groups"]) == 2
    assert (tmp_path / "plots" / "curves_heldout.png").is_file() and "| default |" in (
        tmp_path / "c.md"
    ).read_text()
