"""KL penalty between the current policy's SDE step and the reference policy's, per window step.

Both policies propose Gaussian transitions x' | x with the same std τ and different means, so the
KL per latent element is closed form:

    KL(N(μ_θ, τ²) ‖ N(μ_ref, τ²)) = (μ_θ − μ_ref)² / (2·τ²)

Averaged over the latent elements (like the log-probs) and then over the micro-batch:

    kl = (1/B) · Σ_i mean_elems((μ_θ,i − μ_ref,i)²) / (2·s_i²)          dimensionless

with s chosen by `cfg.kl_std`:
- "sde" (default): s = std_dev_t, *without* the sqrt(−dt) factor, as the Flow-GRPO reference does.
  It equals the exact KL (next line) multiplied by −dt = σ − σ', so it does not grow as the
  step size shrinks.
- "transition": s = std_dev_t·sqrt(−dt) = `StepOut.std_B`, the std of the transition itself: the
  exact KL between the two Gaussian steps.
For the cps and dance_sde step kinds `std_dev_t_B` already is the transition std, so both choices
give the same value there; they differ only for the `sde` kind.

The training engine adds `kl_coef · kl` to the policy loss when `cfg.kl_coef > 0` (this module
returns the unscaled kl). The reference mean comes from the same network with its adapters
disabled (LoRA) or a frozen copy, computed without grad on the same stored x_k.
Rollout-correction weights do not apply to this term.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diffrl.algos.base import LossInputs
from diffrl.algos.spec import explain_not_an_algorithm
from diffrl.config.choices import KL_STD_CHOICES
from diffrl.lazy import lazy_import

if TYPE_CHECKING:
    from diffrl.config.schema import LossConfig
    from diffrl.sde import StepOut

torch = lazy_import("torch")  # deferred: see diffrl.lazy


def kl_std_B(policy_out: StepOut, kl_std: str) -> torch.Tensor:
    """The (B,) std s dividing the squared mean gap, per `cfg.kl_std` ("sde" or "transition")."""
    if kl_std == "sde":
        return policy_out.std_dev_t_B
    if kl_std == "transition":
        return policy_out.std_B
    raise ValueError(f"actor.loss.kl_std must be one of {list(KL_STD_CHOICES)}, got {kl_std!r}")


class KLLoss:
    """KL to the reference policy on the SDE means. Needs `batch.ref_mean`; reads `cfg.kl_std`.

    Metrics: `kl` (the returned loss, unscaled by kl_coef).
    """

    def compute(
        self, batch: LossInputs, policy_out: StepOut, cfg: LossConfig
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if batch.ref_mean is None:
            raise ValueError(
                "the kl loss needs batch.ref_mean, the reference policy's SDE mean for this step; "
                "compute it with the reference (adapters disabled) or set actor.loss.kl_coef=0"
            )
        mean = policy_out.mean
        if mean.shape != batch.ref_mean.shape:
            raise ValueError(
                f"policy_out.mean has shape {tuple(mean.shape)} but batch.ref_mean has "
                f"{tuple(batch.ref_mean.shape)}; they must be the same samples and latents"
            )
        std_B = kl_std_B(policy_out, cfg.kl_std).detach()
        if not bool((std_B > 0).all()):
            raise ValueError(
                f"kl loss got a non-positive std ({std_B.min().item()}) for kl_std={cfg.kl_std!r}: "
                "the step is deterministic (ODE, or the last cps step); train KL only on SDE steps"
            )
        sq_gap_B = (mean - batch.ref_mean.detach()).pow(2).flatten(1).mean(dim=1)
        kl_B = sq_gap_B / (2.0 * std_B.to(sq_gap_B.dtype) ** 2)
        loss = kl_B.mean()
        return loss, {"kl": loss.item()}


explain_not_an_algorithm(
    "kl",
    "kl is the KL-to-reference term, not a policy loss: choose a policy loss and set actor.loss.kl_coef",
)
