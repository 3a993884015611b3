"""DMD2's student loss and fake-score loss against a float64 reference written here by hand.

The reference model is linear in flattened latents: v_W(x) = W·x (D×D). For the student
x̂₀ = x − σ·W·x, so ∂x̂₀_b/∂W = −σ_b·(·)·x_bᵀ and the gradient of L_DM = ½·mean((x̂₀ − sg(x̂₀ − g))²)
is −(1/(B·D))·Σ_b σ_b·g_b·x_bᵀ; the fake score's L = mean_b mean_d (W_f·x_t − u)² has gradient
(2/(B·D))·Σ_b (W_f·x_t,b − u_b)·x_t,bᵀ. Neither formula goes through the code under test.
"""

import numpy as np
import pytest
import torch

from diffrl.algos import DISTILLATION, algorithm
from diffrl.algos.dmd2 import (
    FAKE_SCORE,
    DMD2Loss,
    DMD2Settings,
    DMDInputs,
    dmd_direction,
    fake_score_loss,
    noise_levels,
    student_step_indices,
    x0_prediction,
)
from diffrl.config.checks import ConfigError

B, C, H, W = 3, 2, 2, 2
D = C * H * W


def _setup(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, D))  # the student's input x_{σ_i}
    sigma_student = np.array([1.0, 0.6, 0.3])
    w_student = 0.3 * rng.standard_normal((D, D))
    eps = rng.standard_normal((B, D))  # re-noising ε'
    t = np.array([0.2, 0.5, 0.9])
    w_real = 0.4 * rng.standard_normal((D, D))
    w_fake = 0.4 * rng.standard_normal((D, D))
    return x, sigma_student, w_student, eps, t, w_real, w_fake


def _reference(x, sigma_student, w_student, eps, t, w_real, w_fake):
    """(g, w_B, dL/dW_student, L) by hand."""
    x0 = x - sigma_student[:, None] * (x @ w_student.T)
    x_t = (1 - t[:, None]) * x0 + t[:, None] * eps
    real_x0 = x_t - t[:, None] * (x_t @ w_real.T)
    fake_x0 = x_t - t[:, None] * (x_t @ w_fake.T)
    weight = np.abs(x0 - real_x0).mean(axis=1)
    g = (fake_x0 - real_x0) / weight[:, None]
    grad_w = -(sigma_student[:, None, None] * g[:, :, None] * x[:, None, :]).sum(axis=0) / (B * D)
    loss = 0.5 * (g**2).mean()
    return g, weight, grad_w, loss


def _t(a):
    return torch.tensor(a, dtype=torch.float64)


def test_student_gradient_matches_the_hand_reference():
    x, s_st, w_st, eps, t, w_real, w_fake = _setup()
    g_ref, weight_ref, grad_ref, loss_ref = _reference(x, s_st, w_st, eps, t, w_real, w_fake)

    W_st = _t(w_st).requires_grad_(True)
    xs = _t(x).view(B, C, H, W)
    v = (xs.flatten(1) @ W_st.T).view(B, C, H, W)
    x0 = x0_prediction(xs, v, _t(s_st))
    with torch.no_grad():  # the teacher and the fake score at the re-noised sample, no grad
        x_t = (1 - _t(t)).view(-1, 1) * x0.detach().flatten(1) + _t(t).view(-1, 1) * _t(eps)
        v_real = (x_t @ _t(w_real).T).view(B, C, H, W)
        v_fake = (x_t @ _t(w_fake).T).view(B, C, H, W)
    inputs = DMDInputs(x0, _t(eps).view(B, C, H, W), _t(t), v_real, v_fake)
    loss, metrics = DMD2Loss().compute(inputs)
    loss.backward()

    torch.testing.assert_close(W_st.grad, _t(grad_ref), rtol=1e-10, atol=1e-12)
    assert loss.item() == pytest.approx(loss_ref, rel=1e-10)
    assert metrics["dmd_loss"] == pytest.approx(loss_ref, rel=1e-10)
    assert metrics["dmd_normaliser"] == pytest.approx(weight_ref.mean(), rel=1e-10)
    assert metrics["dmd_grad_abs"] == pytest.approx(np.abs(g_ref).mean(), rel=1e-10)

    real_x0 = x0_prediction(inputs.noisy_latents, v_real, _t(t))
    fake_x0 = x0_prediction(inputs.noisy_latents, v_fake, _t(t))
    g, weight_B = dmd_direction(x0, real_x0, fake_x0)
    torch.testing.assert_close(g.flatten(1), _t(g_ref), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weight_B, _t(weight_ref), rtol=1e-10, atol=1e-12)


def test_the_gradient_with_respect_to_the_sample_is_g_over_the_element_count():
    x, _, _, eps, t, _, _ = _setup(1)
    x0 = _t(x).view(B, C, H, W).requires_grad_(True)
    g_x0 = torch.randn(B, C, H, W, dtype=torch.float64)
    real = torch.randn(B, C, H, W, dtype=torch.float64)
    inputs = DMDInputs(x0, _t(eps).view(B, C, H, W), _t(t), real, real + g_x0)
    loss, _ = DMD2Loss().compute(inputs)
    loss.backward()
    real_x0 = x0_prediction(inputs.noisy_latents, real, _t(t))
    fake_x0 = x0_prediction(inputs.noisy_latents, real + g_x0, _t(t))
    g, _ = dmd_direction(x0, real_x0, fake_x0)
    torch.testing.assert_close(x0.grad, g / (B * D), rtol=1e-12, atol=1e-14)


def test_equal_fake_and_teacher_give_no_gradient():
    x0 = torch.randn(B, C, H, W, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, C, H, W, dtype=torch.float64)
    loss, metrics = DMD2Loss().compute(
        DMDInputs(x0, torch.randn_like(x0), torch.full((B,), 0.5, dtype=torch.float64), v, v)
    )
    loss.backward()
    assert torch.count_nonzero(x0.grad) == 0
    assert metrics["teacher_fake_gap"] == 0.0


def test_fake_score_loss_gradient_matches_the_hand_reference():
    rng = np.random.default_rng(3)
    x0 = rng.standard_normal((B, D))
    eps = rng.standard_normal((B, D))
    t = np.array([0.1, 0.4, 0.95])
    w_f = 0.4 * rng.standard_normal((D, D))
    x_t = (1 - t[:, None]) * x0 + t[:, None] * eps
    u = eps - x0
    resid = x_t @ w_f.T - u
    grad_ref = 2.0 / (B * D) * (resid[:, :, None] * x_t[:, None, :]).sum(axis=0)
    loss_ref = (resid**2).mean()

    W_f = _t(w_f).requires_grad_(True)
    v = (_t(x_t) @ W_f.T).view(B, C, H, W)
    loss, metrics = fake_score_loss(v, _t(x0).view(B, C, H, W), _t(eps).view(B, C, H, W))
    loss.backward()
    torch.testing.assert_close(W_f.grad, _t(grad_ref), rtol=1e-10, atol=1e-12)
    assert metrics["fake_score_loss"] == pytest.approx(loss_ref, rel=1e-10)


def test_fake_score_loss_takes_no_gradient_into_the_student_sample():
    x0 = torch.randn(B, C, H, W, requires_grad=True)
    v = torch.randn(B, C, H, W, requires_grad=True)
    loss, _ = fake_score_loss(v, x0, torch.randn(B, C, H, W))
    loss.backward()
    assert x0.grad is None and v.grad is not None


def test_draws_come_from_each_sample_generator():
    gens = [torch.Generator().manual_seed(i) for i in range(5)]
    steps = student_step_indices(gens, 2)
    again = student_step_indices([torch.Generator().manual_seed(i) for i in range(5)], 2)
    assert steps.tolist() == again.tolist() and set(steps.tolist()) <= {0, 1}
    sigmas = noise_levels([torch.Generator().manual_seed(i) for i in range(200)], 0.02, 0.98)
    assert sigmas.min() >= 0.02 and sigmas.max() <= 0.98 and sigmas.dtype == torch.float32
    alone = noise_levels([torch.Generator().manual_seed(7)], 0.02, 0.98)
    assert alone.item() == sigmas[7].item()  # a sample's draw does not depend on its batch


def test_inputs_are_checked():
    x0 = torch.randn(B, C, H, W)
    with pytest.raises(ValueError, match="real_velocity"):
        DMDInputs(x0, x0, torch.ones(B), torch.randn(B, C, H, W + 1), x0)
    with pytest.raises(ValueError, match="sigmas_B"):
        DMDInputs(x0, x0, torch.ones(B + 1), x0, x0)
    with pytest.raises(ValueError, match="DMDInputs"):
        DMD2Loss().compute(object())


def test_declaration_and_settings():
    spec = algorithm("dmd2")
    assert spec.loop == DISTILLATION and spec.adapters == (FAKE_SCORE,)
    assert spec.settings is DMD2Settings
    DMD2Settings().validate("actor.loss")
    for bad in (
        DMD2Settings(dmd_fake_updates=0),
        DMD2Settings(dmd_teacher_guidance=0.5),
        DMD2Settings(dmd_sigma_min=0.5, dmd_sigma_max=0.4),
        DMD2Settings(dmd_fake_lr=0.0),
    ):
        with pytest.raises(ConfigError):
            bad.validate("actor.loss")
