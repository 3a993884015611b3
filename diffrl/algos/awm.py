"""AWM, Advantage Weighted Matching: the pretraining flow-matching loss, reweighted by advantage.

Reference: Xue et al., "Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion
Models" (arXiv 2509.25050) and its code (scxue/advantage_weighted_matching, `train_sd3_awm.py`).
The paper shows that DDPO/Flow-GRPO's per-step likelihood is flow matching against a *noisy*
target; AWM instead scores each clean rollout sample x₀ with the flow-matching loss itself, at a
fresh noise ε and noise level σ, and weights it by the sample's advantage.

Per training noise level, for a micro-batch of B clean samples (x_σ = (1 − σ)·x₀ + σ·ε,
target u = ε − x₀, v_θ = the current network's velocity at (x_σ, σ)):

    e_i   = mean_elems((v_θ − u)²)                            the flow-matching error of sample i
    ℓ_i   = −w(σ_i)·φ(e_i)                                    the matching "log-likelihood"
    ρ_i   = exp(ℓ_i − ℓ_old,i)                                ℓ_old from the old policy's velocity at
                                                             the same (x_σ, σ, ε); on-policy ℓ_old =
                                                             ℓ_i, detached (ρ ≡ 1)
    Â_i   = clamp(A_i, −adv_clip_max, +adv_clip_max)
    L_pg  = (1/B)·Σ_i w_i·max(−Â_i·ρ_i, −Â_i·clamp(ρ_i, 1 − ε, 1 + ε))        ε = clip_ratio
    L     = L_pg + kl_coef·mean_i mean_elems((v_θ − v_ref)²)
                 + awm_ema_kl_coef·mean_i mean_elems((v_θ − v_ema)²)

On-policy (the recipes) ρ ≡ 1 and the gradient is exactly the advantage-weighted flow-matching
gradient: ∇L_pg = (1/B)·Σ_i Â_i·w(σ_i)·φ'(e_i)·∇e_i. High-advantage samples are pulled toward
their own target as in pretraining, low-advantage ones pushed away. The ratio/clip only matters
when the anchor is an older policy (off-policy reuse).

`cfg.awm_weighting` chooses w and φ (the reference's `weighting`):
    uniform    w = 1,   φ(e) = e            (docs/algorithms.md's form)
    sigma      w = σ,   φ(e) = e
    sigma_sq   w = σ²,  φ(e) = e
    ghuber     w = σ,   φ(e) = ((e + δ)^p − δ^p)/p,  δ = 1e-10, p = cfg.awm_ghuber_power
               (a generalised Huber: p = 1 is `sigma`, p < 1 damps large errors; recipes p = 0.25)

Both KL terms are the reference's "Uniform" KL on velocities (no 1/(2s²)): one to the reference
policy (adapters off), one to the `old` adapter (refreshed by EMA per algorithm.old_policy; the
reference's "ema" adapter). e and ℓ are computed in float64 (ratios of nearly equal errors).
The reference's `sum_first` variant (one ratio per sample from ℓ averaged over its training
noise levels) does not fit a per-noise-level call and is not provided; this is `exp_first`.

How the trainer calls it (one call per micro-batch and training noise level; see `AWMInputs`):

    x_t = interpolate(x0, eps, sigmas_B)                       diffrl.algos.flow_matching
    v = adapter.velocity(x_t, 1000·sigmas_B, cond, cfg_scale, ...)            with grad
    with no_grad: v_ref (adapters disabled) if kl_coef > 0; v_ema (`old` adapter) if
                  awm_ema_kl_coef > 0; v_old (`old` adapter) only for the off-policy variant
    loss, metrics = AWMLoss().compute(AWMInputs(adv_B, x0, eps, sigmas_B, ...), v, actor.loss)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diffrl.algos.base import CLIP_RATIO_METRICS, clip_ratio_stats, ppo_clip_terms
from diffrl.algos.flow_matching import interpolate
from diffrl.algos.spec import SAMPLES, DirectPreferenceSpec, Velocities, register_algorithm
from diffrl.config.checks import require_at_least, require_choice, require_positive
from diffrl.lazy import lazy_import

if TYPE_CHECKING:
    from diffrl.config.schema import LossConfig

torch = lazy_import("torch")  # deferred: see diffrl.lazy

AWM_WEIGHTINGS = ("uniform", "sigma", "sigma_sq", "ghuber")
GHUBER_DELTA = 1e-10

METRIC_NAMES = ("policy_loss", "matching_loss", *CLIP_RATIO_METRICS)


@dataclass
class AWMInputs:
    """One micro-batch of B clean rollout samples, each at one training noise level.

    advantages_B:   (B,) advantage of each sample (unclipped), constant.
    latents:        (B, ...) clean final latents x₀ of the rollout (fp32).
    noise:          (B, ...) the fresh ε used to build x_σ (same shape).
    sigmas_B:       (B,) noise level σ ∈ (0, 1] of each sample.
    old_velocity:   (B, ...) old policy's velocity at the same (x_σ, σ), no grad: the ratio's
                    anchor (off-policy reuse); None = on-policy (ρ ≡ 1).
    ref_velocity:   (B, ...) reference policy's velocity (adapters disabled); needed when kl_coef > 0.
    ema_velocity:   (B, ...) the `old` (EMA) adapter's velocity; needed when awm_ema_kl_coef > 0.
    weights_B:      (B,) per-sample weights on the policy term; None means all ones.
    """

    advantages_B: torch.Tensor
    latents: torch.Tensor
    noise: torch.Tensor
    sigmas_B: torch.Tensor
    old_velocity: torch.Tensor | None = None
    ref_velocity: torch.Tensor | None = None
    ema_velocity: torch.Tensor | None = None
    weights_B: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.advantages_B.ndim != 1:
            raise ValueError(f"advantages_B must have shape (B,), got {tuple(self.advantages_B.shape)}")
        batch = self.advantages_B.shape[0]
        if self.latents.ndim < 2 or self.latents.shape[0] != batch:
            raise ValueError(f"latents must have shape ({batch}, ...), got {tuple(self.latents.shape)}")
        for name in ("noise", "old_velocity", "ref_velocity", "ema_velocity"):
            value = getattr(self, name)
            if value is not None and value.shape != self.latents.shape:
                raise ValueError(
                    f"{name} must have the latents' shape {tuple(self.latents.shape)}, got {tuple(value.shape)}"
                )
        for name in ("sigmas_B", "weights_B"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (batch,):
                raise ValueError(f"{name} must have shape ({batch},), got {tuple(value.shape)}")


def matching_log_likelihood(
    velocity: torch.Tensor,
    target: torch.Tensor,
    sigmas_B: torch.Tensor,
    weighting: str,
    ghuber_power: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ℓ_B, e_B) in float64: ℓ = −w(σ)·φ(e), e = mean_elems((v − u)²); differentiable in `velocity`."""
    err_B = (velocity.double() - target.detach().double()).pow(2).flatten(1).mean(dim=1)
    sigma_B = sigmas_B.detach().double()
    if weighting == "uniform":
        return -err_B, err_B
    if weighting == "sigma":
        return -sigma_B * err_B, err_B
    if weighting == "sigma_sq":
        return -(sigma_B**2) * err_B, err_B
    if weighting == "ghuber":
        if not ghuber_power > 0:
            raise ValueError(f"actor.loss.awm_ghuber_power must be > 0, got {ghuber_power}")
        p = ghuber_power
        damped_B = ((err_B + GHUBER_DELTA) ** p - GHUBER_DELTA**p) / p
        return -sigma_B * damped_B, err_B
    raise ValueError(f"actor.loss.awm_weighting must be one of {list(AWM_WEIGHTINGS)}, got {weighting!r}")


def velocity_gap(velocity: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """mean_B mean_elems((v_θ − v_anchor)²), a scalar differentiable in `velocity` only."""
    dtype = torch.promote_types(velocity.dtype, torch.float32)
    return (velocity.to(dtype) - anchor.detach().to(dtype)).pow(2).flatten(1).mean(dim=1).mean()


class AWMLoss:
    """AWM loss. Reads `cfg.clip_ratio`, `cfg.adv_clip_max`, `cfg.kl_coef`, `cfg.awm_weighting`,
    `cfg.awm_ghuber_power`, `cfg.awm_ema_kl_coef`.

    `compute(batch: AWMInputs, velocity, cfg)`: `velocity` is the current network's (B, ...)
    prediction at (x_σ, σ), with grad (it plays the role of `policy_out`). Not an SDE-step loss:
    the policy-gradient engine's `LossInputs`/`StepOut` call is refused with an explanation.

    Metrics (plain floats, unweighted over the B samples):
        policy_loss            L_pg
        matching_loss          mean(e), the plain flow-matching error of the current policy
        ppo_kl                 mean(ℓ_old − ℓ)
        clipfrac(_higher/_lower), ratio_mean, ratio_std   as in flow_grpo, on ρ
        kl                     the reference velocity gap (only when kl_coef > 0)
        ema_kl                 the EMA velocity gap (only when awm_ema_kl_coef > 0)
    """

    def compute(
        self, batch: AWMInputs, velocity: torch.Tensor, cfg: LossConfig
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if not isinstance(batch, AWMInputs) or not isinstance(velocity, torch.Tensor):
            raise ValueError(
                "the awm loss trains on clean rollout samples at fresh noise levels: call it with "
                "AWMInputs and the network's velocity (the direct-preference trainer), not with an "
                f"SDE step's LossInputs/StepOut (got {type(batch).__name__}, {type(velocity).__name__})"
            )
        if velocity.shape != batch.latents.shape:
            raise ValueError(
                f"velocity has shape {tuple(velocity.shape)} but the latents have "
                f"{tuple(batch.latents.shape)}; they must be the same samples"
            )
        target = batch.noise - batch.latents
        log_lik_B, err_B = matching_log_likelihood(
            velocity, target, batch.sigmas_B, cfg.awm_weighting, cfg.awm_ghuber_power
        )
        if batch.old_velocity is None:
            old_log_lik_B = log_lik_B.detach()
        else:
            old_log_lik_B, _ = matching_log_likelihood(
                batch.old_velocity, target, batch.sigmas_B, cfg.awm_weighting, cfg.awm_ghuber_power
            )
            old_log_lik_B = old_log_lik_B.detach()
        eps = cfg.clip_ratio
        adv_B = batch.advantages_B.detach().double().clamp(-cfg.adv_clip_max, cfg.adv_clip_max)
        log_ratio_B = log_lik_B - old_log_lik_B
        ratio_B = torch.exp(log_ratio_B)
        policy_B = ppo_clip_terms(adv_B, ratio_B, eps)
        if batch.weights_B is not None:
            policy_B = policy_B * batch.weights_B.detach().double()
        # fp32 for a bf16/fp32 network, fp64 stays fp64
        policy_loss = policy_B.mean().to(torch.promote_types(velocity.dtype, torch.float32))
        loss = policy_loss
        extra: dict[str, torch.Tensor] = {}
        for name, anchor, coef, key in (
            ("ref_velocity", batch.ref_velocity, cfg.kl_coef, "kl"),
            ("ema_velocity", batch.ema_velocity, cfg.awm_ema_kl_coef, "ema_kl"),
        ):
            if coef > 0:
                if anchor is None:
                    raise ValueError(
                        f"the awm loss has a {key} coefficient {coef} > 0 but batch.{name} is None: "
                        f"compute it without grad at the same (x_σ, σ), or set its coefficient to 0"
                    )
                gap = velocity_gap(velocity, anchor)
                loss = loss + coef * gap.to(loss.dtype)
                extra[key] = gap.detach().double()

        with torch.no_grad():
            ratio_B = ratio_B.detach()
            stats = torch.stack(
                [
                    policy_loss.detach().double(),
                    err_B.detach().mean(),
                    *clip_ratio_stats(log_ratio_B, ratio_B, eps),
                    *extra.values(),
                ]
            ).tolist()  # one device sync
        return loss, dict(zip(METRIC_NAMES + tuple(extra), stats, strict=True))


# ------------------------------------------------------------------------- declaration
@dataclass
class AWMSettings:
    """AWM's keys under `actor.loss`."""

    awm_weighting: str = "uniform"  # uniform, sigma, sigma_sq or ghuber (see diffrl.algos.awm)
    awm_ghuber_power: float = 0.25  # p of the ghuber weighting
    awm_ema_kl_coef: float = 0.0  # KL of the velocity to the `old` (EMA) adapter

    def validate(self, at: str) -> None:
        require_choice(f"{at}.awm_weighting", self.awm_weighting, AWM_WEIGHTINGS)
        require_positive(f"{at}.awm_ghuber_power", self.awm_ghuber_power)
        require_at_least(f"{at}.awm_ema_kl_coef", self.awm_ema_kl_coef, 0.0)


def awm_term(
    batch: Any, noise: torch.Tensor, sigmas_B: torch.Tensor, cfg: LossConfig, net: Velocities, adv_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """The AWM loss of a micro-batch of clean samples at one noise level per sample, on-policy
    (ρ ≡ 1): v_θ, then v_ref and v_ema (the `old` adapter) only when their KL terms are on.
    `adv_mode` is DiffusionNFT's; AWM weights by the advantages themselves."""
    x_t = interpolate(batch.latents, noise, sigmas_B)
    v = net.trained(x_t, sigmas_B, batch.cond)
    v_ref = net.reference(x_t, sigmas_B, batch.cond) if cfg.kl_coef > 0 else None
    v_ema = net.old(x_t, sigmas_B, batch.cond, trained=v) if cfg.awm_ema_kl_coef > 0 else None
    inputs = AWMInputs(
        batch.advantages_B.to(v.device),
        batch.latents,
        noise,
        sigmas_B.to(v.device),
        ref_velocity=v_ref,
        ema_velocity=v_ema,
    )
    return AWMLoss().compute(inputs, v, cfg)


register_algorithm(
    DirectPreferenceSpec(
        name="awm",
        loss=AWMLoss,
        settings=AWMSettings,
        metrics=METRIC_NAMES,
        term=awm_term,
        trains_on=SAMPLES,
        needs_old_adapter=lambda cfg: cfg.awm_ema_kl_coef > 0,  # the EMA KL's anchor
    )
)
