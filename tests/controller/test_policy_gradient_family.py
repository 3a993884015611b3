"""The Flow-GRPO family end to end: each variant runs two steps of `diffrl train` on the tiny SD3 on
CPU (real sampler, rewards, engine and loop) with finite metrics and its own diagnostics logged."""

import math

import pytest

from diffrl.controller.run import train
from diffrl.telemetry import read_metrics

FAST = [
    "trainer.total_steps=2",
    "trainer.save_freq=0",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
]

VARIANTS = {
    # recomputed old means and log-probs (the GRPO-Guard recipe's path)
    "grpo_guard": (
        ["actor.loss.mode=grpo_guard", "actor.loss.clip_ratio=2e-6", "algorithm.old_log_probs=recompute"],
        ["actor/ratio_mean_bias", "actor/sigma_t", "rollout_correction/abs_logp_diff_max"],
    ),
    # the rollout's own means as the old ones (reuse)
    "flow_dppo": (
        ["actor.loss.mode=flow_dppo", "actor.epochs=2"],
        ["actor/kl_new_old_mean", "actor/masked_fraction"],
    ),
    "mixgrpo": (
        [
            "rollout.sde.window_strategy=progressive",
            "rollout.sde.window_size=1",
            "rollout.sde.iters_per_group=1",
        ],
        ["actor/clipfrac"],
    ),
    "dancegrpo": (
        [
            "rollout.sde.type=dance_sde",
            "rollout.sde.window_size=null",
            "rollout.sde.window_range=null",
            "rollout.same_group_noise=true",
            "algorithm.timestep_fraction=0.5",
        ],
        ["actor/clipfrac"],
    ),
    "rollout_correction": (
        [
            "algorithm.old_log_probs=recompute",
            "algorithm.rollout_correction.is_level=sequence",
            "algorithm.rollout_correction.rejection=k3",
            "algorithm.rollout_correction.rejection_threshold=1.0",
        ],
        [
            "rollout_correction/rollout_is_mean",
            "rollout_correction/rollout_rs_masked_fraction",
            "rollout_correction/rollout_is_eff_sample_size",
            "rollout_correction/k3_kl",
        ],
    ),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_runs_two_steps(tmp_path, monkeypatch, name):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    overrides, expected = VARIANTS[name]
    run = train("tiny_sd3", [*FAST, f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}", *overrides])
    metrics = read_metrics(run / "metrics.jsonl")
    for step in (1, 2):
        for key in ("actor/loss", "actor/grad_norm", *expected):
            assert key in metrics[step], (name, step, key, sorted(metrics[step]))
            assert math.isfinite(metrics[step][key]), (name, step, key)
    if name == "rollout_correction":
        # same weights, same math: the recomputed log-probs match the sampler's, so nothing is
        # rejected and every importance weight is 1
        assert metrics[1]["rollout_correction/rollout_rs_masked_fraction"] == 0.0
        assert metrics[1]["rollout_correction/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
