"""benchmarks/shapes_algorithms.py: time to a target accuracy from a run's metrics (closed form on
hand-written records), the table, the options, and the script's main path on a tiny CPU run."""

import json
import math
import sys
from pathlib import Path

import pytest

from diffrl.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import shapes_algorithms as sa

STEP_S = {1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0, 5: 6.0, 6: 7.0}  # timing_s/step of each step
IMAGES_PER_S = {1: 10.0, 2: 20.0, 3: 30.0, 4: 40.0, 5: 50.0, 6: 60.0}
ACCURACY = {0: 0.5, 2: 0.7, 4: 0.92, 6: 0.95}  # validations before training and every 2 steps


def records():
    steps = {}
    for s in range(7):
        m = {"time": 1000.0 + s}
        if s:
            m |= {
                "timing_s/step": STEP_S[s],
                "throughput/images_per_s_per_gpu": IMAGES_PER_S[s],
                "timing_s/validation": 100.0,  # must not count as training time
                "rewards/mean": 0.1 * s,
            }
        if s in ACCURACY:
            m["val/accuracy"] = ACCURACY[s]
        steps[s] = m
    return steps


def test_time_to_target_is_the_training_time_of_the_first_validated_step_at_or_above_it():
    got = sa.curve_summary(records(), target=0.9)
    assert got["steps_to_target"] == 4
    assert got["train_s_to_target"] == pytest.approx(2 + 3 + 4 + 5)
    assert got["steps_run"] == 6 and got["train_s"] == pytest.approx(27.0)
    assert got["stopped_by"] == "steps"
    assert got["images_per_s_per_gpu"] == pytest.approx((20 + 30 + 40 + 50 + 60) / 5)  # step 1 left out
    assert (got["best_accuracy"], got["best_step"]) == (0.95, 6)
    assert (got["accuracy_before"], got["accuracy_after"]) == (0.5, 0.95)
    assert got["curve"] == [
        {"step": 0, "train_s": 0.0, "accuracy": 0.5},
        {"step": 2, "train_s": 5.0, "accuracy": 0.7},
        {"step": 4, "train_s": 14.0, "accuracy": 0.92},
        {"step": 6, "train_s": 27.0, "accuracy": 0.95},
    ]
    # The target is inclusive; one already met before training takes no training at all.
    assert sa.curve_summary(records(), target=0.92)["steps_to_target"] == 4
    assert sa.curve_summary(records(), target=0.5)["train_s_to_target"] == 0.0
    missed = sa.curve_summary(records(), target=0.96)
    assert missed["steps_to_target"] is None and missed["train_s_to_target"] is None


def test_a_budget_keeps_only_the_steps_finished_within_it():
    # Cumulative training seconds 2, 5, 9, 14, 20, 27: a 15 s budget ends after step 4.
    got = sa.curve_summary(records(), target=0.9, budget_s=15.0)
    assert (got["steps_run"], got["train_s"], got["stopped_by"]) == (4, 14.0, "budget")
    assert (got["steps_to_target"], got["train_s_to_target"]) == (4, 14.0)
    assert got["images_per_s_per_gpu"] == pytest.approx((20 + 30 + 40) / 3)
    assert [p["step"] for p in got["curve"]] == [0, 2, 4]
    assert (got["best_accuracy"], got["best_step"]) == (0.92, 4)
    # One second less and step 4 (with its 0.92) is past the budget.
    short = sa.curve_summary(records(), target=0.9, budget_s=13.0)
    assert (short["steps_run"], short["train_s"]) == (3, 9.0)
    assert short["steps_to_target"] is None and (short["best_accuracy"], short["best_step"]) == (0.7, 2)
    # A budget the run never reaches changes nothing.
    assert sa.curve_summary(records(), 0.9, budget_s=27.0) == sa.curve_summary(records(), 0.9)


def test_ties_nan_and_missing_accuracy():
    steps = records()
    steps[2]["val/accuracy"] = 0.95  # ties step 6: the first is the best step
    steps[4]["val/accuracy"] = math.nan  # a failed validation is no point of the curve
    got = sa.curve_summary(steps, target=0.9)
    assert (got["best_step"], got["steps_to_target"], got["train_s_to_target"]) == (2, 2, 5.0)
    assert [p["step"] for p in got["curve"]] == [0, 2, 6]
    # Runs logged before val/accuracy existed: it is the mean of the per-category accuracies.
    del steps[6]["val/accuracy"]
    steps[6] |= {"val/colors/accuracy": 1.0, "val/counting/accuracy": 0.5}
    assert sa.curve_summary(steps, target=0.9)["curve"][-1] == {"step": 6, "train_s": 27.0, "accuracy": 0.75}
    # Only one training step: no step after the warm-up to measure throughput on.
    assert sa.curve_summary({0: {}, 1: {"timing_s/step": 1.0}}, 0.9)["images_per_s_per_gpu"] is None


def test_bad_inputs_name_the_value():
    with pytest.raises(ValueError, match=r"target accuracy 1\.5"):
        sa.curve_summary(records(), target=1.5)
    with pytest.raises(ValueError, match="budget 0"):
        sa.curve_summary(records(), target=0.9, budget_s=0)
    steps = records()
    del steps[3]["timing_s/step"]
    with pytest.raises(ValueError, match="step 3 has no 'timing_s/step'"):
        sa.curve_summary(steps, target=0.9)


def test_the_train_split_validates_on_the_presets_training_prompts_and_heldout_keeps_its_file():
    for preset in ("shapes_flow_grpo", "shapes_nft"):  # one of each trainer type
        cfg = load_config(preset)
        train = load_config(preset, sa.validation_override("train", cfg.data.train_files))
        assert train.data.val_files == ["builtin:shapes_train.jsonl"] == cfg.data.train_files
        assert load_config(preset, sa.validation_override("heldout", cfg.data.train_files)) == cfg
    odd = ["/data/a, b.jsonl", "builtin:shapes_train.jsonl"]  # a comma and a space stay in one path
    assert load_config("default", sa.validation_override("train", odd)).data.val_files == odd


def test_options_and_overrides():
    args, overrides = sa.parse_args(["--steps", "3", "--", "actor.optim.lr=1e-4"])
    assert args.presets == [] and overrides == ["actor.optim.lr=1e-4"]
    assert (args.split, args.target, args.val_every, args.max_minutes) == ("train", 0.9, 5, None)
    for bad in (["--target", "90"], ["--max-minutes", "0"], ["--val-every", "0"], ["--", "default"]):
        with pytest.raises(SystemExit):
            sa.parse_args(bad)
    presets = sa.default_presets()
    assert "shapes_flow_grpo" in presets and "default" not in presets  # default is shapes_nft_cfg_free
    assert set(presets) == set(sa.ALGORITHMS)  # every RL preset named, no supervised one
    assert not set(sa.NOT_ALGORITHMS) & set(presets)


def result(preset, algorithm, steps_to_target, train_s_to_target, best, best_step):
    return {
        "preset": preset,
        "algorithm": algorithm,
        "loss": "flow_grpo",
        "split": "train",
        "target": 0.9,
        "budget_s": 600.0,
        "images_per_s_per_gpu": 812.4,
        "steps_to_target": steps_to_target,
        "train_s_to_target": train_s_to_target,
        "best_accuracy": best,
        "best_step": best_step,
        "steps_run": 60,
        "train_s": 131.6,
    }


def test_the_markdown_table_has_one_row_per_run():
    table = sa.markdown_table(
        [
            result("shapes_flow_grpo", "Flow-GRPO", 25, 54.4, 0.93, 40),
            result("shapes_awm", "AWM", None, None, 0.61, 35),
        ]
    )
    header, rule, *rows = table.strip().split("\n")
    assert header.count("|") == rule.count("|") == rows[0].count("|") == rows[1].count("|") == 8
    assert "steps to train accuracy 0.9" in header and "budget 600 s" in header
    assert rows == [
        "| Flow-GRPO (`shapes_flow_grpo`) | flow_grpo | 812.4 | 25 | 54 | 0.930 (40) | 60 (132) |",
        "| AWM (`shapes_awm`) | flow_grpo | 812.4 | not reached | — | 0.610 (35) | 60 (132) |",
    ]
    heldout = {**result("shapes_dpo", "DPO", 3, 1.0, 0.95, 3), "split": "heldout"}
    with pytest.raises(ValueError, match=r"different splits \['heldout', 'train'\]"):
        sa.markdown_table([result("shapes_flow_grpo", "Flow-GRPO", 25, 54.4, 0.93, 40), heldout])


def test_main_trains_the_flow_grpo_preset_and_reports_its_curve(tmp_path, monkeypatch, capsys):
    """The script's whole path on CPU: two tiny steps of `shapes_flow_grpo`, validated on a 2-prompt train file."""
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    builtin = Path(sa.__file__).resolve().parents[1] / "diffrl/config/presets/data/shapes_train.jsonl"
    train_file = tmp_path / "train.jsonl"
    rows = [json.loads(line) for line in builtin.read_text().splitlines()]
    # One easy and one hard category: a mean accuracy between 0 and 1 (position is near 0).
    picked = [next(r for r in rows if r["data_source"] == c) for c in ("colors", "position")]
    train_file.write_text("".join(json.dumps(r) + "\n" for r in picked))
    table, runs = tmp_path / "table.md", tmp_path / "runs.jsonl"
    tiny = [
        f"data.train_files=[{train_file}]",
        "data.prompts_per_step=2",
        "rollout.n=2",
        "rollout.micro_batch_size=4",
        "actor.mini_batch_size=4",
        "actor.micro_batch_size=4",
        "rollout.val.n=1",
    ]
    argv = ["shapes_flow_grpo", "--steps", "2", "--val-every", "1", "--target", "0", "--out", str(tmp_path)]
    (res,) = sa.main([*argv, "--table-out", str(table), "--json-out", str(runs), "--", *tiny])

    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert printed == [res] == [json.loads(line) for line in runs.read_text().splitlines()]
    assert (res["preset"], res["algorithm"], res["loss"], res["split"]) == (
        "shapes_flow_grpo",
        "Flow-GRPO",
        "flow_grpo",
        "train",
    )
    assert res["val_files"] == [str(train_file)]
    assert (res["steps_run"], res["stopped_by"], res["images_per_step"]) == (2, "steps", 4)
    # The file itself, read without the script: training seconds and accuracies per step.
    lines = [json.loads(line) for line in (Path(res["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    step_s = {r["step"]: r["timing_s/step"] for r in lines if "timing_s/step" in r}
    accuracy = {r["step"]: r["val/accuracy"] for r in lines if "val/accuracy" in r}
    assert sorted(accuracy) == [0, 1, 2] and sorted(step_s) == [1, 2]
    assert res["train_s"] == pytest.approx(step_s[1] + step_s[2], abs=0.01)
    assert res["accuracy_curve"] == [
        {"step": 0, "train_s": 0.0, "accuracy": round(accuracy[0], 4)},
        {"step": 1, "train_s": round(step_s[1], 2), "accuracy": round(accuracy[1], 4)},
        {"step": 2, "train_s": round(step_s[1] + step_s[2], 2), "accuracy": round(accuracy[2], 4)},
    ]
    assert (res["steps_to_target"], res["train_s_to_target"]) == (0, 0.0)  # target 0: met before training
    step2 = next(r for r in lines if r["step"] == 2)
    assert res["images_per_s_per_gpu"] == pytest.approx(step2["throughput/images_per_s_per_gpu"], abs=0.01)
    assert "| Flow-GRPO (`shapes_flow_grpo`) | flow_grpo |" in table.read_text()

    # The same run summarised again without training: the same result for the same target, and
    # a budget shorter than step 1 leaves only the validation before training.
    assert sa.main(["--from-json", str(runs), "--target", "0"]) == [res]
    (cut,) = sa.main(["--from-json", str(runs), "--target", "0", "--max-minutes", "1e-6"])
    assert (cut["steps_run"], cut["stopped_by"], cut["train_s"]) == (0, "budget", 0.0)
    assert cut["budget_s"] == pytest.approx(6e-5)
    assert cut["accuracy_curve"] == res["accuracy_curve"][:1] and cut["images_per_s_per_gpu"] is None
    assert {k: cut[k] for k in sa.RUN_KEYS} == {k: res[k] for k in sa.RUN_KEYS}


def test_from_json_needs_lines_of_its_own_json_out(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl: no such file"):
        sa.earlier_runs([str(tmp_path / "nope.jsonl")])
    other = tmp_path / "other.jsonl"
    other.write_text('{"preset": "default"}\n')
    with pytest.raises(ValueError, match=r"other.jsonl:1 lacks \['algorithm'"):
        sa.earlier_runs([str(other)])
    with pytest.raises(SystemExit):
        sa.parse_args(["default", "--from-json", str(other)])
