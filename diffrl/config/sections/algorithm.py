"""`algorithm.*`: which loop trains, advantages, old log-probs, the old policy (EMA) and rollout correction."""

from __future__ import annotations

from dataclasses import dataclass, field

from diffrl.config.checks import (
    ConfigError,
    require,
    require_at_least,
    require_choice,
    require_positive,
    require_step_range,
)
from diffrl.config.choices import IS_LEVELS, IS_MODES, NFT_ADV_MODES, REJECTION_LEVELS, REJECTIONS
from diffrl.config.registries import LOOPS, get_advantage_estimator


@dataclass
class OldPolicyConfig:
    """When and how the `old` adapter follows the trained one (DiffusionNFT and EMA variants)."""

    schedule: str = "copy"  # a named decay schedule (docs/algorithms.md, "Old policy")
    decay: float | None = None  # a fixed decay d; overrides the schedule when set
    update_interval: int = 1  # optimizer steps between updates

    SCHEDULES = ("copy", "linear_to_0_5", "delayed_linear_to_0_999")

    def validate(self, at: str) -> None:
        require_choice(f"{at}.schedule", self.schedule, self.SCHEDULES)
        if self.decay is not None:
            require(0.0 <= self.decay <= 1.0, f"{at}.decay", self.decay, "must be in [0, 1], or null")
        require_at_least(f"{at}.update_interval", self.update_interval, 1)


@dataclass
class RolloutCorrectionConfig:
    """Correction for a sampler whose log-probs differ from the trainer's (λ = logp_old − logp_rollout)."""

    # importance weights exp(λ): none, per step, per sequence (sum over steps) or geometric (mean)
    is_level: str = "none"
    is_mode: str = "truncate"  # truncate: min(w, is_threshold); mask: drop w outside [is_lower, is_threshold]
    is_threshold: float = 2.0
    is_lower: float = 0.5
    rejection: str = "none"  # reject samples whose k1/k2/k3 statistic exceeds rejection_threshold
    rejection_threshold: float = 0.01
    rejection_level: str = "step"  # step, or aggregated per sample: sequence_mean/_sum/_max

    IS_LEVELS = IS_LEVELS
    REJECTION_LEVELS = REJECTION_LEVELS
    IS_MODES = IS_MODES
    REJECTIONS = REJECTIONS

    def validate(self, at: str) -> None:
        require_choice(f"{at}.is_level", self.is_level, self.IS_LEVELS)
        require_choice(f"{at}.is_mode", self.is_mode, self.IS_MODES)
        require_positive(f"{at}.is_threshold", self.is_threshold)
        require(
            0.0 <= self.is_lower < self.is_threshold,
            f"{at}.is_lower",
            self.is_lower,
            f"must be in [0, is_threshold={self.is_threshold})",
        )
        require_choice(f"{at}.rejection", self.rejection, self.REJECTIONS)
        require_positive(f"{at}.rejection_threshold", self.rejection_threshold)
        require_choice(f"{at}.rejection_level", self.rejection_level, self.REJECTION_LEVELS)
        require(
            not (self.rejection == "k1" and self.rejection_level == "sequence_max"),
            f"{at}.rejection_level",
            self.rejection_level,
            "sequence_max is not defined for the signed k1 statistic: use k2/k3 or another level",
        )


@dataclass
class AlgorithmConfig:
    trainer_type: str = "policy_gradient"  # policy_gradient (Flow-GRPO family) or direct_preference
    sample_source: str = "online"  # online: the rollout; offline: a preference dataset
    adv_estimator: str = "flow_grpo"  # a registered advantage estimator (diffrl.algos)
    norm_adv_by_std: bool = True  # false = Dr.GRPO (no division by the std)
    global_std: bool = True  # true: the batch's reward std; false: each group's own
    timestep_fraction: float = 1.0  # fraction of window steps trained (DanceGRPO-style subsampling)
    # DiffusionNFT / AWM: [lo, hi) of the rollout schedule's steps whose noise levels σ_lo..σ_{hi-1}
    # the loss trains on (timestep_fraction of them per sample); null = every step's level
    train_step_range: list[int] | None = None
    # diffusion_nft: how advantages become optimality probabilities (diffrl.config.choices.NFT_ADV_MODES)
    adv_mode: str = "continuous"
    # auto: reuse the rollout's own log-probs when the sampler is the trained module itself
    # (colocated, same dtype, same compile), recompute otherwise; recompute; rollout (always reuse)
    old_log_probs: str = "auto"
    old_policy: OldPolicyConfig = field(default_factory=OldPolicyConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    OLD_LOG_PROBS = ("auto", "recompute", "rollout")
    TRAINER_TYPES = LOOPS
    SAMPLE_SOURCES = ("online", "offline")

    def validate(self, at: str) -> None:
        require_choice(f"{at}.trainer_type", self.trainer_type, self.TRAINER_TYPES)
        require_choice(f"{at}.sample_source", self.sample_source, self.SAMPLE_SOURCES)
        require_choice(f"{at}.old_log_probs", self.old_log_probs, self.OLD_LOG_PROBS)
        require_choice(f"{at}.adv_mode", self.adv_mode, NFT_ADV_MODES)
        try:
            get_advantage_estimator(self.adv_estimator)
        except ValueError as err:
            raise ConfigError(f"{at}.adv_estimator={self.adv_estimator!r} is invalid: {err}") from None
        require(
            0.0 < self.timestep_fraction <= 1.0,
            f"{at}.timestep_fraction",
            self.timestep_fraction,
            "must be in (0, 1]",
        )
        require_step_range(f"{at}.train_step_range", self.train_step_range)
        self.old_policy.validate(f"{at}.old_policy")
        self.rollout_correction.validate(f"{at}.rollout_correction")
