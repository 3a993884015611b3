"""actor.replay_steps_per_forward (batched replay, diffrl.train.replay): its range, where it applies,
and that it recomputes the old log-probs instead of reusing the sampler's."""

import pytest

from diffrl.config import ConfigError, load_config


def test_batched_replay_is_off_by_default_and_recomputes_the_old_log_probs_when_on():
    default = load_config("tiny_sd3")
    assert default.actor.replay_steps_per_forward == 1
    assert default.reuses_rollout_log_probs  # colocated, eager: the sampler's own log-probs
    batched = load_config("tiny_sd3", ["actor.replay_steps_per_forward=2"])
    assert batched.actor.replay_steps_per_forward == 2
    assert not batched.reuses_rollout_log_probs
    recompute = ["actor.replay_steps_per_forward=2", "algorithm.old_log_probs=recompute"]
    assert not load_config("tiny_sd3", recompute).reuses_rollout_log_probs


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["actor.replay_steps_per_forward=0"],
            r"actor\.replay_steps_per_forward=0 is invalid: must be >= 1",
        ),
        (
            ["actor.replay_steps_per_forward=3"],  # tiny_sd3 trains a window of 2 steps
            r"actor\.replay_steps_per_forward=3 is invalid: must be <= the 2 trained window steps of a "
            r"micro-batch \(rollout\.sde\.window_size\): set it to 2",
        ),
        (
            ["actor.replay_steps_per_forward=2", "algorithm.old_log_probs=rollout"],
            r"algorithm\.old_log_probs='rollout' is invalid: cannot reuse the sampler's log-probs with "
            r"actor\.replay_steps_per_forward=2.*Set algorithm\.old_log_probs=auto.*or "
            r"actor\.replay_steps_per_forward=1",
        ),
    ],
    ids=["zero", "above_the_window", "reused_log_probs"],
)
def test_batched_replay_settings_are_checked_naming_the_value_and_the_fix(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config("tiny_sd3", overrides)


def test_batched_replay_is_refused_for_losses_on_clean_samples():
    with pytest.raises(
        ConfigError,
        match=r"actor\.replay_steps_per_forward=2 is invalid: batches the SDE window steps of the "
        r"policy-gradient losses, but actor\.loss\.mode=diffusion_nft .*trains on clean samples: leave it at 1",
    ):
        load_config("shapes_nft", ["actor.replay_steps_per_forward=2"])
