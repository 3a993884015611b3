"""The run-health watchdog: signals that a run is going wrong, read from the metrics it logs.

The training loop hands it each step's metrics (`observe_step`) and each validation's
(`observe_validation`); it returns `health/<signal>` metrics (1 while the signal holds, else 0;
logged only where the step measured what the signal reads) and prints a warning when a signal
starts to hold (once per onset, not every step). The signals (`HEALTH_SIGNALS`,
trainer.health.* sets their thresholds):

    nonfinite_grad       the step's loss, gradient norm, rewards or advantages are inf/nan
                         (the engine skipped its optimizer step)
    zero_reward_spread   rewards/zero_std_ratio >= zero_spread_max for `patience` steps in a row:
                         most prompt groups tie, so their advantages are zero and they teach nothing
    ratio_out_of_band    actor/ratio_mean outside ratio_band for `patience` steps in a row: the
                         policy has moved far from the one its samples came from
    staleness            async/staleness_max above the bound (the async mode's own unless
                         max_staleness sets one)
    reward_hacking       the validation score fell significantly below its best while the
                         training reward did not fall
    collapse             the validation score fell significantly below its best and the training
                         reward fell too, or there is none to judge by (`diffrl sft` logs none;
                         fewer than 3 training steps around the best validation)

The validation score is `val/accuracy` when the validation logs it, else `val/rewards/mean`, with
its standard error (`<score>_se`, diffrl.controller.validation.standard_errors). "Significantly
below its best" is a one-sided test against the best validation so far:

    z_val = (best - now) / sqrt(se_best^2 + se_now^2) >= z          (logged as health/val_drop_z)

and the training reward falls when the mean `rewards/mean` of the steps since the best validation
(at most `reward_window` of them, the newest) is below the mean of the `reward_window` steps up to
that validation (after it, when it was the base model's at step 0) by at least z pooled standard
errors of the step-to-step spread.

A signal named in trainer.health.stop_on sets `stop_reason` at its onset; the loop then saves a
checkpoint, exports what it has and exits with status 3 (`HealthStop`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diffrl.config.sections.health import HEALTH_SIGNALS, HealthConfig

#: What a step's update depends on, in the order data flows: the first non-finite one is named.
NONFINITE_WATCHED = ("rewards/mean", "advantages/mean", "actor/loss", "actor/grad_norm")
TRAIN_REWARD = "rewards/mean"


class HealthStop(Exception):
    """A signal of trainer.health.stop_on started: the run stopped itself, its checkpoint saved.

    Not a ValueError (the configuration is fine): `diffrl train` exits with `EXIT_STATUS`."""

    EXIT_STATUS = 3


@dataclass(frozen=True)
class Onset:
    """A signal that started to hold at `step`, with the warning it printed."""

    signal: str
    step: int
    message: str


@dataclass(frozen=True)
class _Validation:
    step: int
    score: float
    se: float


def staleness_bound(async_mode: str, max_staleness: int, health: HealthConfig) -> int:
    """The most weight versions a trained trajectory may lag: trainer.health.max_staleness, else the
    async mode's own bound (sync 0, one_step_off 1, bounded trainer.max_staleness)."""
    if health.max_staleness is not None:
        return health.max_staleness
    return {"sync": 0, "one_step_off": 1}.get(async_mode, max_staleness)


def validation_score_key(metrics: Mapping[str, Any]) -> str:
    """The validation score the watchdog (and trainer.best_metric=auto) watches in `metrics`."""
    return "val/accuracy" if "val/accuracy" in metrics else "val/rewards/mean"


class Watchdog:
    """See the module docstring. `quiet` (a resume's replay of the logged history) prints nothing
    and stops nothing; the state it builds is the same."""

    def __init__(self, cfg: HealthConfig, *, staleness_bound: int):
        self.cfg = cfg
        self.staleness_bound = staleness_bound
        self.active = dict.fromkeys(HEALTH_SIGNALS, False)
        self.streaks = dict.fromkeys(HEALTH_SIGNALS, 0)
        self.train_rewards: dict[int, float] = {}  # step -> rewards/mean, finite ones
        self.best: _Validation | None = None
        self.onsets: list[Onset] = []
        self.stop_reason: str | None = None
        self.quiet = False

    # ------------------------------------------------------------------------------ training steps
    def observe_step(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """The training-step signals of one step's metrics; returns their `health/...` values."""
        out: dict[str, float] = {}
        bad = [(k, metrics[k]) for k in NONFINITE_WATCHED if k in metrics and not _finite(metrics[k])]
        if any(k in metrics for k in NONFINITE_WATCHED):
            message = None
            if bad:
                key, value = bad[0]
                others = [k for k, _ in bad[1:]]
                message = (
                    f"step {step}: {key}={value} is not finite{f' (and {others})' if others else ''}: the "
                    "update was skipped, and trainer.max_nonfinite_steps such steps in a row stop the run; "
                    "lower actor.optim.lr, set actor.optim.clip_grad, or check the rewards"
                )
            out.update(self._set(step, "nonfinite_grad", bool(bad), message))
        ratio = metrics.get("rewards/zero_std_ratio")
        if _finite(ratio):
            held = self._streak("zero_reward_spread", ratio >= self.cfg.zero_spread_max)
            out.update(
                self._set(
                    step,
                    "zero_reward_spread",
                    held,
                    f"step {step}: {ratio:.0%} of the prompt groups got one reward for all their samples "
                    f"(rewards/zero_std_ratio >= trainer.health.zero_spread_max={self.cfg.zero_spread_max} "
                    f"{self._in_a_row()}): their advantages are zero and they teach "
                    "nothing; check that the reward varies (a constant or saturated reward), or raise rollout.n",
                )
            )
        mean_ratio = metrics.get("actor/ratio_mean")
        if _finite(mean_ratio):
            low, high = self.cfg.ratio_band
            held = self._streak("ratio_out_of_band", not low <= mean_ratio <= high)
            out.update(
                self._set(
                    step,
                    "ratio_out_of_band",
                    held,
                    f"step {step}: the mean importance ratio actor/ratio_mean={mean_ratio:.4g} is outside "
                    f"trainer.health.ratio_band [{low}, {high}] {self._in_a_row()}: the "
                    "policy moves far from the one that sampled; lower actor.optim.lr, or train fewer "
                    "mini-batches or epochs per step",
                )
            )
        staleness = metrics.get("async/staleness_max")
        if _finite(staleness):
            out.update(
                self._set(
                    step,
                    "staleness",
                    staleness > self.staleness_bound,
                    f"step {step}: trajectories {staleness:g} weight versions old were trained on, beyond "
                    f"the bound of {self.staleness_bound} (trainer.health.max_staleness, else the async "
                    "mode's own: sync 0, one_step_off 1, bounded trainer.max_staleness)",
                )
            )
        reward = metrics.get(TRAIN_REWARD)
        if _finite(reward):
            self.train_rewards[step] = float(reward)
        return out

    # ------------------------------------------------------------------------------ validations
    def observe_validation(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """reward_hacking and collapse at one validation (module docstring); returns `health/...`
        (both 0 at the first validation; nothing without a standard error to judge by)."""
        key = validation_score_key(metrics)
        score, se = metrics.get(key), metrics.get(f"{key}_se")
        if not (_finite(score) and _finite(se)):
            return {}
        now = _Validation(step, float(score), float(se))
        best, out = self.best, {"health/reward_hacking": 0.0, "health/collapse": 0.0}
        if best is not None and best.step < step:
            drop_z = _z(best.score - now.score, math.hypot(best.se, now.se))
            if math.isfinite(drop_z):
                out["health/val_drop_z"] = drop_z
            falling = drop_z >= self.cfg.z
            trend = self._train_reward_trend(best.step, step)
            reward_fell = trend is None or trend[2] <= -self.cfg.z
            fall = (
                f"step {step}: {key} {now.score:.3f} is {drop_z:.1f} standard errors below its best "
                f"{best.score:.3f} (step {best.step})"
            )
            if trend is None and not self.train_rewards:
                reward_said = "the loop logs no training reward to tell reward hacking apart"
            elif trend is None:
                reward_said = "too few training steps around the best validation to tell reward hacking apart"
            else:
                before, after, trend_z = trend
                reward_said = f"{TRAIN_REWARD} {before:.3f} -> {after:.3f} ({trend_z:+.1f} standard errors)"
            reward_fall_said = (
                f"and the training reward fell too ({reward_said})" if trend else f"({reward_said})"
            )
            out.update(
                self._set(
                    step,
                    "reward_hacking",
                    falling and not reward_fell,
                    f"{fall} while the training reward did not fall ({reward_said}): the policy may be "
                    "exploiting the reward rather than learning the task; look at the validation grids. "
                    "trainer.keep_best=true keeps the best checkpoint",
                )
            )
            out.update(
                self._set(
                    step,
                    "collapse",
                    falling and reward_fell,
                    f"{fall} {reward_fall_said}: the run is collapsing; "
                    "lower actor.optim.lr or raise actor.loss.kl_coef. trainer.keep_best=true keeps the "
                    "best checkpoint",
                )
            )
        if best is None or now.score > best.score:
            self.best = now
        return out

    def _train_reward_trend(self, best_step: int, step: int) -> tuple[float, float, float] | None:
        """(mean before, mean after, z) of the training reward around the best validation (module
        docstring), or None when there are too few steps on either side to judge."""
        window = self.cfg.reward_window
        steps = sorted(self.train_rewards)
        before = [s for s in steps if best_step - window < s <= best_step]
        if not before:  # the best was the base model's (step 0): the first steps trained from it
            before = [s for s in steps if best_step < s <= step][:window]
        after = [s for s in steps if best_step < s <= step and s not in before][-window:]
        a = [self.train_rewards[s] for s in before]
        b = [self.train_rewards[s] for s in after]
        if not a or not b or len(a) + len(b) < 3:
            return None
        mean_a, mean_b = statistics.fmean(a), statistics.fmean(b)
        pooled = (sum((x - mean_a) ** 2 for x in a) + sum((x - mean_b) ** 2 for x in b)) / (
            len(a) + len(b) - 2
        )
        return mean_a, mean_b, -_z(mean_a - mean_b, math.sqrt(pooled * (1 / len(a) + 1 / len(b))))

    # ------------------------------------------------------------------------------ state
    def _in_a_row(self) -> str:
        patience = self.cfg.patience
        return (
            "at this step (trainer.health.patience=1)" if patience == 1 else f"for {patience} steps in a row"
        )

    def _streak(self, signal: str, condition: bool) -> bool:
        """Whether `condition` has held for trainer.health.patience steps in a row (this one too)."""
        self.streaks[signal] = self.streaks[signal] + 1 if condition else 0
        return self.streaks[signal] >= self.cfg.patience

    def _set(self, step: int, signal: str, holds: bool, message: str | None) -> dict[str, float]:
        """Record whether `signal` holds at `step`; at its onset warn once and, when it is in
        trainer.health.stop_on, set the stop reason."""
        if holds and not self.active[signal]:
            assert message is not None
            self.onsets.append(Onset(signal, step, message))
            if not self.quiet:
                print(f"warning: health: {signal}: {message}", flush=True)
                if signal in self.cfg.stop_on and self.stop_reason is None:
                    self.stop_reason = f"{signal} (trainer.health.stop_on): {message}"
        self.active[signal] = holds
        return {f"health/{signal}": float(holds)}

    def replay(self, history: Mapping[int, Mapping[str, Any]], up_to: int) -> None:
        """Rebuild the state from a resumed run's logged steps 0..`up_to` (metrics.jsonl), quietly:
        a condition that had started before the resume does not warn or stop again."""
        self.quiet = True
        try:
            for step in sorted(s for s in history if s <= up_to):
                self.observe_step(step, history[step])
                if any(k.startswith("val/") for k in history[step]):
                    self.observe_validation(step, history[step])
        finally:
            self.quiet = False

    def first_onsets(self) -> dict[str, int]:
        """{signal: the step it first started to hold}, for summary.json."""
        first: dict[str, int] = {}
        for onset in self.onsets:
            first.setdefault(onset.signal, onset.step)
        return first


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _z(difference: float, se: float) -> float:
    """difference / se, with an exact (zero-error) difference infinitely significant."""
    if se > 0:
        return difference / se
    return math.inf if difference > 0 else (-math.inf if difference < 0 else 0.0)


__all__ = [
    "HEALTH_SIGNALS",
    "NONFINITE_WATCHED",
    "HealthStop",
    "Onset",
    "Watchdog",
    "staleness_bound",
    "validation_score_key",
]
