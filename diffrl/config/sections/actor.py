"""`actor.*`: the training engine's batching, parallelism and offload, the optimizer, and the
loss (`actor.loss`: the shared keys plus every registered algorithm's own settings)."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields, make_dataclass

from diffrl.config.checks import ConfigError, require, require_at_least, require_choice, require_positive
from diffrl.config.choices import KL_STD_CHOICES
from diffrl.config.registries import algorithm, algorithm_settings, algorithms


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
