"""The config schema: every key diffrl reads, its type, its default and its allowed values.

Each top-level section is a dataclass in `diffrl.config.sections.<key>` (`rollout.*` in
sections/rollout.py, ...); this module holds the root `Config`, which nests them, and is where
callers import any of them from. Defaults live in those dataclasses and only there; YAML presets and
`key=value` overrides change them. Each section validates its own ranges in `validate(at)` (`at` is
the section's dotted path, so errors name the full key); `Config.validate()` adds the rules that
span sections. Values derived from several keys (images per step, the SDE window, the world size)
are properties computed on the sections and here, never stored.

The defaults are a GPU-scale Flow-GRPO recipe (SD3.5-Medium's numbers; docs/configuration.md lists them); the
`default` preset shrinks them to the CPU demo.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from diffrl.config.checks import ConfigError, require, require_choice
from diffrl.config.plan import request_size
from diffrl.config.registries import DIRECT_PREFERENCE, PAIRS, POLICY_GRADIENT, SAMPLES, algorithm, algorithms
from diffrl.config.sections.actor import ActorConfig, LossConfig, OptimConfig
from diffrl.config.sections.algorithm import AlgorithmConfig, OldPolicyConfig, RolloutCorrectionConfig
from diffrl.config.sections.data import DataConfig
from diffrl.config.sections.health import HealthConfig
from diffrl.config.sections.model import LoraConfig, ModelConfig
from diffrl.config.sections.reward import RewardConfig, RewardFnConfig
from diffrl.config.sections.rollout import PipelineConfig, RolloutConfig, SdeConfig, ValidationConfig
from diffrl.config.sections.sft import SftConfig
from diffrl.config.sections.trainer import TrainerConfig

# Re-exported: callers import every section from here (and catch ConfigError from here).
__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "HealthConfig",
    "LoraConfig",
    "LossConfig",
    "ModelConfig",
    "OldPolicyConfig",
    "OptimConfig",
    "PipelineConfig",
    "RewardConfig",
    "RewardFnConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "SdeConfig",
    "SftConfig",
    "TrainerConfig",
    "ValidationConfig",
]


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
        self._check_sharding_settings()
        if job == "sft":
            require(
                self.data.prompts_per_step % (micro * self.world_size) == 0,
                "data.prompts_per_step",
                self.data.prompts_per_step,
                f"(images per sft step) must be a multiple of actor.micro_batch_size={micro} × the "
                f"{self.world_size} worker(s)",
            )
            return self
        self._check_loop()
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

    def _check_loop(self) -> None:
        """The loss and the loop fit each other, in both directions (a policy-gradient loss needs SDE
        transitions and log-probs, a direct-preference loss clean samples at fresh noise levels),
        and no direct-preference setting would be silently ignored or fail late."""
        algo, mode = self.algorithm, self.actor.loss.mode
        spec = algorithm(mode)
        if spec.loop != algo.trainer_type:
            raise ConfigError(
                f"actor.loss.mode={mode} needs algorithm.trainer_type={spec.loop}, but it is "
                f"{algo.trainer_type}: set algorithm.trainer_type={spec.loop}, or choose a "
                f"{algo.trainer_type} loss"
            )
        if algo.trainer_type != DIRECT_PREFERENCE:
            return
        if algo.sample_source == "offline":
            if getattr(spec, "trains_on", None) != PAIRS:
                on_pairs = "/".join(s.name for s in algorithms(DIRECT_PREFERENCE) if s.trains_on == PAIRS)
                raise ConfigError(
                    f"algorithm.sample_source=offline reads preference pairs, which only actor.loss.mode="
                    f"{on_pairs} trains on (got {mode}): set actor.loss.mode={on_pairs}, or "
                    "algorithm.sample_source=online"
                )
            if self.rollout.n != 2:
                raise ConfigError(
                    f"rollout.n={self.rollout.n}: with algorithm.sample_source=offline each row is a group of "
                    "two images (chosen, rejected), so set rollout.n=2 (actor.mini_batch_size counts images)"
                )
        defaults = AlgorithmConfig()
        if algo.rollout_correction != defaults.rollout_correction:
            raise ConfigError(
                "algorithm.rollout_correction has no effect with algorithm.trainer_type=direct_preference "
                "(no SDE log-probs are compared): leave it at its defaults"
            )
        # the algorithm's own rule (diffrl.algos.spec.DirectPreferenceSpec.needs_old_adapter)
        uses_old = spec.needs_old_adapter(self.actor.loss)
        if algo.old_policy != defaults.old_policy and not uses_old:
            raise ConfigError(
                f"algorithm.old_policy has no effect with actor.loss.mode={mode} (no `old` adapter): leave it "
                "at its defaults, or use an algorithm with an `old` adapter (docs/algorithms.md), e.g. "
                "diffusion_nft, or awm with actor.loss.awm_ema_kl_coef > 0"
            )
        if uses_old and self.model.lora.rank <= 0:
            raise ConfigError(
                f"actor.loss.mode={mode} needs an `old` adapter, which exists only with LoRA: set "
                "model.lora.rank > 0"
            )

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

    def _check_sharding_settings(self) -> None:
        """FSDP2 settings that would do nothing: actor.param_offload is FSDP2's CPU offload, which a
        replicated or unsharded strategy does not run (one worker shards on a one-rank group)."""
        actor = self.actor
        require(
            not (actor.param_offload and actor.strategy in ("ddp", "none")),
            "actor.param_offload",
            actor.param_offload,
            f"does nothing with actor.strategy={actor.strategy}: it is FSDP2's CPU offload; set "
            "actor.strategy=fsdp2 (or auto, which then shards, also on one worker)",
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
        and with rollout correction (it needs a second log-prob), eagerly and compiled alike: an
        eager sampler's slices are not the trainer's forwards either (DanceGRPO's step subsets,
        micro sizes that do not divide), and the gap is a ratio off 1 by float rounding (~1e-7
        in fp32 on a CPU, far more in bf16 on a GPU), which the check at start refuses. Batched replay
        (actor.replay_steps_per_forward > 1) recomputes: the update's forwards have k·B rows, the
        sampler's B, and larger matmuls round differently; the recompute groups its forwards as
        the update does, so the ratio starts at exactly 1 (diffrl.train.replay). Sampling with the
        adapter merged into the weights (model.lora.merge_inference) recomputes: the merged matmul
        rounds differently from the adapter's, and the recompute runs the adapter as the update does.
        Sampling in float8 while the trainer computes in 16 bits (model.fp8=sampling) recomputes too.

        Separate placement recomputes: a replica runs its own copy of the module (no FSDP
        mixed-precision casts), and in one_step_off (bounded) mode it
        samples one (up to trainer.max_staleness) weight version behind the trainer, so the
        recomputed log-probs are the proximal policy and the rollout's are the behaviour policy
        (docs/async.md).
        """
        algo, rc = self.algorithm, self.algorithm.rollout_correction
        if algo.old_log_probs != "auto":
            return algo.old_log_probs == "rollout"
        if (
            self.actor.replay_steps_per_forward > 1
            or self.trainer.placement == "separate"
            or self.model.lora.merge_inference
            or self.model.fp8 == "sampling"
        ):
            return False
        return (
            algo.timestep_fraction >= 1.0
            and self.rollout.micro_batch_size % self.actor.micro_batch_size == 0
            and rc.is_level == "none"
            and rc.rejection == "none"
        )

    @property
    def _request_size(self) -> int:
        """Samples in one replica request: whole prompt groups of one sampler micro-batch."""
        return request_size(self)

    @property
    def rollout_passes(self) -> tuple[str, ...]:
        """Deprecated: the run plan decides where the passes without gradient run
        (`diffrl.config.plan.resolve_plan(cfg).rollout_passes`, with the machine's facts); this is
        that plan's answer without them, kept until the last test reading it moves to the plan."""
        from diffrl.config.plan import resolve_plan

        return resolve_plan(self).rollout_passes

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
