"""The `diffrl` command's console, end to end in subprocesses: the run directory first, no
third-party chatter by default (also from Ray worker processes), all of it with --verbose."""

import os
import subprocess
import sys

import pytest

# Seen on every run before the console was quieted (transformers, diffusers/tqdm, Ray).
NOISE = (
    "requires torchvision",
    "Loading pipeline components",
    "Loading weights",
    "Writing model shards",
    "it/s]",
    "Token authentication is enabled",
    "No LoRA keys associated",
)


def diffrl(*args, env):
    return subprocess.run(
        [sys.executable, "-m", "diffrl.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def noise_in(result) -> list[str]:
    text = result.stdout + result.stderr
    return [n for n in NOISE if n in text]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    quiet = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    quiet = {k: v for k, v in quiet.items() if not k.endswith("_VERBOSITY")}
    quiet["DIFFRL_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    quiet["OMP_NUM_THREADS"] = "1"
    return quiet


@pytest.fixture(scope="module")
def trained(tmp_path_factory, env):
    """A one-step run on two Ray workers (so the workers' own output is covered too)."""
    out = tmp_path_factory.mktemp("runs")
    args = [
        "train",
        "tiny_sd3",
        "trainer.total_steps=1",
        "trainer.save_freq=1",
        "trainer.test_freq=1",
        "trainer.val_before_train=false",
        "trainer.n_gpus_per_node=2",
        "actor.strategy=fsdp2",
        f"trainer.output_dir={out}",
        "trainer.run_name=quiet",
    ]
    return out / "quiet", args, diffrl(*args, env=env)


def test_train_names_its_run_directory_first_and_prints_no_third_party_noise(trained):
    run_dir, _, result = trained
    assert result.returncode == 0, result.stderr[-3000:]
    first, second, third = result.stdout.splitlines()[:3]
    # the run first says where to look, then its plan: how the workers share the model, ...
    assert first == f"run directory: {run_dir}"
    assert second.startswith("plan: colocated: 2 workers sample and train")
    assert third == "  parallelism: actor.strategy=fsdp2 (set by actor.strategy)"
    # the start-up check runs one worker's model in the driver: a 2-worker run leaves it to `diffrl check`
    assert "setup check skipped at start" in result.stdout
    assert noise_in(result) == [], (result.stdout, result.stderr)
    assert "val/rewards/mean" in result.stdout  # the run's own lines are there


def test_rerunning_a_finished_run_says_so_before_loading_anything(trained, env):
    run_dir, args, _ = trained
    again = diffrl(*args, env=env)
    assert again.returncode == 0, again.stderr
    assert f"run {run_dir} is already finished at step 1" in again.stdout
    assert "run directory:" not in again.stdout and "no steps logged" not in again.stdout


def test_verbose_shows_what_the_default_hides(trained, env, tmp_path):
    """Sampling with the run's exported LoRA: quiet by default, the libraries' output with --verbose."""
    run_dir, _, _ = trained
    args = ["sample", "--model", "tiny:sd3", "--prompt", "a cat"]
    if (run_dir / "export").is_dir():  # `diffrl train` exports the final LoRA there
        args += ["--lora", str(run_dir / "export")]
    args += ["--steps", "2", "--height", "32", "--width", "32", "--max-sequence-length", "16"]
    quiet = diffrl(*args, "--out", str(tmp_path / "q"), env=env)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert noise_in(quiet) == [], quiet.stderr
    verbose = diffrl("--verbose", *args, "--out", str(tmp_path / "v"), env=env)
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert noise_in(verbose), verbose.stderr  # e.g. diffusers' loading bar
