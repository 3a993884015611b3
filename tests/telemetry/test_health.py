"""The run-health watchdog on planted metric sequences: each signal flags when its condition holds,
warns once per onset, stops the run only when named in trainer.health.stop_on, and the recorded
collapse of the default recipe is flagged before its held-out accuracy lost a third of its gain."""

import math

import numpy as np
import pytest

from diffrl.config.sections.health import HealthConfig
from diffrl.telemetry.health import Watchdog, staleness_bound


def watchdog(**settings) -> Watchdog:
    return Watchdog(HealthConfig(**settings), staleness_bound=0)


def feed(dog: Watchdog, key: str, values) -> list[float | None]:
    """Steps 1.. with `key` set to each value; the signal's metric at each step (None: not logged)."""
    signal = {
        "actor/grad_norm": "nonfinite_grad",
        "rewards/zero_std_ratio": "zero_reward_spread",
        "actor/ratio_mean": "ratio_out_of_band",
        "async/staleness_max": "staleness",
    }[key]
    return [
        dog.observe_step(step, {key: value}).get(f"health/{signal}") for step, value in enumerate(values, 1)
    ]


def warnings(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: health:")]


def test_nonfinite_gradients_flag_every_such_step_and_warn_once_per_onset(capsys):
    dog = watchdog()
    flags = feed(dog, "actor/grad_norm", [0.5, math.nan, math.inf, 0.4, math.nan])
    assert flags == [0.0, 1.0, 1.0, 0.0, 1.0]
    assert [(o.signal, o.step) for o in dog.onsets] == [("nonfinite_grad", 2), ("nonfinite_grad", 5)]
    lines = warnings(capsys)
    assert len(lines) == 2 and "actor/grad_norm=nan" in lines[0] and "step 2" in lines[0]


def test_groups_without_reward_spread_flag_after_patience_steps(capsys):
    dog = watchdog(zero_spread_max=0.9, patience=3)
    flags = feed(dog, "rewards/zero_std_ratio", [1.0, 1.0, 1.0, 0.95, 0.5, 1.0, 1.0, 1.0])
    # three in a row at or above 0.9 flag the third; a step below resets the count
    assert flags == [0, 0, 1, 1, 0, 0, 0, 1]
    assert [o.step for o in dog.onsets] == [3, 8]
    assert len(warnings(capsys)) == 2


def test_importance_ratios_outside_the_band_flag_after_patience_steps():
    dog = watchdog(ratio_band=[0.9, 1.1], patience=2)
    flags = feed(dog, "actor/ratio_mean", [1.0, 1.3, 0.99, 1.3, 0.5, 0.6, 1.0])
    assert flags == [0, 0, 0, 0, 1, 1, 0]
    assert [o.step for o in dog.onsets] == [5]


@pytest.mark.parametrize(
    ("mode", "max_staleness", "health_bound", "bound"),
    [("sync", 2, None, 0), ("one_step_off", 2, None, 1), ("bounded", 3, None, 3), ("bounded", 3, 1, 1)],
)
def test_staleness_beyond_its_bound_flags(mode, max_staleness, health_bound, bound):
    health = HealthConfig(max_staleness=health_bound)
    assert staleness_bound(mode, max_staleness, health) == bound
    dog = Watchdog(health, staleness_bound=bound)
    assert feed(dog, "async/staleness_max", [bound, bound + 1, bound]) == [0, 1, 0]


def test_only_a_signal_in_stop_on_stops_the_run():
    dog = watchdog(stop_on=["zero_reward_spread"], patience=1)
    feed(dog, "actor/grad_norm", [math.nan])
    assert dog.stop_reason is None  # flagged and warned, not stopping
    feed(dog, "rewards/zero_std_ratio", [1.0])
    assert dog.stop_reason.startswith("zero_reward_spread (trainer.health.stop_on): step 1:")


# ---------------------------------------------------------------------------------- validations
#: The default recipe at GPU scale (issue 47, one H200, 512 images a step): held-out accuracy at
#: steps 0, 20, .., 120, and in a second run the train-split accuracy at steps 0..80. The held-out
#: validation is builtin:shapes_heldout_balanced_384.jsonl (64 prompts in each of 6 categories) x
#: rollout.val.n=4 = 1536 samples; the train-split run is taken to have as many.
HELDOUT = [0.414, 0.519, 0.486, 0.387, 0.305, 0.154, 0.119]
TRAIN_SPLIT = [0.657, 0.784, 0.725, 0.519, 0.490]
SAMPLES = 384 * 4
IMAGES_PER_STEP = 512


def bernoulli_se(accuracy: float, samples: int = SAMPLES) -> float:
    """The val/accuracy_se the validation reports for `samples` verdicts at `accuracy` when every
    category is at the same accuracy (the per-category accuracies were not recorded: categories
    that differ make the error smaller, so this is the least favourable case for the watchdog)."""
    return math.sqrt(accuracy * (1 - accuracy) / (samples - 1))


def replay(curve, train_reward, dog=None, every=20, samples=SAMPLES) -> tuple[Watchdog, dict[int, dict]]:
    """Steps 1..last of `train_reward(step)` as rewards/mean, and a validation every `every` steps
    (step 0 too) with the curve's accuracy and its standard error; returns the logged health metrics."""
    dog = dog or watchdog()
    logged = {}
    for step in range((len(curve) - 1) * every + 1):
        metrics = {} if step == 0 else dict(dog.observe_step(step, {"rewards/mean": train_reward(step)}))
        if step % every == 0:
            accuracy = curve[step // every]
            val = {"val/accuracy": accuracy, "val/accuracy_se": bernoulli_se(accuracy, samples)}
            metrics.update(dog.observe_validation(step, val))
        logged[step] = metrics
    return dog, logged


def recorded_train_reward(seed: int):
    """A training reward like the recorded run's: its train-split accuracy curve, linearly between
    the validations (flat after step 80), plus the binomial noise of a step's 512 verdicts. (The run's
    own rewards/mean was not recorded; the train split is what those rollouts were scored on.)"""
    rng = np.random.default_rng(seed)
    steps = [20 * i for i in range(len(TRAIN_SPLIT))]
    noise = rng.standard_normal(200)

    def reward(step: int) -> float:
        p = float(np.interp(step, steps, TRAIN_SPLIT))
        return p + noise[step] * math.sqrt(p * (1 - p) / IMAGES_PER_STEP)

    return reward


def rising_then_flat(step: int) -> float:
    """A training reward that rises, then holds, while validation falls; a small deterministic
    wiggle stands in for the step-to-step noise."""
    return 0.6 + 0.004 * min(step, 40) + 0.01 * math.sin(1.7 * step)


def first_onset(dog: Watchdog, *signals: str) -> int | None:
    return next((o.step for o in dog.onsets if o.signal in signals), None)


FALLS = ("reward_hacking", "collapse")


def test_the_arithmetic_of_the_recorded_collapse():
    """Held-out: the gain to the peak is 0.519 - 0.414 = 0.105, a third of it 0.035, so a third is
    lost below 0.519 - 0.035 = 0.484. Step 40 (0.486, 0.033 lost: 31% of the gain) has not lost a
    third; step 60 (0.387) has lost all of it and more. The fall at step 40 is
    (0.519 - 0.486) / sqrt(se(0.519)^2 + se(0.486)^2) = 0.033 / 0.0180 = 1.83 standard errors."""
    gain = HELDOUT[1] - HELDOUT[0]
    assert gain == pytest.approx(0.105) and HELDOUT[1] - gain / 3 == pytest.approx(0.484)
    assert HELDOUT[2] > HELDOUT[1] - gain / 3 > HELDOUT[3]
    z40 = (HELDOUT[1] - HELDOUT[2]) / math.hypot(bernoulli_se(HELDOUT[1]), bernoulli_se(HELDOUT[2]))
    assert z40 == pytest.approx(1.83, abs=0.005) and z40 >= HealthConfig().z


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_recorded_heldout_collapse_is_flagged_before_a_third_of_its_gain_is_lost(seed, capsys):
    """Flagged at step 40, the first validation after the peak (step 20) and the last before a
    third of the gain is gone (test_the_arithmetic_of_the_recorded_collapse): its 1.83-standard-
    error fall alone decides that. Whether the step-40 flag says reward_hacking or collapse depends
    on the training reward's noise (it fell 0.01-0.02 from its steps 11-20 to 31-40, 1-2 standard
    errors); by step 60 it fell ~0.19 (over 10 standard errors) and the flag is collapse."""
    dog, logged = replay(HELDOUT, recorded_train_reward(seed))
    assert first_onset(dog, *FALLS) == 40 < 60
    assert logged[20]["health/reward_hacking"] == logged[20]["health/collapse"] == 0.0  # the peak
    assert logged[40]["health/val_drop_z"] == pytest.approx(1.83, abs=0.005)
    assert logged[40]["health/reward_hacking"] + logged[40]["health/collapse"] == 1.0
    assert all(logged[step]["health/collapse"] == 1.0 for step in (60, 80, 100, 120))
    lines = warnings(capsys)
    assert (
        lines[0].startswith("warning: health: ")
        and "step 40: val/accuracy 0.486 is 1.8 standard errors" in lines[0]
    )
    assert "below its best 0.519 (step 20)" in lines[0]


def test_the_recorded_train_split_collapse_is_flagged_at_its_first_validation_after_the_peak():
    """Train split: peak 0.784 at step 20, a third of the gain (0.127) lost below 0.742; step 40
    (0.725) is past that already, so no validation every 20 steps can flag it before; it is flagged
    there, (0.784 - 0.725) / 0.0155 = 3.8 standard errors."""
    dog, logged = replay(TRAIN_SPLIT, recorded_train_reward(0))
    assert first_onset(dog, *FALLS) == 40
    z40 = (0.784 - 0.725) / math.hypot(bernoulli_se(0.784), bernoulli_se(0.725))
    assert logged[40]["health/val_drop_z"] == pytest.approx(z40) and z40 == pytest.approx(3.8, abs=0.05)


def test_a_fall_while_the_training_reward_rises_is_reward_hacking(capsys):
    dog, logged = replay(HELDOUT[:3], rising_then_flat)
    assert first_onset(dog, "reward_hacking") == 40 and "collapse" not in dog.first_onsets()
    assert logged[40]["health/reward_hacking"] == 1.0
    lines = warnings(capsys)
    assert len(lines) == 1 and "while the training reward did not fall" in lines[0]


def test_a_fall_with_a_falling_training_reward_is_a_collapse():
    dog, logged = replay(HELDOUT, lambda step: 0.7 - 0.004 * max(step - 20, 0) + 0.01 * math.sin(1.7 * step))
    assert first_onset(dog, "collapse") == 40
    assert "reward_hacking" not in dog.first_onsets()
    assert logged[60]["health/collapse"] == 1.0


def test_a_fall_within_the_validations_noise_is_not_flagged():
    # the same 0.033 drop from the peak, measured on 64 samples: a standard error of ~0.06
    dog, logged = replay(HELDOUT[:3], rising_then_flat, samples=64)
    assert dog.onsets == [] and logged[40]["health/reward_hacking"] == 0.0
    # and on 1536 samples, wiggles of about one standard error around a plateau
    dog, _ = replay([0.50, 0.52, 0.51, 0.505, 0.515, 0.50, 0.51], rising_then_flat)
    assert dog.onsets == []


def test_a_recovered_validation_ends_the_signal_and_a_new_fall_is_a_new_onset(capsys):
    dog, logged = replay([0.40, 0.52, 0.45, 0.52, 0.45], rising_then_flat)
    assert [logged[s]["health/reward_hacking"] for s in (40, 60, 80)] == [1.0, 0.0, 1.0]
    assert [o.step for o in dog.onsets] == [40, 80]
    assert len(warnings(capsys)) == 2


def test_without_a_training_reward_a_fall_is_a_collapse():
    """`diffrl sft` logs no rewards/mean: a falling validation is a collapse."""
    dog = watchdog()
    for step, accuracy in ((0, 0.5), (20, 0.6), (40, 0.4)):
        dog.observe_validation(step, {"val/accuracy": accuracy, "val/accuracy_se": 0.01})
    assert first_onset(dog, "collapse") == 40


def test_the_reward_mean_is_watched_without_an_accuracy_and_no_error_means_no_judgement():
    dog = watchdog()
    for step, reward in ((0, 0.5), (20, 0.2)):
        dog.observe_validation(step, {"val/rewards/mean": reward, "val/rewards/mean_se": 0.01})
    assert "collapse" in dog.first_onsets()
    dog = watchdog()
    for step, reward in ((0, 0.5), (20, 0.2)):
        assert dog.observe_validation(step, {"val/rewards/mean": reward}) == {}
    assert dog.onsets == []


def test_a_resumed_run_replays_its_history_quietly(capsys):
    """The state a resume rebuilds from metrics.jsonl: an onset before the resume does not warn or
    stop again; the best validation is remembered."""
    _, logged = replay(HELDOUT[:3], rising_then_flat)
    capsys.readouterr()
    history = {step: {"rewards/mean": rising_then_flat(step)} if step else {} for step in logged}
    for step in (0, 20, 40):
        accuracy = HELDOUT[step // 20]
        history[step].update({"val/accuracy": accuracy, "val/accuracy_se": bernoulli_se(accuracy)})
    resumed = watchdog(stop_on=["reward_hacking"])
    resumed.replay(history, up_to=40)
    assert resumed.best.step == 20 and resumed.active["reward_hacking"]
    assert warnings(capsys) == [] and resumed.stop_reason is None
    resumed.observe_validation(60, {"val/accuracy": 0.387, "val/accuracy_se": bernoulli_se(0.387)})
    assert resumed.stop_reason is None  # the same fall, still going on
    # a recovery, then a new fall: a new onset, which stops the resumed run
    for step in range(41, 101):
        resumed.observe_step(step, {"rewards/mean": rising_then_flat(step)})
    resumed.observe_validation(80, {"val/accuracy": 0.52, "val/accuracy_se": bernoulli_se(0.52)})
    resumed.observe_validation(100, {"val/accuracy": 0.45, "val/accuracy_se": bernoulli_se(0.45)})
    assert resumed.stop_reason.startswith("reward_hacking (trainer.health.stop_on): step 100:")


def test_the_replay_ignores_the_records_an_interrupted_start_logged_after_its_checkpoint():
    history = {
        0: {"val/accuracy": 0.5, "val/accuracy_se": 0.01},
        20: {"val/accuracy": 0.9, "val/accuracy_se": 0.01},
    }
    dog = watchdog()
    dog.replay(history, up_to=19)  # step 20 is logged again by the resumed run
    assert dog.best.step == 0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "trainer.health.stop_on=[colapse]",
            r"trainer.health.stop_on=\['colapse'\] is invalid: names 'colapse'",
        ),
        ("trainer.health.stop_on=[collapse,collapse]", "lists a signal twice"),
        ("trainer.health.ratio_band=[1.1,0.9]", r"ratio_band=\[1.1, 0.9\] is invalid: must be \[low, high\]"),
        ("trainer.health.zero_spread_max=0", "must be in \\(0, 1\\]"),
        ("trainer.health.z=0", "trainer.health.z=0.0 is invalid: must be > 0"),
        ("trainer.health.reward_window=1", "reward_window=1 is invalid: must be >= 2"),
        (
            "trainer.keep_best=true",
            "needs validations to choose the best checkpoint: set trainer.test_freq > 0",
        ),
        ("trainer.best_metric=accuracy", "must be auto or a validation metric"),
    ],
)
def test_bad_health_and_keep_best_settings_name_the_key_and_the_fix(override, message):
    from diffrl.config import ConfigError, load_config

    overrides = [override, "trainer.test_freq=0"] if "keep_best" in override else [override]
    with pytest.raises(ConfigError, match=message):
        load_config("tiny_sd3", overrides)
