"""`rollout.*`: sampling (the pipeline, the SDE and its window, validation sampling) and the
rollout pool of separate placement (replicas, weight sync)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from diffrl.config.checks import (
    require,
    require_at_least,
    require_choice,
    require_positive,
    require_ray_resources,
    require_step_range,
)
from diffrl.config.choices import SDE_KINDS


@dataclass
class PipelineConfig:
    height: int = 512
    width: int = 512
    num_inference_steps: int = 10
    guidance_scale: float = 4.5  # SD3/Wan: CFG scale (1.0 = off, one pass); FLUX: distilled guidance
    true_cfg_scale: float | None = None  # FLUX/Qwen-Image true CFG (Qwen-Image: norm rescale); null = off
    max_sequence_length: int = 256  # text tokens
    num_frames: int = 1  # > 1 only for video families (Wan)
    negative_prompt: str = ""
    # the sampler's own sigmas σ_0 > ... > σ_{N-1} (N = num_inference_steps), used as given (no
    # shift), e.g. a few-step student's (docs/distillation.md); null = the family's schedule
    sigmas: list[float] | None = None

    def validate(self, at: str) -> None:
        for name in ("height", "width", "num_inference_steps", "max_sequence_length", "num_frames"):
            require_at_least(f"{at}.{name}", getattr(self, name), 1)
        if self.sigmas is not None:
            values = list(self.sigmas)
            require(
                len(values) == self.num_inference_steps
                and all(0.0 < s <= 1.0 for s in values)
                and all(b < a for a, b in itertools.pairwise(values)),
                f"{at}.sigmas",
                values,
                f"must be {self.num_inference_steps} (num_inference_steps) decreasing values in (0, 1]",
            )
        require_at_least(f"{at}.guidance_scale", self.guidance_scale, 0.0)
        if self.true_cfg_scale is not None:
            require_at_least(f"{at}.true_cfg_scale", self.true_cfg_scale, 1.0)


@dataclass
class SdeConfig:
    type: str = "sde"  # the SDE used inside the window: sde (Flow-GRPO), cps, dance_sde
    noise_level: float = 0.7  # η
    window_size: int | None = None  # W consecutive SDE steps; null = every step of window_range
    window_range: list[int] | None = None  # [lo, hi) of steps the window may occupy; null = all steps
    window_strategy: str = "random"  # random: k0 ~ U{lo..hi-W} per step; progressive: MixGRPO
    iters_per_group: int = 1  # progressive: training steps before the window moves on

    TYPES = tuple(kind for kind in SDE_KINDS if kind != "ode")
    STRATEGIES = ("random", "progressive")

    def validate(self, at: str) -> None:
        require_choice(f"{at}.type", self.type, self.TYPES)
        require(
            self.noise_level > 0,
            f"{at}.noise_level",
            self.noise_level,
            "must be > 0 (the SDE needs noise to have log-probabilities; validation uses rollout.val.noise_level)",
        )
        if self.type == "cps":
            require(
                self.noise_level <= 1,
                f"{at}.noise_level",
                self.noise_level,
                "must be <= 1 for type=cps (its std is σ'·sin(η·π/2), which folds back above 1)",
            )
        if self.window_size is not None:
            require_at_least(f"{at}.window_size", self.window_size, 1)
        require_step_range(f"{at}.window_range", self.window_range)
        require_choice(f"{at}.window_strategy", self.window_strategy, self.STRATEGIES)
        require_at_least(f"{at}.iters_per_group", self.iters_per_group, 1)


@dataclass
class ValidationConfig:
    n: int = 1  # samples per validation prompt
    seed: int = 0  # fixed, so every validation of a run sees the same initial noise
    num_inference_steps: int | None = None  # null = rollout.pipeline.num_inference_steps
    noise_level: float = 0.0  # 0 = the deterministic ODE sampler

    LOG_PROB_PASSES = ("auto", "trainer", "rollout")

    def validate(self, at: str) -> None:
        require_at_least(f"{at}.n", self.n, 1)
        require_at_least(f"{at}.seed", self.seed, 0)
        if self.num_inference_steps is not None:
            require_at_least(f"{at}.num_inference_steps", self.num_inference_steps, 1)
        require_at_least(f"{at}.noise_level", self.noise_level, 0.0)


@dataclass
class WeightSyncConfig:
    """How the trainer's weights reach the rollout replicas (trainer.placement=separate)."""

    backend: str = "auto"  # auto: nccl when every process has a GPU of its own, else gloo
    bucket_mb: float = 256.0  # tensors are streamed in flat buffers of at most this size
    timeout_s: float = 600.0  # a peer that does not take part within this long ends the run

    BACKENDS = ("auto", "nccl", "gloo")

    def validate(self, at: str) -> None:
        require_choice(f"{at}.backend", self.backend, self.BACKENDS)
        require_positive(f"{at}.bucket_mb", self.bucket_mb)
        require_positive(f"{at}.timeout_s", self.timeout_s)


@dataclass
class RolloutConfig:
    n: int = 16  # samples per prompt (the GRPO group size)
    micro_batch_size: int = 16  # (prompt, sample) pairs per sampler forward, per worker
    seed: int | None = None  # null = trainer.seed
    # DanceGRPO: every sample of a prompt group starts from the same initial noise (its SDE noise
    # still differs), so rewards within a group differ only by what the policy's steps did
    same_group_noise: bool = False
    # trainer.placement=separate: the rollout pool (docs/async.md)
    replicas: int = 1  # sampler replicas, each a model copy without optimizer state
    gpus_per_replica: float = 1.0  # below 1 shares a GPU (e.g. 0.5 next to a 0.5 trainer on one GPU)
    requests_in_flight: int = 2  # prompt-group requests queued on each replica at a time
    # where the passes without gradient run (recomputed old log-probs, reference means):
    # auto | trainer | rollout (the replicas; separate placement; docs/async.md, "Balanced pools")
    log_prob_passes: str = "auto"
    ray_resources: dict[str, float] = field(default_factory=dict)  # extra Ray resources per replica
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    sde: SdeConfig = field(default_factory=SdeConfig)
    val: ValidationConfig = field(default_factory=ValidationConfig)

    LOG_PROB_PASSES = ("auto", "trainer", "rollout")

    def validate(self, at: str) -> None:
        require_at_least(f"{at}.n", self.n, 1)
        require_at_least(f"{at}.micro_batch_size", self.micro_batch_size, 1)
        require_at_least(f"{at}.replicas", self.replicas, 1)
        require(self.gpus_per_replica > 0, f"{at}.gpus_per_replica", self.gpus_per_replica, "must be > 0")
        require_at_least(f"{at}.requests_in_flight", self.requests_in_flight, 1)
        require_choice(f"{at}.log_prob_passes", self.log_prob_passes, self.LOG_PROB_PASSES)
        require_ray_resources(f"{at}.ray_resources", self.ray_resources)
        self.weight_sync.validate(f"{at}.weight_sync")
        if self.seed is not None:
            require_at_least(f"{at}.seed", self.seed, 0)
        self.pipeline.validate(f"{at}.pipeline")
        self.sde.validate(f"{at}.sde")
        self.val.validate(f"{at}.val")
        steps = self.pipeline.num_inference_steps
        lo, hi = self.sde_window_range
        require(
            hi <= steps,
            f"{at}.sde.window_range",
            self.sde.window_range,
            f"must end at or before rollout.pipeline.num_inference_steps={steps}",
        )
        require(
            self.sde_window_size <= hi - lo,
            f"{at}.sde.window_size",
            self.sde.window_size,
            f"must be <= the window range's length {hi - lo} (range [{lo}, {hi}) of "
            f"rollout.pipeline.num_inference_steps={steps})",
        )

    @property
    def sde_window_range(self) -> tuple[int, int]:
        """[lo, hi) of denoising steps the SDE window may occupy."""
        if self.sde.window_range is None:
            return 0, self.pipeline.num_inference_steps
        lo, hi = self.sde.window_range
        return lo, hi

    @property
    def sde_window_size(self) -> int:
        """W: SDE (and trained) steps per trajectory."""
        lo, hi = self.sde_window_range
        return self.sde.window_size if self.sde.window_size is not None else hi - lo
