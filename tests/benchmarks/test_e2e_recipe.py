"""benchmarks/e2e_recipe.py end to end on the CPU (its `--tiny` smoke mode): a colocated count and a
separate split in one call give one JSON line with both runs and their scaling against the
colocated run, and the workers stay quiet as under `diffrl train` (the GPU runs' logs were full of
the workers' loading bars before the benchmarks quieted them)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What the workers printed in the GPU runs (diffusers' loading bars, Ray's token warning).
NOISE = ("Loading pipeline components", "Loading weights", "it/s]", "Token authentication is enabled")


def test_a_colocated_count_and_a_separate_split_in_one_quiet_call(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    env = {k: v for k, v in env.items() if not k.endswith("_VERBOSITY")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "e2e_recipe.py"), "--tiny", "--device", "cpu"]
    cmd += ["--recipe", "lean", "--warmup", "1", "--steps", "1", "--gpus", "1", "--splits", "1+1"]
    cmd += ["--out", str(tmp_path), "--set", "model.compile=false", "data.prompts_per_step=2"]
    cmd += ["actor.mini_batch_size=16"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])["lean"]
    runs, scaling = result["runs"], result["scaling"]
    assert set(runs) == {"1gpu", "1+1"}
    assert (runs["1gpu"]["gpus"], runs["1gpu"]["replicas"]) == (1, 0)
    assert (runs["1+1"]["gpus"], runs["1+1"]["replicas"]) == (2, 1)
    assert runs["1+1"]["strategy"] == "none"  # one trainer rank
    # every layout is compared with the colocated one, over all of its GPUs
    assert {s["base"] for s in scaling.values()} == {"1gpu"}
    assert scaling["1gpu"]["speedup"] == 1.0
    one, split = runs["1gpu"], runs["1+1"]
    expected = split["images_per_s_per_gpu"] * 2 / one["images_per_s_per_gpu"]
    assert abs(scaling["1+1"]["speedup"] - expected) < 1e-9
    noise = [n for n in NOISE if n in done.stdout + done.stderr]
    assert noise == [], done.stderr[-3000:]
