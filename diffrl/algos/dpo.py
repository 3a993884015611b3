"""Diffusion-DPO on flow matching: preference pairs, a shared noise level per pair, the DPO loss.

References: Wallace et al., "Diffusion Model Alignment Using Direct Preference Optimization"
(arXiv 2311.12908) and diffusers' DPO training script; VeRL-Omni's `dpo` loss mode (velocity form);
docs/algorithms.md ("dpo").

For P pairs of clean samples of one prompt, a preferred (chosen, w) and a dispreferred
(rejected, l) one, each pair shares one noise ε and one noise level t:

    x_t = (1 − t)·x₀ + t·ε,   u = ε − x₀                          per sample, ε and t per pair
    e_π(x) = mean_elems((v_π(x_t, t) − u)²)                       π = θ (trained) or ref
    Δ_w = e_θ(w) − e_ref(w),   Δ_l = e_θ(l) − e_ref(l)
    z   = −(β/2)·(Δ_w − Δ_l)                                       β = dpo_beta
    L   = −mean_pairs log σ(z)

z > 0 means the trained policy improved (relative to the reference) more on the chosen sample
than on the rejected one. The paper's objective has −β·T·ω(λ_t)/2 in front of the bracket: with
the constant weighting used in practice, T·ω is folded into β (so `dpo_beta` is large: 2000 by
default, 100 in some recipes), exactly as diffusers' script does.

Implicit rewards (the quantities DPO compares): r̂_w = −(β/2)·Δ_w and r̂_l = −(β/2)·Δ_l, so
z = r̂_w − r̂_l; the metrics report their means and the margin.

Online (rollouts scored by a reward model) the pairs come from `preference_pairs`: the best and
the worst sample of each prompt group. Offline they come from a preference dataset. Either way
the trainer then draws t per pair with `sample_logit_normal_sigmas` and ε per pair, builds
`DPOInputs`, runs the trained and the reference network once each on `batch.noisy_latents` (the
2P samples, chosen first) and calls `DPOLoss().compute(batch, velocity, actor.loss)`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from diffrl.algos.advantages import group_index
from diffrl.algos.flow_matching import interpolate
from diffrl.algos.spec import PAIRS, DirectPreferenceSpec, Velocities, register_algorithm
from diffrl.config.checks import require_positive
from diffrl.lazy import lazy_import

if TYPE_CHECKING:
    from diffrl.config.schema import LossConfig

torch = lazy_import("torch")  # deferred: see diffrl.lazy


def preference_pairs(
    rewards_B: torch.Tensor, uids: Sequence[Hashable] | np.ndarray | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen_P, rejected_P): per prompt group, the index of its best and of its worst sample.

    Groups are visited in order of first appearance. Ties: the best is the first sample with the
    group's maximum reward, the worst the first with its minimum. A group whose maximum equals
    its minimum (all rewards tie, or a single sample) has no preference and gives no pair, so P
    can be anything from 0 to the number of groups. Returns two int64 (P,) CPU tensors.
    """
    if not isinstance(rewards_B, torch.Tensor) or rewards_B.ndim != 1 or rewards_B.numel() == 0:
        raise ValueError("rewards_B must be a non-empty 1-D tensor (one reward per sample)")
    rewards = rewards_B.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError(f"rewards_B has non-finite values: {rewards.tolist()[:10]}")
    group_B = group_index(uids, rewards.shape[0])
    chosen, rejected = [], []
    for g in range(int(group_B.max()) + 1):
        members = (group_B == g).nonzero().flatten()
        values = rewards[members]
        best, worst = values.max(), values.min()
        if best == worst:
            continue
        # first index attaining the extreme (nonzero is ascending)
        chosen.append(int(members[(values == best).nonzero()[0, 0]]))
        rejected.append(int(members[(values == worst).nonzero()[0, 0]]))
    return torch.tensor(chosen, dtype=torch.int64), torch.tensor(rejected, dtype=torch.int64)


def sample_logit_normal_sigmas(
    generators: torch.Generator | Sequence[torch.Generator],
    num: int | None = None,
    *,
    mean: float = 0.0,
    std: float = 1.0,
    shift: float = 1.0,
) -> torch.Tensor:
    """Noise levels σ ∈ (0, 1), fp32 on the CPU, from the logit-normal density (SD3 training):

        z ~ N(0, 1),  u = sigmoid(mean + std·z),  σ = shift·u / (1 + (shift − 1)·u)

    `shift` > 1 moves mass toward σ = 1 (the time shift of the samplers; 1 = none). Pass one
    generator per draw (a sequence: draw i comes from generators[i] only, so it does not depend on
    the batch) or one generator and `num`.
    """
    if not std > 0 or not shift > 0:
        raise ValueError(f"logit-normal needs std > 0 and shift > 0, got std={std}, shift={shift}")
    if isinstance(generators, torch.Generator):
        if num is None or num < 1:
            raise ValueError(f"with a single generator pass num >= 1 draws, got num={num}")
        z = torch.randn(num, generator=generators, dtype=torch.float64)
    else:
        generators = list(generators)
        if not generators or (num is not None and num != len(generators)):
            raise ValueError(f"got {len(generators)} generators for num={num}: pass one per draw")
        z = torch.cat([torch.randn(1, generator=g, dtype=torch.float64) for g in generators])
    u = torch.sigmoid(mean + std * z)
    return (shift * u / (1.0 + (shift - 1.0) * u)).float()


@dataclass
class DPOInputs:
    """P preference pairs sharing one noise ε and one noise level t per pair.

    chosen_latents:   (P, ...) clean latents x₀ of the preferred samples.
    rejected_latents: (P, ...) clean latents of the dispreferred samples (same shape).
    noise:            (P, ...) one ε per pair.
    sigmas_P:         (P,) one t ∈ (0, 1] per pair (`sample_logit_normal_sigmas`).
    ref_velocity:     (2P, ...) the reference's velocity on `noisy_latents` (chosen rows first),
                      no grad; computed with adapters disabled or a frozen copy.

    The 2P-row views the networks consume, chosen rows first: `latents`, `noisy_latents`,
    `sigmas_2P`, `target` (u = ε − x₀).
    """

    chosen_latents: torch.Tensor
    rejected_latents: torch.Tensor
    noise: torch.Tensor
    sigmas_P: torch.Tensor
    ref_velocity: torch.Tensor

    def __post_init__(self) -> None:
        shape = tuple(self.chosen_latents.shape)
        if len(shape) < 2 or shape[0] == 0:
            raise ValueError(f"chosen_latents must have shape (P, ...) with P >= 1, got {shape}")
        for name in ("rejected_latents", "noise"):
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"{name} must have shape {shape} like chosen_latents")
        if tuple(self.sigmas_P.shape) != (shape[0],):
            raise ValueError(f"sigmas_P must have shape ({shape[0]},), got {tuple(self.sigmas_P.shape)}")
        if tuple(self.ref_velocity.shape) != (2 * shape[0], *shape[1:]):
            raise ValueError(
                f"ref_velocity must have shape {(2 * shape[0], *shape[1:])} (chosen rows, then rejected), "
                f"got {tuple(self.ref_velocity.shape)}"
            )

    @property
    def num_pairs(self) -> int:
        return self.chosen_latents.shape[0]

    @property
    def latents(self) -> torch.Tensor:
        return torch.cat([self.chosen_latents, self.rejected_latents])

    @property
    def sigmas_2P(self) -> torch.Tensor:
        return torch.cat([self.sigmas_P, self.sigmas_P])

    @property
    def noisy_latents(self) -> torch.Tensor:
        """x_t of the 2P samples (chosen first), each pair at its shared ε and t."""
        return interpolate(self.latents, torch.cat([self.noise, self.noise]), self.sigmas_2P)

    @property
    def target(self) -> torch.Tensor:
        """u = ε − x₀ of the 2P samples (chosen first)."""
        return torch.cat([self.noise, self.noise]) - self.latents


METRIC_NAMES = (
    "dpo_loss",
    "implicit_acc",
    "reward_chosen",
    "reward_rejected",
    "reward_margin",
    "mse_chosen",
    "mse_rejected",
)


def dpo_logits(
    velocity: torch.Tensor, ref_velocity: torch.Tensor, target: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(z_P, Δ_w_P, Δ_l_P) for 2P rows (chosen first); differentiable in `velocity` only."""
    dtype = torch.promote_types(velocity.dtype, torch.float32)
    u = target.detach().to(dtype)
    err = (velocity.to(dtype) - u).pow(2).flatten(1).mean(dim=1)
    ref_err = (ref_velocity.detach().to(dtype) - u).pow(2).flatten(1).mean(dim=1)
    pairs = velocity.shape[0] // 2
    gap_w = err[:pairs] - ref_err[:pairs]
    gap_l = err[pairs:] - ref_err[pairs:]
    return -0.5 * beta * (gap_w - gap_l), gap_w, gap_l


class DPOLoss:
    """Diffusion-DPO loss. Reads `cfg.dpo_beta`.

    `compute(batch: DPOInputs, velocity, cfg)`: `velocity` is the trained network's (2P, ...)
    prediction on `batch.noisy_latents` at `batch.sigmas_2P`, chosen rows first, with grad.

    Metrics (plain floats, over the P pairs):
        dpo_loss          L (the returned loss)
        implicit_acc      fraction of pairs with z > 0 (a tie, z = 0, is not a success)
        reward_chosen     mean(−(β/2)·Δ_w), the implicit reward of the chosen samples
        reward_rejected   mean(−(β/2)·Δ_l)
        reward_margin     mean(z) = reward_chosen − reward_rejected
        mse_chosen, mse_rejected   mean flow-matching error e_θ of each side
    """

    def compute(
        self, batch: DPOInputs, velocity: torch.Tensor, cfg: LossConfig
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if not isinstance(batch, DPOInputs) or not isinstance(velocity, torch.Tensor):
            raise ValueError(
                "the dpo loss trains on preference pairs: call it with DPOInputs and the network's "
                "velocity on batch.noisy_latents (the direct-preference trainer), not with an SDE "
                f"step's LossInputs/StepOut (got {type(batch).__name__}, {type(velocity).__name__})"
            )
        if velocity.shape != batch.ref_velocity.shape:
            raise ValueError(
                f"velocity has shape {tuple(velocity.shape)}; it must be the 2P rows of "
                f"batch.noisy_latents, {tuple(batch.ref_velocity.shape)}, chosen first"
            )
        beta = cfg.dpo_beta
        if not beta > 0:
            raise ValueError(f"actor.loss.dpo_beta must be > 0, got {beta}")
        z_P, gap_w, gap_l = dpo_logits(velocity, batch.ref_velocity, batch.target, beta)
        loss = torch.nn.functional.softplus(-z_P).mean()  # −log σ(z), stable for large |z|

        with torch.no_grad():
            pairs = batch.num_pairs
            err = (velocity.detach().double() - batch.target.double()).pow(2).flatten(1).mean(dim=1)
            stats = torch.stack(
                [
                    loss.detach().double(),
                    (z_P.detach() > 0).double().mean(),
                    (-0.5 * beta * gap_w.detach().double()).mean(),
                    (-0.5 * beta * gap_l.detach().double()).mean(),
                    z_P.detach().double().mean(),
                    err[:pairs].mean(),
                    err[pairs:].mean(),
                ]
            ).tolist()  # one device sync
        return loss, dict(zip(METRIC_NAMES, stats, strict=True))


# ------------------------------------------------------------------------- declaration
@dataclass
class DPOSettings:
    """Diffusion-DPO's keys under `actor.loss`."""

    dpo_beta: float = 2000.0  # β of Diffusion-DPO (recipes use 100 to 5000)

    def validate(self, at: str) -> None:
        require_positive(f"{at}.dpo_beta", self.dpo_beta)


def dpo_term(
    batch: Any, noise: torch.Tensor, sigmas_P: torch.Tensor, cfg: LossConfig, net: Velocities
) -> tuple[torch.Tensor, dict[str, float]]:
    """The Diffusion-DPO loss of a micro-batch of pairs (`chosen_latents`, `rejected_latents`,
    `cond` without CFG negatives): the 2P rows (chosen first) share each pair's ε and σ; the
    reference is the base model (adapters disabled, or the frozen copy of full fine-tuning)."""
    latents = torch.cat([batch.chosen_latents, batch.rejected_latents])
    sigmas_2P = torch.cat([sigmas_P, sigmas_P])
    x_t = interpolate(latents, torch.cat([noise, noise]), sigmas_2P)
    cond = torch.cat([batch.cond, batch.cond])
    v_ref = net.reference(x_t, sigmas_2P, cond)
    v = net.trained(x_t, sigmas_2P, cond)
    inputs = DPOInputs(batch.chosen_latents, batch.rejected_latents, noise, sigmas_P.to(v.device), v_ref)
    return DPOLoss().compute(inputs, v, cfg)


register_algorithm(
    DirectPreferenceSpec(
        name="dpo",
        loss=DPOLoss,
        settings=DPOSettings,
        metrics=METRIC_NAMES,
        term=dpo_term,
        trains_on=PAIRS,
        needs_reference=True,  # its loss compares with the reference, whatever kl_coef is
    )
)
