"""DMD2: few-step distillation by distribution matching (the `distillation` loop).

References: Yin et al., "One-step Diffusion with Distribution Matching Distillation" (DMD, arXiv
2311.18828) and "Improved Distribution Matching Distillation for Fast Image Synthesis" (DMD2, arXiv
2405.14867). This file is the math; `diffrl.train.distillation` runs it on one model.

Three roles share one frozen base (LoRA): the **teacher** is the base with every adapter off,
sampled with CFG (`dmd_teacher_guidance`); the **student** is the trained adapter (`default`,
what validation, checkpoints and export read), a generator of `rollout.pipeline.num_inference_steps`
Euler steps on the family's own schedule σ_0 = 1 > σ_1 > ... > σ_N = 0, without CFG; the **fake
score** is a second adapter (`fake_score`) that learns the distribution of the student's samples.

Flow matching: x_σ = (1 − σ)·x₀ + σ·ε and v ≈ ε − x₀, so a velocity v at (x_σ, σ) predicts the
clean sample x̂₀ = x_σ − σ·v (`x0_prediction`).

The student's sample (backward simulation, DMD2 §4.4): per sample a step index i ~ U{0..N−1};
x_{σ_i} is reached by the student's own Euler steps from noise, without gradient, and the
student's prediction there, x̂₀ = x_{σ_i} − σ_i·v_θ(x_{σ_i}, σ_i), carries the gradient. Training
each of its steps on what its own earlier steps produce is what the few-step sampler then runs.

The distribution-matching gradient (DMD eq. 7, in x̂₀ form): re-noise x̂₀ with fresh ε' at a
level t ~ U[dmd_sigma_min, dmd_sigma_max], x_t = (1 − t)·x̂₀ + t·ε', and ask the teacher (real)
and the fake score for their clean predictions there:

    x̂_real = x_t − t·v_teacher^CFG(x_t, t)            x̂_fake = x_t − t·v_fake(x_t, t)
    w_i    = mean_elems |x̂₀ − x̂_real|                  per-sample normaliser, constant
    g      = (x̂_fake − x̂_real) / w_i                   ∝ s_real − s_fake, up to sign: the score
                                                        gradient of KL(p_student ‖ p_teacher)
    L_DM   = ½ · mean_{i, elems} (x̂₀ − stopgrad(x̂₀ − g))²       so ∂L_DM/∂x̂₀ = g / (B·D)

(D: elements per sample.) The surrogate only transports g into the student's weights: its value
is ½·mean(g²), not a distance to anything. Moving x̂₀ along −g moves the student's samples where
the teacher's density is higher than the student's own.

The fake score's loss: plain flow matching on the student's samples x̂₀ (detached), fresh ε and
t ~ U[dmd_sigma_min, dmd_sigma_max], conditional (no CFG):

    L_fake = mean_i mean_elems (v_fake(x_t, t) − (ε − x̂₀))²

Two time-scale updates (DMD2 §4.2): `dmd_fake_updates` optimizer steps of the fake score (its own
AdamW, lr `dmd_fake_lr` or actor.optim.lr) before each student step, so that the fake score
tracks the moving student. The GAN and regression terms of DMD / DMD2 are not provided.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diffrl.algos.flow_matching import interpolate
from diffrl.algos.spec import DistillationSpec, register_algorithm
from diffrl.config.checks import require, require_at_least, require_positive
from diffrl.lazy import lazy_import

if TYPE_CHECKING:
    from diffrl.config.schema import LossConfig

torch = lazy_import("torch")  # deferred: see diffrl.lazy

#: The name of the fake score's LoRA adapter (the student is the trained adapter, `default`).
FAKE_SCORE = "fake_score"
#: Floor of the per-sample normaliser w_i (a student sample equal to the teacher's prediction).
NORMALISER_FLOOR = 1e-8

METRIC_NAMES = ("dmd_loss", "dmd_normaliser", "dmd_grad_abs", "teacher_fake_gap")
FAKE_METRIC_NAMES = ("fake_score_loss",)


def x0_prediction(latents: torch.Tensor, velocity: torch.Tensor, sigmas_B: torch.Tensor) -> torch.Tensor:
    """x̂₀ = x_σ − σ·v, σ broadcast over each sample's elements (differentiable in both)."""
    sigma = sigmas_B.to(latents.device, velocity.dtype).view(-1, *([1] * (latents.ndim - 1)))
    return latents - sigma * velocity


def dmd_direction(
    student_x0: torch.Tensor, real_x0: torch.Tensor, fake_x0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, w_B): the normalised distribution-matching direction g = (x̂_fake − x̂_real) / w_i with
    w_i = mean_elems |x̂₀ − x̂_real| (floored at NORMALISER_FLOOR); no gradient flows through either."""
    student_x0, real_x0, fake_x0 = student_x0.detach(), real_x0.detach(), fake_x0.detach()
    weight_B = (student_x0 - real_x0).abs().flatten(1).mean(dim=1).clamp_min(NORMALISER_FLOOR)
    grad = (fake_x0 - real_x0) / weight_B.view(-1, *([1] * (student_x0.ndim - 1)))
    return torch.nan_to_num(grad), weight_B


@dataclass
class DMDInputs:
    """One micro-batch of B student samples for the student's loss.

    student_x0:    (B, ...) the student's clean prediction x̂₀, with grad (fp32).
    noise:         (B, ...) ε' of the re-noising (same shape).
    sigmas_B:      (B,) re-noising level t of each sample.
    real_velocity: (B, ...) the teacher's CFG velocity at x_t = (1 − t)·x̂₀ + t·ε', no grad.
    fake_velocity: (B, ...) the fake score's velocity at the same x_t, no grad.
    """

    student_x0: torch.Tensor
    noise: torch.Tensor
    sigmas_B: torch.Tensor
    real_velocity: torch.Tensor
    fake_velocity: torch.Tensor

    def __post_init__(self) -> None:
        shape = tuple(self.student_x0.shape)
        if len(shape) < 2:
            raise ValueError(f"student_x0 must have shape (B, ...), got {shape}")
        for name in ("noise", "real_velocity", "fake_velocity"):
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(
                    f"{name} must have student_x0's shape {shape}, got {tuple(getattr(self, name).shape)}"
                )
        if tuple(self.sigmas_B.shape) != (shape[0],):
            raise ValueError(f"sigmas_B must have shape ({shape[0]},), got {tuple(self.sigmas_B.shape)}")

    @property
    def noisy_latents(self) -> torch.Tensor:
        """x_t, the re-noised student sample (detached: the teacher and fake passes take no gradient)."""
        return interpolate(self.student_x0.detach(), self.noise, self.sigmas_B)


class DMD2Loss:
    """The student's distribution-matching loss (module docstring). Reads nothing of `cfg` beyond
    what the trainer already used to build the inputs.

    Metrics (plain floats): dmd_loss (L_DM = ½·mean(g²)), dmd_normaliser (mean w_i), dmd_grad_abs
    (mean |g|), teacher_fake_gap (mean |x̂_fake − x̂_real|, unnormalised: falls as the student's
    distribution approaches the teacher's and the fake score follows it).
    """

    def compute(
        self, batch: DMDInputs, cfg: LossConfig | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if not isinstance(batch, DMDInputs):
            raise ValueError(
                "the dmd2 loss distils a student: call it with DMDInputs (the distillation trainer), "
                f"not with {type(batch).__name__}"
            )
        x_t = batch.noisy_latents
        real_x0 = x0_prediction(x_t, batch.real_velocity.detach(), batch.sigmas_B)
        fake_x0 = x0_prediction(x_t, batch.fake_velocity.detach(), batch.sigmas_B)
        grad, weight_B = dmd_direction(batch.student_x0, real_x0, fake_x0)
        x0 = batch.student_x0
        target = (x0 - grad.to(x0.dtype)).detach()
        loss = 0.5 * (x0 - target).pow(2).mean()
        with torch.no_grad():
            stats = torch.stack(
                [
                    loss.detach().double(),
                    weight_B.double().mean(),
                    grad.abs().double().mean(),
                    (fake_x0 - real_x0).abs().double().mean(),
                ]
            ).tolist()
        return loss, dict(zip(METRIC_NAMES, stats, strict=True))


def fake_score_loss(
    fake_velocity: torch.Tensor, student_x0: torch.Tensor, noise: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """L_fake = mean_i mean_elems (v_fake − (ε − x̂₀))², differentiable in `fake_velocity` only."""
    if fake_velocity.shape != student_x0.shape or noise.shape != student_x0.shape:
        raise ValueError(
            f"fake_velocity {tuple(fake_velocity.shape)}, student_x0 {tuple(student_x0.shape)} and noise "
            f"{tuple(noise.shape)} must have one shape"
        )
    dtype = torch.promote_types(fake_velocity.dtype, torch.float32)
    target = (noise - student_x0).detach().to(dtype)
    loss = (fake_velocity.to(dtype) - target).pow(2).flatten(1).mean(dim=1).mean()
    return loss, {"fake_score_loss": float(loss.detach())}


# ------------------------------------------------------------------------- the random draws
def student_step_indices(generators: Sequence[torch.Generator], num_steps: int) -> torch.Tensor:
    """(B,) int64: the student step i ~ U{0..N−1} each sample is trained at, one draw per generator."""
    if num_steps < 1:
        raise ValueError(f"the student needs at least one step, got {num_steps}")
    return torch.cat([torch.randint(0, num_steps, (1,), generator=g) for g in generators])


def noise_levels(generators: Sequence[torch.Generator], low: float, high: float) -> torch.Tensor:
    """(B,) fp32 t ~ U[low, high], one draw per generator."""
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
    return (low + (high - low) * u).float()


# ------------------------------------------------------------------------- declaration
@dataclass
class DMD2Settings:
    """DMD2's keys under `actor.loss`."""

    dmd_teacher_guidance: float = 4.5  # CFG scale of the teacher (the base, adapters off); 1 = none
    dmd_fake_updates: int = 5  # fake-score optimizer steps per student step (two time-scale updates)
    dmd_fake_lr: float | None = None  # the fake score's learning rate; null = actor.optim.lr
    dmd_sigma_min: float = 0.02  # range of the re-noising level t (DM gradient and fake-score loss)
    dmd_sigma_max: float = 0.98
    # a resume may change settings that alter training (else it stops naming them: a resumed run
    # that continues the saved one exactly needs the saved settings)
    dmd_resume_changes: bool = False

    def validate(self, at: str) -> None:
        require_at_least(f"{at}.dmd_teacher_guidance", self.dmd_teacher_guidance, 1.0)
        require_at_least(f"{at}.dmd_fake_updates", self.dmd_fake_updates, 1)
        if self.dmd_fake_lr is not None:
            require_positive(f"{at}.dmd_fake_lr", self.dmd_fake_lr)
        require(
            0.0 < self.dmd_sigma_min < self.dmd_sigma_max <= 1.0,
            f"{at}.dmd_sigma_min",
            f"{self.dmd_sigma_min} (dmd_sigma_max={self.dmd_sigma_max})",
            "must satisfy 0 < dmd_sigma_min < dmd_sigma_max <= 1",
        )


register_algorithm(
    DistillationSpec(
        name="dmd2",
        loss=DMD2Loss,
        settings=DMD2Settings,
        metrics=METRIC_NAMES,
        fake_metrics=FAKE_METRIC_NAMES,
        adapters=(FAKE_SCORE,),
    )
)
