"""DiffusionNFT: negative-aware fine-tuning on the forward (noising) process, and its old policy.

References: Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process"
(arXiv 2509.16117) and its code (NVlabs/DiffusionNFT, `train_nft_sd3.py`); VeRL-Omni's
`diffusion_nft` loss mode; docs/algorithms.md ("diffusion_nft", "Old policy").

Instead of scoring SDE transitions, NFT trains on the clean rollout samples x₀ with a
flow-matching-style loss. Each sample gets an optimality probability r from its advantage, and
the network is trained so that an implicit *positive* policy fits the good samples and an implicit
*negative* policy fits the bad ones, both defined around the frozen `old` policy:

    Â  = clamp(A, −c, c),   r = clamp(Â/(2c) + ½, 0, 1)          c = adv_clip_max; r ∈ [0, 1]
    x_t = (1 − t)·x₀ + t·ε                                       fresh ε, t from the rollout's sigmas
    v⁺ = β·v_θ + (1 − β)·v_old                                   implicit positive velocity
    v⁻ = (1 + β)·v_old − β·v_θ                                   implicit negative velocity
    x̂₀± = x_t − t·v±                                             their clean-sample predictions
    w±_i = max(mean_elems|x̂₀± − x₀|, w_min)                       adaptive weights, detached
    ℓ_i = (r_i·mean_elems((x̂₀⁺ − x₀)²)/w⁺_i + (1 − r_i)·mean_elems((x̂₀⁻ − x₀)²)/w⁻_i) / β
    L  = c·mean_i ℓ_i + kl_coef·mean_i mean_elems((v_θ − v_ref)²)

β = `mix_beta`, w_min = `nft_weight_min`. v⁺ and v⁻ are mirror images around v_old
(v⁺ + v⁻ = 2·v_old), so the positive term pulls v_θ toward the good samples' targets and the
negative term pushes it away from the bad ones; dividing by β makes the gradient in v_θ
independent of β (∂x̂₀±/∂v_θ = ∓β·t). The adaptive weights normalise each sample's error by its
own current size (the x₀-prediction analogue of a per-sample loss scale). With v_θ = v_old the
two terms are the old policy's errors, and r = ½ samples (zero advantage) are pulled both ways
equally.

The old policy: every `algorithm.old_policy.update_interval` optimizer steps the `old` adapter
follows the trained one, old ← d·old + (1 − d)·θ (d = 0 copies), with d from
`old_policy_decay(schedule, step)`; see `ema_update_`, which has the convention of
`diffrl.train.engine.Engine.ema_adapter`.

Also here: `timestep_subset`, the per-sample random fraction of a trajectory's steps that NFT
(and DanceGRPO, `algorithm.timestep_fraction`) trains on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diffrl.algos.flow_matching import interpolate
from diffrl.algos.spec import SAMPLES, DirectPreferenceSpec, Velocities, register_algorithm
from diffrl.config.checks import require_positive
from diffrl.config.choices import NFT_ADV_MODES
from diffrl.lazy import lazy_import

if TYPE_CHECKING:
    from diffrl.config.schema import LossConfig

torch = lazy_import("torch")  # deferred: see diffrl.lazy

# ------------------------------------------------------------------------ optimality probability


def optimality_probability(
    advantages_B: torch.Tensor, adv_clip_max: float, mode: str = "continuous"
) -> torch.Tensor:
    """r = clamp(Â/(2c) + ½, 0, 1) per sample, from advantages clamped to ±c (c = `adv_clip_max`).

    `mode` reshapes Â first (the reference's `adv_mode`):
        continuous      Â = clamp(A, −c, c)                    (default)
        positive_only   Â = clamp(A, 0, c)        only better-than-average samples move r above ½
        negative_only   Â = clamp(A, −c, 0)       only worse-than-average samples move r below ½
        one_only        Â = 1 if A > 0 else 0
        binary          Â = sign(A)
    Returns a new (B,) tensor in the advantages' dtype, no grad.
    """
    if not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
    adv_B = advantages_B.detach().clamp(-adv_clip_max, adv_clip_max)
    if mode == "positive_only":
        adv_B = adv_B.clamp_min(0.0)
    elif mode == "negative_only":
        adv_B = adv_B.clamp_max(0.0)
    elif mode == "one_only":
        adv_B = (adv_B > 0).to(adv_B.dtype)
    elif mode == "binary":
        adv_B = torch.sign(adv_B)
    elif mode != "continuous":
        raise ValueError(f"algorithm.adv_mode must be one of {list(NFT_ADV_MODES)}, got {mode!r}")
    return (adv_B / (2.0 * adv_clip_max) + 0.5).clamp(0.0, 1.0)


# ------------------------------------------------------------------------------------- the loss
def implicit_velocities(
    velocity: torch.Tensor, old_velocity: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(v⁺, v⁻) = (β·v_θ + (1 − β)·v_old, (1 + β)·v_old − β·v_θ); v_old is detached."""
    old = old_velocity.detach()
    return beta * velocity + (1.0 - beta) * old, (1.0 + beta) * old - beta * velocity


def adaptive_weight(x0_pred: torch.Tensor, latents: torch.Tensor, weight_min: float) -> torch.Tensor:
    """w = max(mean_elems|x̂₀ − x₀|, w_min) per sample (B,), computed in float64, detached."""
    with torch.no_grad():
        gap_B = (x0_pred.detach().double() - latents.detach().double()).abs().flatten(1).mean(dim=1)
        return gap_B.clamp_min(weight_min)


@dataclass
class NFTInputs:
    """One micro-batch of B clean rollout samples, each at one training noise level t.

    reward_prob_B:  (B,) optimality probability r ∈ [0, 1] (`optimality_probability`), constant.
    latents:        (B, ...) clean final latents x₀ of the rollout.
    noisy_latents:  (B, ...) x_t = (1 − t)·x₀ + t·ε, the network's input.
    sigmas_B:       (B,) the noise level t of each sample (the σ the network was called at).
    old_velocity:   (B, ...) the `old` adapter's velocity at (x_t, t), no grad.
    ref_velocity:   (B, ...) the reference's velocity (adapters disabled); needed when kl_coef > 0.
    """

    reward_prob_B: torch.Tensor
    latents: torch.Tensor
    noisy_latents: torch.Tensor
    sigmas_B: torch.Tensor
    old_velocity: torch.Tensor
    ref_velocity: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.reward_prob_B.ndim != 1:
            raise ValueError(f"reward_prob_B must have shape (B,), got {tuple(self.reward_prob_B.shape)}")
        batch = self.reward_prob_B.shape[0]
        if self.latents.ndim < 2 or self.latents.shape[0] != batch:
            raise ValueError(f"latents must have shape ({batch}, ...), got {tuple(self.latents.shape)}")
        for name in ("noisy_latents", "old_velocity", "ref_velocity"):
            value = getattr(self, name)
            if value is not None and value.shape != self.latents.shape:
                raise ValueError(
                    f"{name} must have the latents' shape {tuple(self.latents.shape)}, got {tuple(value.shape)}"
                )
        if tuple(self.sigmas_B.shape) != (batch,):
            raise ValueError(f"sigmas_B must have shape ({batch},), got {tuple(self.sigmas_B.shape)}")
        if not bool(((self.reward_prob_B >= 0) & (self.reward_prob_B <= 1)).all()):
            raise ValueError("reward_prob_B must lie in [0, 1]: build it with optimality_probability()")


METRIC_NAMES = ("policy_loss", "positive_loss", "negative_loss", "old_deviate", "reward_prob_mean")


class DiffusionNFTLoss:
    """DiffusionNFT loss. Reads `cfg.mix_beta`, `cfg.adv_clip_max`, `cfg.nft_weight_min`, `cfg.kl_coef`.

    `compute(batch: NFTInputs, velocity, cfg)`: `velocity` is the current network's (B, ...)
    prediction at (x_t, t), with grad (the role of `policy_out`). The trainer calls it once per
    micro-batch and trained timestep: x_t from `interpolate(x0, fresh ε, t)`
    (`diffrl.algos.flow_matching`), v_θ from the trained adapter, v_old from the `old` adapter and,
    when kl_coef > 0, v_ref with adapters disabled, the last two without grad.

    Metrics (plain floats, over the B samples):
        policy_loss       c·mean(ℓ)
        positive_loss     mean_i mean_elems((x̂₀⁺ − x₀)²)/w⁺_i
        negative_loss     mean_i mean_elems((x̂₀⁻ − x₀)²)/w⁻_i
        old_deviate       mean((v_θ − v_old)²): how far the trained policy is from the old one
        reward_prob_mean  mean(r)
        kl                mean((v_θ − v_ref)²) (only when kl_coef > 0)
    """

    def compute(
        self, batch: NFTInputs, velocity: torch.Tensor, cfg: LossConfig
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if not isinstance(batch, NFTInputs) or not isinstance(velocity, torch.Tensor):
            raise ValueError(
                "the diffusion_nft loss trains on clean rollout samples on the forward process: call it "
                "with NFTInputs and the network's velocity (the direct-preference trainer), not with an "
                f"SDE step's LossInputs/StepOut (got {type(batch).__name__}, {type(velocity).__name__})"
            )
        if velocity.shape != batch.latents.shape:
            raise ValueError(
                f"velocity has shape {tuple(velocity.shape)} but the latents have "
                f"{tuple(batch.latents.shape)}; they must be the same samples"
            )
        beta = cfg.mix_beta
        if not beta > 0:
            raise ValueError(f"actor.loss.mix_beta must be > 0 (the loss divides by it), got {beta}")
        dtype = torch.promote_types(velocity.dtype, torch.float32)
        v = velocity.to(dtype)
        x0 = batch.latents.detach().to(dtype)
        x_t = batch.noisy_latents.detach().to(dtype)
        t = batch.sigmas_B.detach().to(dtype).view(-1, *([1] * (v.ndim - 1)))
        r_B = batch.reward_prob_B.detach().to(dtype)

        v_pos, v_neg = implicit_velocities(v, batch.old_velocity.to(dtype), beta)
        x0_pos = x_t - t * v_pos
        x0_neg = x_t - t * v_neg
        w_pos_B = adaptive_weight(x0_pos, x0, cfg.nft_weight_min).to(dtype)
        w_neg_B = adaptive_weight(x0_neg, x0, cfg.nft_weight_min).to(dtype)
        pos_B = (x0_pos - x0).pow(2).flatten(1).mean(dim=1) / w_pos_B
        neg_B = (x0_neg - x0).pow(2).flatten(1).mean(dim=1) / w_neg_B
        per_sample_B = (r_B * pos_B + (1.0 - r_B) * neg_B) / beta
        policy_loss = cfg.adv_clip_max * per_sample_B.mean()
        loss = policy_loss
        extra: dict[str, torch.Tensor] = {}
        if cfg.kl_coef > 0:
            if batch.ref_velocity is None:
                raise ValueError(
                    f"the diffusion_nft loss has kl_coef={cfg.kl_coef} > 0 but batch.ref_velocity is None: "
                    "compute the reference velocity (adapters disabled) at (x_t, t), or set kl_coef=0"
                )
            kl = (v - batch.ref_velocity.detach().to(dtype)).pow(2).flatten(1).mean(dim=1).mean()
            loss = loss + cfg.kl_coef * kl
            extra["kl"] = kl.detach().double()

        with torch.no_grad():
            stats = torch.stack(
                [
                    policy_loss.detach().double(),
                    pos_B.detach().double().mean(),
                    neg_B.detach().double().mean(),
                    (v.detach() - batch.old_velocity.detach().to(dtype)).double().pow(2).mean(),
                    r_B.double().mean(),
                    *extra.values(),
                ]
            ).tolist()  # one device sync
        return loss, dict(zip(METRIC_NAMES + tuple(extra), stats, strict=True))


# ----------------------------------------------------------------------------------- old policy
# name -> (flat steps w, rate a, ceiling m):  d(step) = 0 if step < w else min((step − w)·a, m)
OLD_POLICY_SCHEDULES: dict[str, tuple[int, float, float]] = {
    "copy": (0, 0.0, 0.0),
    "linear_to_0_5": (0, 0.001, 0.5),
    "delayed_linear_to_0_999": (75, 0.0075, 0.999),
}


def old_policy_decay(schedule: str | float, step: int) -> float:
    """The EMA decay d ∈ [0, 1] of the `old` adapter at optimizer step `step` (0-based count).

    `schedule` is a name of `OLD_POLICY_SCHEDULES` (DiffusionNFT's decay types 0, 1, 2):
        copy                      d = 0                                   (old ← θ)
        linear_to_0_5             d = min(0.001·step, 0.5)
        delayed_linear_to_0_999   d = 0 for step < 75, then min(0.0075·(step − 75), 0.999)
    or a fixed decay (a float in [0, 1], `algorithm.old_policy.decay`), returned for every step.
    """
    if isinstance(schedule, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(
            f"old_policy_decay needs a schedule and an integer step >= 0, got {schedule!r}, {step!r}"
        )
    if isinstance(schedule, int | float):
        if not 0.0 <= schedule <= 1.0:
            raise ValueError(f"a fixed old-policy decay must be in [0, 1], got {schedule}")
        return float(schedule)
    if schedule not in OLD_POLICY_SCHEDULES:
        raise ValueError(
            f"unknown old-policy schedule {schedule!r}; choose one of {list(OLD_POLICY_SCHEDULES)} "
            "or a fixed decay in [0, 1]"
        )
    flat, rate, ceiling = OLD_POLICY_SCHEDULES[schedule]
    if step < flat:
        return 0.0
    return min((step - flat) * rate, ceiling)


def ema_update_(targets: Iterable[torch.Tensor], sources: Iterable[torch.Tensor], decay: float) -> None:
    """In place, pairwise: target ← decay·target + (1 − decay)·source (decay 0 copies exactly).

    The convention of `Engine.ema_adapter(decay, src=POLICY, dst=OLD)`: `targets` are the `old`
    adapter's tensors, `sources` the trained ones, in the same order and shapes. Sources are not
    modified; no autograd history is recorded.
    """
    with torch.no_grad():  # a decorator would load torch at import (diffrl.lazy)
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay {decay} must be in [0, 1]")
        targets, sources = list(targets), list(sources)
        if len(targets) != len(sources):
            raise ValueError(f"ema_update_ got {len(targets)} targets for {len(sources)} sources")
        for index, (dst, src) in enumerate(zip(targets, sources, strict=True)):
            if dst.shape != src.shape:
                raise ValueError(
                    f"ema_update_ pair {index}: target {tuple(dst.shape)} != source {tuple(src.shape)}"
                )
            if decay == 0.0:
                dst.copy_(src)
            else:
                dst.mul_(decay).add_(src.to(dst.dtype), alpha=1.0 - decay)


# ------------------------------------------------------------------------- timestep subsampling
def timestep_subset(num_steps: int, fraction: float, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Each sample's random subset of K = max(1, ⌊num_steps·fraction⌋) of its `num_steps` steps.

    Returns (B, K) int64 step indices, ascending in each row, distinct; row i is a uniformly random
    K-subset drawn from `generators[i]` alone (one CPU generator per sample, seeded from (seed,
    step, sample index)), so a sample's subset does not depend on the batch it is in.

    DiffusionNFT trains each sample at K of its rollout timesteps; DanceGRPO trains each sample on
    a random fraction (`algorithm.timestep_fraction`) of its steps. For a per-step loop as in the
    policy-gradient engine, `timestep_subset_mask` turns the indices into a (B, num_steps) mask
    that multiplies `LossInputs.weights_B` at each step: Σ_j mean_i(m_ij·ℓ_ij) is the reference's
    sum over its K iterations of mean_i ℓ_i(step_i,k); divide the accumulated gradient by K rather
    than num_steps to match its scale.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"timestep fraction must be in (0, 1], got {fraction}")
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    generators = list(generators)
    if not generators or not all(isinstance(g, torch.Generator) for g in generators):
        raise ValueError("timestep_subset needs a non-empty sequence of torch.Generator, one per sample")
    k = max(1, int(num_steps * fraction))
    rows = [torch.randperm(num_steps, generator=g)[:k].sort().values for g in generators]
    return torch.stack(rows)


def timestep_subset_mask(indices_BK: torch.Tensor, num_steps: int) -> torch.Tensor:
    """(B, num_steps) bool mask with True at each row's indices (from `timestep_subset`)."""
    mask = torch.zeros(indices_BK.shape[0], num_steps, dtype=torch.bool)
    return mask.scatter_(1, indices_BK.to(torch.int64), True)


# ------------------------------------------------------------------------- declaration
@dataclass
class NFTSettings:
    """DiffusionNFT's keys under `actor.loss` (`algorithm.adv_mode` picks how advantages become
    optimality probabilities)."""

    mix_beta: float = 0.1  # β of the implicit velocities v± around the old policy
    nft_weight_min: float = 1e-5  # floor of the adaptive per-sample weights

    def validate(self, at: str) -> None:
        require_positive(f"{at}.mix_beta", self.mix_beta)
        require_positive(f"{at}.nft_weight_min", self.nft_weight_min)


def nft_term(
    batch: Any, noise: torch.Tensor, sigmas_B: torch.Tensor, cfg: LossConfig, net: Velocities, adv_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """The DiffusionNFT loss of a micro-batch of clean samples (`latents`, `cond`, `advantages_B`)
    at one noise level per sample: v_θ, v_old (v_θ detached while the old adapter equals the
    trained one) and v_ref (when kl_coef > 0)."""
    x_t = interpolate(batch.latents, noise, sigmas_B)
    v = net.trained(x_t, sigmas_B, batch.cond)
    v_old = net.old(x_t, sigmas_B, batch.cond, trained=v)
    v_ref = net.reference(x_t, sigmas_B, batch.cond) if cfg.kl_coef > 0 else None
    reward_prob_B = optimality_probability(batch.advantages_B.to(v.device), cfg.adv_clip_max, adv_mode)
    inputs = NFTInputs(reward_prob_B, batch.latents, x_t, sigmas_B.to(v.device), v_old, v_ref)
    return DiffusionNFTLoss().compute(inputs, v, cfg)


register_algorithm(
    DirectPreferenceSpec(
        name="diffusion_nft",
        loss=DiffusionNFTLoss,
        settings=NFTSettings,
        metrics=METRIC_NAMES,
        term=nft_term,
        trains_on=SAMPLES,
        samples_with_old=True,
        needs_old_adapter=lambda cfg: True,  # its implicit velocities are built around the old policy
    )
)
