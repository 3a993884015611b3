"""What each algorithm declares about itself; the table the loops and the config read is the config's
(`diffrl.config.registries`), re-exported here.

Every algorithm file ends with one `register_algorithm(...)` call. The declaration says which loop
feeds the algorithm, what that loop must prepare for it, its own `actor.loss` settings and its
metrics; the trainers, the run driver and the config schema ask the declaration, never the name:

    register_algorithm(PolicyGradientSpec(
        name="flow_dppo",                      # actor.loss.mode
        loss=FlowDPPOLoss,                     # compute(LossInputs, StepOut, cfg) per window step
        settings=FlowDPPOSettings,             # its keys under actor.loss, validated there
        metrics=METRIC_NAMES,                  # logged under actor/
        needs_old_mean=True,                   # LossInputs.old_mean is filled
    ))

Three kinds of entries, one per loop, because the loss signatures differ:

- `PolicyGradientSpec`: the loss scores the SDE transitions of the rollout (one call per window
  step, `LossInputs` + `diffrl.sde.StepOut`), fed by `diffrl.controller.policy_gradient`;
- `DirectPreferenceSpec`: the loss noises clean samples afresh (the forward process), fed by
  `diffrl.controller.direct_preference`; its `term` computes one micro-batch's loss at one noise
  level from the network's velocities (`Velocities`), which the shared accumulation loop calls.
- `DistillationSpec`: a few-step student trained against the base model as teacher (adapters off)
  and auxiliary adapters of its own (DMD2's fake score), fed by `diffrl.controller.distillation`.

The KL-to-reference penalty is not an algorithm (it adds to any policy-gradient loss when
`actor.loss.kl_coef > 0`): it is `diffrl.algos.kl.KLLoss`, outside this table.

This module and the declarations import no torch (the algorithm files defer it, see
`diffrl.lazy`), so `diffrl config` validates a config in well under a second.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

# The table itself and the loops' names are the config's (the schema composes `actor.loss` from the
# declarations' settings): diffrl.config.registries. They are re-exported here for the loops.
from diffrl.config.registries import (
    ALGORITHMS,
    DIRECT_PREFERENCE,
    DISTILLATION,
    LOOPS,
    PAIRS,
    POLICY_GRADIENT,
    SAMPLES,
    algorithm,
    algorithm_settings,
    algorithms,
    explain_not_an_algorithm,
    register_algorithm,
    settings_keys,
)

__all__ = [
    "ALGORITHMS",
    "DIRECT_PREFERENCE",
    "DISTILLATION",
    "LOOPS",
    "PAIRS",
    "POLICY_GRADIENT",
    "SAMPLES",
    "AlgorithmSpec",
    "DirectPreferenceSpec",
    "DistillationSpec",
    "PolicyGradientSpec",
    "Velocities",
    "algorithm",
    "algorithm_settings",
    "algorithms",
    "explain_not_an_algorithm",
    "register_algorithm",
    "settings_keys",
    "uses_old_adapter",
    "worker_options",
]


class Velocities(Protocol):
    """The network's fp32 velocity at (x_t, σ_B) under each policy a forward-process term may read;
    `trained` carries the gradient, `old` (the `old` adapter) and `reference` do not. A term that
    has the trained velocity at the same point passes it to `old` as `trained`: when the old
    adapter's weights equal the trained one's, `old` returns it detached instead of running the
    network again."""

    def trained(self, x_t: Any, sigmas_B: Any, cond: Any) -> Any: ...

    def old(self, x_t: Any, sigmas_B: Any, cond: Any, trained: Any = None) -> Any: ...

    def reference(self, x_t: Any, sigmas_B: Any, cond: Any) -> Any: ...


def _never(loss_cfg: Any) -> bool:
    return False


@dataclass(frozen=True)
class AlgorithmSpec:
    """What every algorithm declares (see the module docstring).

    name:     the `actor.loss.mode` value that selects it
    loss:     the loss class, constructed without arguments
    settings: a dataclass of its own `actor.loss` keys, with a `validate(at)` method; None if it
              has none (the shared keys `clip_ratio`, `adv_clip_max`, `kl_coef`, `kl_std` are the
              schema's)
    metrics:  the names its loss returns, logged under `actor/`
    """

    loop: ClassVar[str]

    name: str
    loss: Callable[[], Any]
    settings: type | None = None
    metrics: tuple[str, ...] = ()


@dataclass(frozen=True)
class PolicyGradientSpec(AlgorithmSpec):
    """A loss on the rollout's SDE transitions; `needs_old_mean`: the loop fills `LossInputs.old_mean`
    (the rollout's stored SDE means when its log-probs are reused, else recomputed ones)."""

    loop: ClassVar[str] = POLICY_GRADIENT

    needs_old_mean: bool = False


@dataclass(frozen=True)
class DirectPreferenceSpec(AlgorithmSpec):
    """A forward-process loss on clean samples.

    term:              the per-micro-batch loss at one noise level, called by the shared loop:
                       SAMPLES: term(batch, noise, sigmas_B, loss_cfg, velocities, adv_mode)
                       PAIRS:   term(batch, noise, sigmas_P, loss_cfg, velocities)
                       -> (scalar loss with grad, metrics)
    trains_on:         SAMPLES or PAIRS (pairs can also come from an offline dataset)
    samples_with_old:  the rollout samples with the `old` adapter instead of the trained one
    needs_old_adapter: whether, under these `actor.loss` settings, it reads the `old` adapter
    needs_reference:   it always reads the reference (not only when `kl_coef > 0`): under full
                       fine-tuning the workers then keep a frozen copy
    """

    loop: ClassVar[str] = DIRECT_PREFERENCE

    term: Callable[..., Any] = field(default=None)  # type: ignore[assignment]
    trains_on: str = SAMPLES
    samples_with_old: bool = False
    needs_old_adapter: Callable[[Any], bool] = _never
    needs_reference: bool = False

    def __post_init__(self) -> None:
        if self.term is None:
            raise ValueError(f"algorithm {self.name!r}: a direct-preference algorithm needs its `term`")
        if self.trains_on not in (SAMPLES, PAIRS):
            raise ValueError(
                f"algorithm {self.name!r}: trains_on={self.trains_on!r} must be {SAMPLES!r} or {PAIRS!r}"
            )


@dataclass(frozen=True)
class DistillationSpec(AlgorithmSpec):
    """A few-step student distilled from the base (the teacher, adapters off), fed by
    `diffrl.controller.distillation`.

    loss:         computes the student's loss from its inputs (`compute(inputs, loss_cfg)`)
    fake_metrics: the names the auxiliary adapters' updates report, logged under `actor/`
    adapters:     the LoRA adapters it trains besides the student (the trained `default` one)
    """

    loop: ClassVar[str] = DISTILLATION

    fake_metrics: tuple[str, ...] = ()
    adapters: tuple[str, ...] = ()


def uses_old_adapter(loss_cfg: Any) -> bool:
    """Whether the algorithm of `actor.loss` (`loss_cfg`), with these settings, reads the `old` adapter."""
    spec = algorithm(loss_cfg.mode)
    return isinstance(spec, DirectPreferenceSpec) and spec.needs_old_adapter(loss_cfg)


def worker_options(cfg: Any) -> dict[str, Any]:
    """What the workers' engines need beyond the config (`cfg`, the whole `Config`): an `old`
    adapter (DiffusionNFT, AWM's EMA KL) and, for DPO under full fine-tuning, a frozen reference
    copy (its reference term is not a KL coefficient the engine would see)."""
    spec = algorithm(cfg.actor.loss.mode)
    if not isinstance(spec, DirectPreferenceSpec):
        return {}
    options: dict[str, Any] = {"with_old": uses_old_adapter(cfg.actor.loss)}
    if spec.needs_reference:
        options["with_reference"] = True
    return options
