"""`trainer.health.*`: the run-health watchdog's thresholds, and which of its signals stop the run.

The watchdog itself is `diffrl.telemetry.health`; its signals are named here so that the config can
check `stop_on` without importing what it configures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diffrl.config.checks import require, require_at_least

#: Every signal the watchdog reports, each logged as `health/<signal>` (docs/metrics.md).
HEALTH_SIGNALS = (
    "nonfinite_grad",  # the step's loss or gradient norm is inf/nan (its update was skipped)
    "zero_reward_spread",  # most prompt groups' rewards are all equal: their advantages are zero
    "ratio_out_of_band",  # the mean importance ratio p_θ / p_old left ratio_band
    "staleness",  # trajectories older than the staleness bound were trained on
    "reward_hacking",  # validation fell significantly below its best while the training reward held
    "collapse",  # validation fell significantly below its best and the training reward fell too
)


@dataclass
class HealthConfig:
    # signals that stop the run (checkpoint saved, one-line reason, exit status 3); any of HEALTH_SIGNALS
    stop_on: list[str] = field(default_factory=list)
    # zero_reward_spread: the fraction of prompt groups with no reward spread at or above which it flags
    zero_spread_max: float = 0.9
    # ratio_out_of_band: [low, high] the step's mean importance ratio (actor/ratio_mean) stays within
    ratio_band: list[float] = field(default_factory=lambda: [0.9, 1.1])
    # zero_reward_spread and ratio_out_of_band flag after this many steps in a row
    patience: int = 3
    # staleness: the most weight versions a trained trajectory may lag; null = the async mode's own
    # bound (sync 0, one_step_off 1, bounded trainer.max_staleness)
    max_staleness: int | None = None
    # reward_hacking / collapse: a drop of at least this many standard errors below the best
    # validation is a fall (1.645: one-sided 95%), and the same for the training reward's trend
    z: float = 1.645
    # the training steps averaged on each side when the training reward's trend is judged
    reward_window: int = 10

    def validate(self, at: str) -> None:
        for signal in self.stop_on:
            require(
                signal in HEALTH_SIGNALS,
                f"{at}.stop_on",
                list(self.stop_on),
                f"names {signal!r}; the signals are {', '.join(HEALTH_SIGNALS)} "
                f"(e.g. {at}.stop_on=[collapse,nonfinite_grad])",
            )
        require(
            len(set(self.stop_on)) == len(self.stop_on),
            f"{at}.stop_on",
            list(self.stop_on),
            "lists a signal twice: name each once",
        )
        require(
            0.0 < self.zero_spread_max <= 1.0,
            f"{at}.zero_spread_max",
            self.zero_spread_max,
            "must be in (0, 1]: the fraction of prompt groups whose rewards are all equal",
        )
        require(
            len(self.ratio_band) == 2 and 0.0 < self.ratio_band[0] < 1.0 < self.ratio_band[1],
            f"{at}.ratio_band",
            list(self.ratio_band),
            "must be [low, high] with 0 < low < 1 < high (bounds of the mean importance ratio, "
            "which is 1 for an unchanged policy), e.g. [0.9, 1.1]",
        )
        require_at_least(f"{at}.patience", self.patience, 1)
        if self.max_staleness is not None:
            require_at_least(f"{at}.max_staleness", self.max_staleness, 0)
        require(
            self.z > 0,
            f"{at}.z",
            self.z,
            "must be > 0 (standard errors; 1.645 is a one-sided 95% test, 2.33 a 99% one)",
        )
        require_at_least(f"{at}.reward_window", self.reward_window, 2)
