"""The config schema: every key diffrl reads, its type, its default and its allowed values.

Defaults live here and only here; YAML presets and `key=value` overrides change them. Each section
validates its own ranges in `validate(at)` (`at` is the section's dotted path, so errors name the
full key); `Config.validate()` adds the rules that span sections. Values derived from several keys
(images per step, the SDE window, the world size) are properties computed here, never stored.

The defaults are a GPU-scale Flow-GRPO recipe (the SD3.5-Medium numbers of ALGORITHMS.md); the
`default` preset shrinks them to the CPU demo.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, fields, is_dataclass, make_dataclass
from typing import Any

from diffrl.algos import LOOPS, POLICY_GRADIENT, algorithm, algorithm_settings, algorithms
from diffrl.algos.kl import KL_STD_CHOICES
from diffrl.algos.nft import NFT_ADV_MODES
from diffrl.algos.rollout_correction import IS_LEVELS, IS_MODES, REJECTION_LEVELS, REJECTIONS
from diffrl.algos.spec import DIRECT_PREFERENCE, SAMPLES
from diffrl.config.checks import (
    ConfigError,
    require,
    require_at_least,
    require_choice,
    require_positive,
    require_step_range,
)
from diffrl.sde import SDE_KINDS

__all__ = ["ConfigError"]  # re-exported: callers catch it from here


def _require_finite(value: Any, at: str) -> None:
    """No float anywhere in the config (reward args and lists included) may be inf or nan: a
    comparison with nan is always False, so range checks alone let it through (lr=inf trained
    every step to NaN and exited 0)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{at}={value!r} is invalid: must be a finite number (not inf or nan)")
    if is_dataclass(value):
        for f in fields(value):
            _require_finite(getattr(value, f.name), f"{at}.{f.name}" if at else f.name)
    elif isinstance(value, dict):
        for key, item in value.items():
            _require_finite(item, f"{at}.{key}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _require_finite(item, f"{at}[{index}]")


# --------------------------------------------------------------------------------------- model
@dataclass
class LoraConfig:
    rank: int = 32  # 0 = full fine-tuning (no adapters; a frozen reference copy serves KL)
    alpha: float = 64.0
    target_modules: list[str] | None = None  # None = the model adapter's declared defaults
    init: str = "gaussian"  # peft's init_lora_weights
    # forward passes without gradients (rollouts, validation, the old policy's velocities) run with
    # the adapter merged into a copy of the targeted weights: one matmul per layer instead of three
    # (diffrl.train.lora.merged_adapter). Direct-preference losses on unsharded weights only.
    merge_inference: bool = False

    # Only inits that leave the base weights untouched: the reference policy is "adapters disabled",
    # which pissa/olora (they subtract from the base weights) would silently change.
    INITS = ("default", "gaussian")

    def validate(self, at: str) -> None:
        require_at_least(f"{at}.rank", self.rank, 0)
        require_positive(f"{at}.alpha", self.alpha)
        if self.target_modules is not None:
            require(
                len(self.target_modules) > 0,
                f"{at}.target_modules",
                self.target_modules,
                "must list at least one module name, or be null for the model's defaults",
            )
        require_choice(f"{at}.init", self.init, self.INITS)


@dataclass
class ModelConfig:
    path: str = ""  # a local diffusers directory (model_index.json inside)
    dtype: str = "bfloat16"  # the network's compute dtype; SDE math and stored latents are fp32
    lora: LoraConfig = field(default_factory=LoraConfig)
    gradient_checkpointing: bool = False
    attn_backend: str = "native"  # a diffusers attention backend name
    compile: bool = False  # torch.compile each transformer block (regional): faster after a warmup

    DTYPES = ("float32", "bfloat16", "float16")

    def validate(self, at: str) -> None:
        require_choice(f"{at}.dtype", self.dtype, self.DTYPES)
        self.lora.validate(f"{at}.lora")
        if self.attn_backend != ModelConfig.attn_backend:
            # diffusers' list of backends costs seconds of imports; its default needs no check
            from diffusers.models.attention_dispatch import AttentionBackendName

            require_choice(f"{at}.attn_backend", self.attn_backend, [b.value for b in AttentionBackendName])


# ------------------------------------------------------------------------------------- rollout
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

    def validate(self, at: str) -> None:
        for name in ("height", "width", "num_inference_steps", "max_sequence_length", "num_frames"):
            require_at_least(f"{at}.{name}", getattr(self, name), 1)
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
        _require_ray_resources(f"{at}.ray_resources", self.ray_resources)
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


# --------------------------------------------------------------------------------------- actor
@dataclass
class OptimConfig:
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 1e-4
    eps: float = 1e-8
    clip_grad: float | None = 1.0  # max gradient norm; null = no clipping
    scheduler: str = "constant"
    warmup_steps: int = 0  # linear warmup, in optimizer steps, before the scheduler's shape

    SCHEDULERS = ("constant", "cosine", "linear")

    def validate(self, at: str) -> None:
        require_positive(f"{at}.lr", self.lr)
        require(
            len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
            f"{at}.betas",
            self.betas,
            "must be two numbers in [0, 1), e.g. [0.9, 0.999]",
        )
        require_at_least(f"{at}.weight_decay", self.weight_decay, 0.0)
        require_positive(f"{at}.eps", self.eps)
        if self.clip_grad is not None:
            require_positive(f"{at}.clip_grad", self.clip_grad)
        require_choice(f"{at}.scheduler", self.scheduler, self.SCHEDULERS)
        require_at_least(f"{at}.warmup_steps", self.warmup_steps, 0)


@dataclass
class SharedLossConfig:
    """The `actor.loss` keys every algorithm may read; each algorithm's own keys follow them (`LossConfig`)."""

    mode: str = "flow_grpo"  # the algorithm (diffrl.algos); algorithm.trainer_type is the loop it needs
    clip_ratio: float = 1e-4  # PPO ε on the per-element-averaged log-prob ratio
    adv_clip_max: float = 5.0  # advantages are clamped to ±adv_clip_max inside the loss
    kl_coef: float = 0.0  # β of the KL-to-reference term; 0 = no reference pass
    kl_std: str = "sde"  # sde: divide by std_dev_t² (Flow-GRPO); transition: by the exact (s·sqrt(-dt))²

    def validate(self, at: str) -> None:
        try:
            algorithm(self.mode)
        except ValueError as err:
            raise ConfigError(f"{at}.mode={self.mode!r} is invalid: {err}") from None
        require_positive(f"{at}.clip_ratio", self.clip_ratio)
        require_positive(f"{at}.adv_clip_max", self.adv_clip_max)
        require_at_least(f"{at}.kl_coef", self.kl_coef, 0.0)
        require_choice(f"{at}.kl_std", self.kl_std, KL_STD_CHOICES)
        # every algorithm's keys, not only the chosen one's: a wrong value is wrong whatever the mode
        for spec in algorithms():
            settings = algorithm_settings(spec, self)
            if settings is not None:
                settings.validate(at)


def _compose_loss_config() -> type:
    """`actor.loss`: the shared keys, then each registered algorithm's settings in registration
    order (`AlgorithmSpec.settings`), flat, as VeRL-Omni's loss config spells them (`dpo_beta`,
    `mix_beta`, ...). A new algorithm's keys appear here by registering it; nothing to edit."""
    own = []
    for spec in algorithms():
        if spec.settings is None:
            continue
        types = typing.get_type_hints(spec.settings)  # real types: OmegaConf checks overrides with them
        own += [(f.name, types[f.name], field(default=f.default)) for f in fields(spec.settings)]
    return make_dataclass(
        "LossConfig",
        own,
        bases=(SharedLossConfig,),
        namespace={
            "__module__": __name__,
            "__doc__": "`actor.loss`: shared keys + each algorithm's settings.",
        },
    )


LossConfig = _compose_loss_config()


@dataclass
class ActorConfig:
    # auto: chosen by the run from the model size, device memory and LoRA vs full fine-tuning (printed);
    # ddp: replicated weights, gradients averaged; fsdp2: sharded; none: one worker (diffrl.train.parallel)
    strategy: str = "auto"
    mini_batch_size: int = 128  # trajectories per optimizer step (whole prompt groups), global
    micro_batch_size: int = 8  # trajectories per forward/backward, per worker
    epochs: int = 1  # passes over each step's rollouts
    shuffle: bool = True  # shuffle prompt groups across mini-batches
    param_offload: bool = False  # FSDP2's CPUOffloadPolicy: sharded weights, grads, AdamW in host memory
    optimizer_offload: bool = False  # AdamW state in host memory, on the device only for optimizer.step()
    activation_offload: bool = False  # tensors saved for backward wait in host memory (save_on_cpu)
    # ranks that split one sample's video tokens (Ulysses; docs/training.md "Sequence parallel")
    sequence_parallel_size: int = 1
    # batched replay: trained window steps per transformer forward of the update and the log-prob
    # passes (forwards of up to this × micro_batch_size rows); 1 = one forward per step
    # (docs/performance.md, "Batched replay"; diffrl.train.replay)
    replay_steps_per_forward: int = 1
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)

    STRATEGIES = ("auto", "ddp", "fsdp2", "none")

    def validate(self, at: str) -> None:
        require_choice(f"{at}.strategy", self.strategy, self.STRATEGIES)
        require_at_least(f"{at}.mini_batch_size", self.mini_batch_size, 1)
        require_at_least(f"{at}.micro_batch_size", self.micro_batch_size, 1)
        require_at_least(f"{at}.epochs", self.epochs, 1)
        require(
            not (self.optimizer_offload and self.param_offload),
            f"{at}.optimizer_offload",
            self.optimizer_offload,
            f"is redundant with {at}.param_offload=true, which already keeps the optimizer state (and runs "
            "its step) in host memory: set one of them to false",
        )
        require_at_least(f"{at}.sequence_parallel_size", self.sequence_parallel_size, 1)
        require_at_least(f"{at}.replay_steps_per_forward", self.replay_steps_per_forward, 1)
        self.optim.validate(f"{at}.optim")
        self.loss.validate(f"{at}.loss")


# ----------------------------------------------------------------------------------- algorithm
@dataclass
class OldPolicyConfig:
    """When and how the `old` adapter follows the trained one (DiffusionNFT and EMA variants)."""

    schedule: str = "copy"  # a named decay schedule (see ALGORITHMS.md)
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
    # diffusion_nft: how advantages become optimality probabilities (diffrl.algos.nft.NFT_ADV_MODES)
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
        from diffrl.algos import get_advantage_estimator

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


# -------------------------------------------------------------------------------------- reward
@dataclass
class RewardFnConfig:
    weight: float = 1.0  # the reward's weight in the weighted sum
    required: bool = True  # true: a failure stops the run; false: the batch scores 0, counted
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the reward function
    # videos: score this many evenly spaced frames (first and last among them), averaged; null = all
    video_frames: int | None = None


@dataclass
class RewardConfig:
    functions: dict[str, RewardFnConfig] = field(default_factory=dict)  # name -> weight/args
    workers: int = 1  # reward worker processes (Ray actors)
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    overlap: bool = True  # score each decoded micro-batch while the next one samples

    def validate(self, at: str) -> None:
        if self.functions:  # an empty set is the trainer's error: `diffrl config` may show one
            from diffrl.rewards import reward_specs

            try:
                reward_specs(self.functions)  # names, args and weights, without loading any model
            except ValueError as err:
                raise ConfigError(str(err)) from None
        require_at_least(f"{at}.workers", self.workers, 1)
        require_positive(f"{at}.cpus_per_worker", self.cpus_per_worker)
        require_at_least(f"{at}.gpus_per_worker", self.gpus_per_worker, 0.0)


# ---------------------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # .txt (one prompt per line), .jsonl, .parquet
    val_files: list[str] = field(default_factory=list)
    prompts_per_step: int = 8  # B: unique prompts per training step
    prompt_key: str = "prompt"  # the column holding the prompt in .jsonl/.parquet rows
    # image-edit models: the column with each row's condition image(s) (a path relative to the data
    # file, bytes in a parquet column, or a list of them); read only when the model takes them
    image_key: str = "image"
    # algorithm.sample_source=offline: the columns holding each row's preferred and dispreferred
    # image files (paths relative to the data file)
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    shuffle: bool = True
    seed: int | None = None  # null = trainer.seed

    def validate(self, at: str) -> None:
        require_at_least(f"{at}.prompts_per_step", self.prompts_per_step, 1)
        for key in ("prompt_key", "image_key", "chosen_key", "rejected_key"):
            value = getattr(self, key)
            require(bool(value), f"{at}.{key}", value, "must be a non-empty column name")
        require(
            self.chosen_key != self.rejected_key,
            f"{at}.rejected_key",
            self.rejected_key,
            f"must differ from {at}.chosen_key: the two images of a pair are in different columns",
        )
        require(
            self.image_key != self.prompt_key,
            f"{at}.image_key",
            self.image_key,
            f"must differ from {at}.prompt_key: the condition images and the prompt are different columns",
        )
        if self.seed is not None:
            require_at_least(f"{at}.seed", self.seed, 0)


# ----------------------------------------------------------------------------------------- sft
@dataclass
class SftConfig:
    """`diffrl sft`: supervised flow matching on (image, prompt) pairs; one image per data row per step."""

    # the column with each row's image file (relative to its data file), "shapes", or "shapes_edit"
    images: str = "image"
    weighting_scheme: str = "logit_normal"  # how training noise levels are drawn (diffusers' SD3 schemes)
    logit_mean: float = 0.0  # logit_normal: mean of the logit of the noise level
    logit_std: float = 1.0  # logit_normal: its std
    mode_scale: float = 1.29  # mode: the scale of the mode-sampling density
    prompt_dropout: float = 0.1  # probability of training a sample on the empty prompt (what CFG needs)
    data_workers: int = 0  # processes loading/rendering the next steps' images; 0 = in the training process

    # diffusers.training_utils.compute_density_for_timestep_sampling / compute_loss_weighting_for_sd3.
    WEIGHTING_SCHEMES = ("logit_normal", "mode", "uniform", "sigma_sqrt", "cosmap")

    def validate(self, at: str) -> None:
        require(
            bool(self.images),
            f"{at}.images",
            self.images,
            "must name an image column, or be 'shapes' or 'shapes_edit'",
        )
        require_choice(f"{at}.weighting_scheme", self.weighting_scheme, self.WEIGHTING_SCHEMES)
        require_positive(f"{at}.logit_std", self.logit_std)
        require(
            0.0 <= self.prompt_dropout < 1.0, f"{at}.prompt_dropout", self.prompt_dropout, "must be in [0, 1)"
        )
        require_at_least(f"{at}.data_workers", self.data_workers, 0)


# ------------------------------------------------------------------------------------- trainer
@dataclass
class TrainerConfig:
    total_steps: int = 300
    save_freq: int = 50  # steps between checkpoints; 0 = only the final one
    test_freq: int = 25  # steps between validations; 0 = never
    val_before_train: bool = True
    output_dir: str = "runs"
    run_name: str | None = None  # null = "<preset>-<timestamp>"; a folder name, no path
    resume: str = "auto"  # auto: newest complete checkpoint of the run; off; or a checkpoint path
    keep_checkpoints: int = 3  # the newest K are kept
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    n_gpus_per_node: int = 1  # workers per node (CPU workers when there is no GPU)
    nnodes: int = 1
    ray_address: str | None = None  # join this Ray cluster; null = start a local one
    # colocated: every worker samples and trains one module; separate: trainer ranks and rollout
    # replicas (rollout.replicas) in their own processes, weights streamed after each step
    placement: str = "colocated"
    # sync: sample with the newest weights; one_step_off (separate placement): sample batch k+1
    # while the trainer updates on batch k, one version behind; bounded (separate placement): the
    # replicas keep up to max_staleness batches in flight ahead of the trainer (docs/async.md)
    async_mode: str = "sync"
    # bounded: the most weight versions a trained batch may lag the weights the step starts from
    max_staleness: int = 2
    gpus_per_worker: float = (
        1.0  # GPU share of each trainer rank (below 1 with separate placement on one GPU)
    )
    ray_resources: dict[str, float] = field(default_factory=dict)  # extra Ray resources per trainer rank
    worker_timeout_s: float = 3600.0  # a worker call that runs longer ends the run (it stopped answering)
    seed: int = 42
    check_at_start: bool = True  # `diffrl check --quick` before the run starts (docs/check.md)
    max_nonfinite_steps: int = 3  # stop after this many steps in a row with a non-finite loss or gradient

    LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
    PLACEMENTS = ("colocated", "separate")
    ASYNC_MODES = ("sync", "one_step_off", "bounded")
    DEFAULT_MAX_STALENESS = 2

    def __post_init__(self) -> None:
        # YAML 1.1 reads a bare `off` as false (and `on` as true); the key is a string.
        if self.resume in ("False", "false"):
            self.resume = "off"
        elif self.resume in ("True", "true"):
            self.resume = "auto"

    def validate(self, at: str) -> None:
        require_at_least(f"{at}.total_steps", self.total_steps, 1)
        require_at_least(f"{at}.save_freq", self.save_freq, 0)
        require_at_least(f"{at}.test_freq", self.test_freq, 0)
        require(bool(self.resume), f"{at}.resume", self.resume, "must be auto, off, or a checkpoint path")
        require_at_least(f"{at}.keep_checkpoints", self.keep_checkpoints, 1)
        for logger in self.loggers:
            require_choice(f"{at}.loggers", logger, self.LOGGERS)
        require_at_least(f"{at}.n_gpus_per_node", self.n_gpus_per_node, 1)
        require_at_least(f"{at}.nnodes", self.nnodes, 1)
        require_at_least(f"{at}.seed", self.seed, 0)
        require_at_least(f"{at}.max_nonfinite_steps", self.max_nonfinite_steps, 1)
        require_choice(f"{at}.placement", self.placement, self.PLACEMENTS)
        require_choice(f"{at}.async_mode", self.async_mode, self.ASYNC_MODES)
        require(
            self.async_mode == "sync" or self.placement == "separate",
            f"{at}.async_mode",
            self.async_mode,
            "needs trainer.placement=separate: colocated workers cannot sample while they train",
        )
        require(
            isinstance(self.max_staleness, int) and self.max_staleness >= 1,
            f"{at}.max_staleness",
            self.max_staleness,
            "must be an integer >= 1 (the weight versions a trained batch may lag; 1 is one step off): "
            "set trainer.max_staleness=1 or more, or trainer.async_mode=sync for on-policy batches",
        )
        require(
            self.max_staleness == self.DEFAULT_MAX_STALENESS or self.async_mode == "bounded",
            f"{at}.max_staleness",
            self.max_staleness,
            f"only applies to trainer.async_mode=bounded (this run's is {self.async_mode}; one_step_off "
            f"is a staleness of 1): set trainer.async_mode=bounded, or leave it at {self.DEFAULT_MAX_STALENESS}",
        )
        require(self.gpus_per_worker > 0, f"{at}.gpus_per_worker", self.gpus_per_worker, "must be > 0")
        require(
            self.gpus_per_worker == 1.0 or self.placement == "separate",
            f"{at}.gpus_per_worker",
            self.gpus_per_worker,
            "only applies to trainer.placement=separate (a colocated worker owns its GPU): leave it at 1",
        )
        _require_ray_resources(f"{at}.ray_resources", self.ray_resources)
        require_positive(f"{at}.worker_timeout_s", self.worker_timeout_s)
        if self.run_name is not None:
            # The run folder is output_dir/run_name: a separator or '..' would write elsewhere.
            require(
                bool(self.run_name)
                and self.run_name not in (".", "..")
                and not any(sep in self.run_name for sep in ("/", "\\", "\0")),
                f"{at}.run_name",
                self.run_name,
                "must be a plain folder name (no '/', '\\', '.' or '..'); it is created inside "
                "trainer.output_dir, so put a different parent folder in trainer.output_dir",
            )


def _require_ray_resources(key: str, resources: dict[str, float]) -> None:
    """Custom Ray resources (e.g. a node label `{rollout_node: 1}`); CPU and GPU have their own keys."""
    for name, amount in resources.items():
        require(
            name not in ("CPU", "GPU", "memory"),
            key,
            resources,
            f"names {name!r}, which Ray accounts itself: use trainer.gpus_per_worker / rollout.gpus_per_replica",
        )
        require(isinstance(amount, int | float) and amount > 0, key, resources, f"{name} must be > 0")


# ---------------------------------------------------------------------------------------- root
@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SftConfig = field(default_factory=SftConfig)

    JOBS = ("train", "sft", "eval")

    def validate(self, job: str = "train") -> Config:
        """Check every section, then the rules that span sections for `job` (`train`: RL batch
        arithmetic; `sft`: images per step over micro-batches; `eval`: neither); returns self."""
        require_choice("job", job, self.JOBS)
        _require_finite(self, "")
        for section in fields(self):
            getattr(self, section.name).validate(section.name)
        n, mini, micro = self.rollout.n, self.actor.mini_batch_size, self.actor.micro_batch_size
        if job == "eval":
            return self
        if job == "sft":
            require(
                self.data.prompts_per_step % (micro * self.world_size) == 0,
                "data.prompts_per_step",
                self.data.prompts_per_step,
                f"(images per sft step) must be a multiple of actor.micro_batch_size={micro} × the "
                f"{self.world_size} worker(s)",
            )
            return self
        if self.algorithm.sample_source == "online":
            require(
                n >= 2,
                "rollout.n",
                n,
                "must be >= 2 when training on rollouts: advantages (and DPO's pairs) compare the "
                "samples of one prompt",
            )
        if self.algorithm.trainer_type == POLICY_GRADIENT:
            require(
                self.algorithm.sample_source == "online",
                "algorithm.sample_source",
                self.algorithm.sample_source,
                "must be online for policy-gradient training (it learns from its own SDE rollouts); "
                "offline preference pairs need algorithm.trainer_type=direct_preference with "
                "actor.loss.mode=dpo",
            )
            rc = self.algorithm.rollout_correction
            reuses = self.reuses_rollout_log_probs
            require(
                not (reuses and (rc.is_level != "none" or rc.rejection != "none")),
                "algorithm.rollout_correction",
                f"is_level={rc.is_level}, rejection={rc.rejection}",
                "has no effect when the trainer reuses the rollout's own log-probs (algorithm.old_log_probs="
                f"{self.algorithm.old_log_probs}): there is no second log-prob to correct against. Set "
                "algorithm.old_log_probs=recompute, or leave is_level and rejection at none",
            )
        self._validate_replay()
        passes = self.rollout.log_prob_passes
        if passes == "rollout":
            require(
                self.trainer.placement == "separate",
                "rollout.log_prob_passes",
                passes,
                "needs trainer.placement=separate (a rollout pool of its own): colocated workers "
                "sample and train on one module already; leave it at auto",
            )
            require(
                self.actor.micro_batch_size <= self._request_size
                and self._request_size % self.actor.micro_batch_size == 0,
                "rollout.log_prob_passes",
                passes,
                f"needs the replicas' requests of {self._request_size} samples (whole groups of "
                f"rollout.n={n} within rollout.micro_batch_size={self.rollout.micro_batch_size}) to "
                f"split into whole micro-batches of actor.micro_batch_size={self.actor.micro_batch_size}, "
                "the trainer's: set rollout.micro_batch_size to a multiple of it, or "
                "rollout.log_prob_passes=trainer",
            )
            require(
                self.trainer.async_mode != "bounded" or self.reuses_rollout_log_probs,
                "rollout.log_prob_passes",
                passes,
                "cannot run the recomputed old log-probs on the replicas with trainer.async_mode=bounded: "
                "they need the weights the update starts from, which the replicas receive only after "
                "sampling the batches already in flight. Set rollout.log_prob_passes=auto (the reference "
                "pass still runs on the replicas) or trainer",
            )
            require(
                self.actor.loss.kl_coef == 0 or self.model.lora.rank > 0,
                "rollout.log_prob_passes",
                passes,
                "cannot run the reference pass of full fine-tuning (model.lora.rank=0) on the "
                "replicas: they hold no frozen copy of the base weights. Use LoRA, or "
                "rollout.log_prob_passes=trainer",
            )
        if self.algorithm.train_step_range is not None:
            steps = self.rollout.pipeline.num_inference_steps
            on_samples = [
                spec.name
                for spec in algorithms(DIRECT_PREFERENCE)
                if getattr(spec, "trains_on", None) == SAMPLES
            ]
            require(
                self.actor.loss.mode in on_samples,
                "algorithm.train_step_range",
                self.algorithm.train_step_range,
                f"picks the noise levels of the losses that noise clean samples ({', '.join(on_samples)}); "
                f"actor.loss.mode={self.actor.loss.mode} does not use it: leave it null (the Flow-GRPO "
                "family chooses its steps with rollout.sde.window_range)",
            )
            require(
                self.algorithm.train_step_range[1] <= steps,
                "algorithm.train_step_range",
                self.algorithm.train_step_range,
                f"ends after the rollout's {steps} steps (rollout.pipeline.num_inference_steps): use hi <= {steps}",
            )
        require(
            self.world_size == 1 or self.actor.strategy != "none",
            "actor.strategy",
            self.actor.strategy,
            f"must be auto, ddp or fsdp2 with {self.world_size} workers (trainer.n_gpus_per_node × "
            "trainer.nnodes): without it each worker would train its own copy",
        )
        sp = self.actor.sequence_parallel_size
        require(
            self.world_size % sp == 0,
            "actor.sequence_parallel_size",
            sp,
            f"must divide the {self.world_size} worker(s): each group of that many workers splits one "
            "sample's video tokens",
        )
        require(
            self.data.prompts_per_step % self.world_size == 0,
            "data.prompts_per_step",
            self.data.prompts_per_step,
            f"must be a multiple of the {self.world_size} worker(s): each worker samples whole prompt groups",
        )
        require(
            mini % n == 0,
            "actor.mini_batch_size",
            mini,
            f"must be a multiple of rollout.n={n} (all samples of a prompt stay in one mini-batch)",
        )
        require(
            self.images_per_step % mini == 0,
            "actor.mini_batch_size",
            mini,
            f"must divide the trajectories per step, data.prompts_per_step × rollout.n = {self.images_per_step}",
        )
        require(
            mini % (micro * self.world_size) == 0,
            "actor.micro_batch_size",
            micro,
            f"× the {self.world_size} worker(s) must divide actor.mini_batch_size={mini}",
        )
        return self

    def _validate_replay(self) -> None:
        """`actor.replay_steps_per_forward` (batched replay, diffrl.train.replay) against the rest."""
        replay = self.actor.replay_steps_per_forward
        if replay == 1:
            return
        key = "actor.replay_steps_per_forward"
        require(
            self.algorithm.trainer_type == POLICY_GRADIENT,
            key,
            replay,
            f"batches the SDE window steps of the policy-gradient losses, but actor.loss.mode="
            f"{self.actor.loss.mode} (algorithm.trainer_type={self.algorithm.trainer_type}) trains on "
            "clean samples: leave it at 1",
        )
        window = self.rollout.sde_window_size
        require(
            replay <= window,
            key,
            replay,
            f"must be <= the {window} trained window steps of a micro-batch (rollout.sde.window_size): "
            f"set it to {window} to replay the whole window in one forward",
        )
        require(
            self.algorithm.old_log_probs != "rollout",
            "algorithm.old_log_probs",
            self.algorithm.old_log_probs,
            f"cannot reuse the sampler's log-probs with {key}={replay}: the update's forwards of up to "
            f"{replay} × actor.micro_batch_size rows round differently from the sampler's, so PPO's "
            "ratio would not start at exactly 1. Set algorithm.old_log_probs=auto (recomputed through "
            f"the update's own batched forwards), or {key}=1",
        )

    @property
    def world_size(self) -> int:
        """Training workers: one per GPU (or per CPU worker) over all nodes."""
        return self.trainer.n_gpus_per_node * self.trainer.nnodes

    @property
    def images_per_step(self) -> int:
        """Trajectories sampled per training step (prompts × samples per prompt)."""
        return self.data.prompts_per_step * self.rollout.n

    @property
    def reuses_rollout_log_probs(self) -> bool:
        """Whether PPO's old log-probs are the rollout's own (`algorithm.old_log_probs`).

        `auto` reuses them when the sampler computes exactly what the trainer's first forward
        computes: colocated workers share the module, and a sampler whose log-probs are reused
        runs its window steps on slices of actor.micro_batch_size (kernels round by batch size,
        `TrajectorySampler._trained_slices`), eagerly without grad (the kernels are the same with
        and without it), compiled through the training graph. That matches only when those slices
        are the trainer's micro-batches (every training step trains every window step, and rollout
        micro-batches split into whole actor micro-batches). Compiled, `auto` recomputes otherwise,
        and with rollout correction (it needs a second log-prob); eagerly it reuses them all the
        same, leaving a float-rounding gap (about 1e-7 in fp32 on CPU). Batched replay
        (actor.replay_steps_per_forward > 1) recomputes: the update's forwards have k·B rows, the
        sampler's B, and larger matmuls round differently; the recompute groups its forwards as
        the update does, so the ratio starts at exactly 1 (diffrl.train.replay).

        Separate placement recomputes: a replica runs its own copy of the module (no FSDP
        mixed-precision casts), and in one_step_off (bounded) mode it
        samples one (up to trainer.max_staleness) weight version behind the trainer, so the
        recomputed log-probs are the proximal policy and the rollout's are the behaviour policy
        (docs/async.md).
        """
        algo, rc = self.algorithm, self.algorithm.rollout_correction
        if algo.old_log_probs != "auto":
            return algo.old_log_probs == "rollout"
        if self.actor.replay_steps_per_forward > 1 or self.trainer.placement == "separate":
            return False
        if not self.model.compile:
            return True
        return (
            algo.timestep_fraction >= 1.0
            and self.rollout.micro_batch_size % self.actor.micro_batch_size == 0
            and rc.is_level == "none"
            and rc.rejection == "none"
        )

    @property
    def _request_size(self) -> int:
        """Samples in one replica request: whole prompt groups of one sampler micro-batch."""
        return max(1, self.rollout.micro_batch_size // self.rollout.n) * self.rollout.n

    @property
    def rollout_passes(self) -> tuple[str, ...]:
        """The passes without gradient that the rollout replicas run (`rollout.log_prob_passes`):
        `default` (the recomputed old log-probs) and `reference` (the KL reference's means),
        or none: they then run on the trainer ranks.

        `auto` moves them when the replica computes bitwise what the trainer would: separate
        placement, policy-gradient training, requests that split into the trainer's micro-batches.
        The old log-probs move only when the trainer computes with the weights' own dtypes (one
        rank, or ddp): FSDP2's mixed precision casts the fp32 LoRA weights to the compute dtype,
        the replica does not; and, compiled, only with LoRA: the trainer recomputes them through
        its training graph, which a replica traces only with its trained adapter requiring grad
        (full fine-tuning would need every weight to). The reference pass (LoRA: the adapters
        disabled, the base weights in their own dtype on both sides) moves whenever LoRA is on; full fine-tuning keeps its frozen
        reference copy on the trainer only. With trainer.async_mode=bounded the old log-probs stay
        on the trainer: the replicas receive the weights the update starts from only after sampling
        the batches already in flight, so a pass there would stall the update."""
        choice = self.rollout.log_prob_passes
        if (
            choice == "trainer"
            or self.trainer.placement != "separate"
            or self.algorithm.trainer_type != POLICY_GRADIENT
        ):
            return ()
        if choice == "auto" and self._request_size % self.actor.micro_batch_size:
            return ()
        passes = []
        # compiled, the trainer recomputes through its training graph, which a replica runs too
        # only with LoRA (workers.rollout_worker.computes_as_trained)
        exact = (self.world_size == 1 or self.actor.strategy == "ddp") and (
            not self.model.compile or self.model.lora.rank > 0
        )
        bounded = self.trainer.async_mode == "bounded"
        if not self.reuses_rollout_log_probs and not bounded and (choice == "rollout" or exact):
            passes.append("default")
        if self.actor.loss.kl_coef > 0 and self.model.lora.rank > 0:
            passes.append("reference")
        return tuple(passes)

    @property
    def rollout_seed(self) -> int:
        return self.trainer.seed if self.rollout.seed is None else self.rollout.seed

    @property
    def data_seed(self) -> int:
        return self.trainer.seed if self.data.seed is None else self.data.seed

    def derived(self) -> dict[str, Any]:
        """The values computed from several keys, for display next to the resolved config."""
        mini_batches = self.images_per_step // self.actor.mini_batch_size
        return {
            "images_per_step": self.images_per_step,
            "world_size": self.world_size,
            "optimizer_steps_per_step": mini_batches * self.actor.epochs,
            "sde_window_range": list(self.rollout.sde_window_range),
            "sde_window_size": self.rollout.sde_window_size,
            "rollout_seed": self.rollout_seed,
            "data_seed": self.data_seed,
        }
