"""benchmarks/e2e_recipe.py: its layouts and their scaling (a pure function of the runs' numbers),
and one real call on the CPU (its `--tiny` smoke mode) of a separate split, whose workers stay quiet
as under `diffrl train` (the GPU runs' logs were full of the workers' loading bars before the
benchmarks quieted them)."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import e2e_recipe  # noqa: E402

# What the workers printed in the GPU runs (diffusers' loading bars, Ray's token warning).
NOISE = ("Loading pipeline components", "Loading weights", "it/s]", "Token authentication is enabled")


def test_layouts_parse_and_bad_ones_say_what_is_expected():
    assert e2e_recipe.parse_layout("2") == (2, 0)
    assert e2e_recipe.parse_layout("3+1") == (3, 1)
    for bad in ("0", "1+x", "a", "0+2"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"T\+R|trainer rank"):
            e2e_recipe.parse_layout(bad)


def test_scaling_compares_every_layout_with_the_smallest_colocated_one_over_all_its_gpus():
    runs = {
        "1gpu": {"images_per_s_per_gpu": 2.0, "gpus": 1, "replicas": 0},
        "2gpu": {"images_per_s_per_gpu": 1.9, "gpus": 2, "replicas": 0},
        "1+1": {"images_per_s_per_gpu": 2.2, "gpus": 2, "replicas": 1},
        "3+1": {"error": "exit 1", "gpus": 4},
    }
    scaling = e2e_recipe._scaling(runs)["scaling"]
    assert set(scaling) == {"1gpu", "2gpu", "1+1"}  # a failed layout keeps its error, no numbers
    assert {s["base"] for s in scaling.values()} == {"1gpu"}
    assert scaling["2gpu"]["images_per_s"] == pytest.approx(3.8)
    assert scaling["2gpu"]["speedup"] == pytest.approx(1.9)
    assert scaling["1+1"]["speedup"] == pytest.approx(2.2)
    assert scaling["1+1"]["per_gpu_efficiency"] == pytest.approx(1.1)
    # without a colocated run the first split is the base
    only_split = e2e_recipe._scaling({"1+1": runs["1+1"]})["scaling"]
    assert only_split["1+1"]["base"] == "1+1" and only_split["1+1"]["speedup"] == 1.0


def test_a_separate_split_runs_quietly_and_reports_its_gpus(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    env = {k: v for k, v in env.items() if not k.endswith("_VERBOSITY")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "e2e_recipe.py"), "--tiny", "--device", "cpu"]
    cmd += ["--recipe", "lean", "--warmup", "1", "--steps", "1", "--splits", "1+1"]
    cmd += ["--out", str(tmp_path), "--set", "model.compile=false", "data.prompts_per_step=2"]
    cmd += ["actor.mini_batch_size=16"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(done.stdout.strip().splitlines()[-1])["lean"]
    assert (run["gpus"], run["replicas"], run["strategy"]) == (2, 1, "none")
    assert len(run["step_s_each"]) == 2 and run["images_per_s_per_gpu"] > 0
    noise = [n for n in NOISE if n in done.stdout + done.stderr]
    assert noise == [], done.stderr[-3000:]


def test_runs_report_the_sampler_trainer_log_prob_gap(tmp_path):
    from run_metrics import summarise_run

    step = {"timing_s/step": 2.0, "throughput/images_per_s_per_gpu": 4.0, "timing_s/gen": 1.0}
    gap = {"rollout_correction/abs_logp_diff_mean": 0.01, "rollout_correction/kl": 1e-4}
    lines = [step, {**step, **gap}, {**step, **gap, "rollout_correction/kl": 2e-4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    summary = summarise_run(tmp_path, warmup=1)
    assert summary["rollout_correction"] == {
        "abs_logp_diff_mean": [None, 0.01, 0.01],
        "kl": [None, 1e-4, 2e-4],
    }
    (tmp_path / "metrics.jsonl").write_text(json.dumps(step) + "\n" + json.dumps(step) + "\n")
    assert summarise_run(tmp_path, warmup=1)["rollout_correction"] == {}  # not recomputed: no gap logged
