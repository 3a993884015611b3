import math
from types import SimpleNamespace

import pytest
import torch
from torch.distributions import Normal

from diffrl.algos import LossInputs, algorithm
from diffrl.algos.grpo_guard import GRPOGuardLoss
from diffrl.sde import StepOut

B, C, H, W = 4, 2, 3, 3
N = C * H * W


def cfg(clip_ratio=10.0, adv_clip_max=5.0):
    return SimpleNamespace(clip_ratio=clip_ratio, adv_clip_max=adv_clip_max)


def step_out(mean, log_prob_B, std_dev_t_B, sqrt_neg_dt_B):
    return StepOut(
        next_latents=torch.zeros_like(mean.detach()),
        log_prob_B=log_prob_B,
        mean=mean,
        std_B=std_dev_t_B * sqrt_neg_dt_B,
        std_dev_t_B=std_dev_t_B,
        sqrt_neg_dt_B=sqrt_neg_dt_B,
    )


def gaussian_logp(x, mu, tau):
    """Element-averaged Gaussian log-density, one value per sample (torch.distributions, float64)."""
    return Normal(mu, tau.view(-1, 1, 1, 1)).log_prob(x).flatten(1).mean(dim=1)


def test_guarded_log_ratio_is_the_noise_projection_when_tau_is_shared():
    # Same τ for every sample: b cancels the −mean(Δμ²)/(2τ²) part of the Gaussian log-ratio and κ
    # removes the 1/τ, so (logp_θ − logp_old + b)·κ == mean(ξ·Δμ) exactly (x' = μ_old + τ·ξ).
    g = torch.Generator().manual_seed(0)
    s, h = 0.9, 0.2
    tau = torch.full((B,), s * h, dtype=torch.float64)
    mu_old = torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    xi = torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    delta = 0.05 * torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    x_next = mu_old + tau.view(-1, 1, 1, 1) * xi
    mu = mu_old + delta
    logp_old = gaussian_logp(x_next, mu_old, tau)
    logp = gaussian_logp(x_next, mu, tau)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)
    out = step_out(
        mu, logp, torch.full((B,), s, dtype=torch.float64), torch.full((B,), h, dtype=torch.float64)
    )
    loss, m = GRPOGuardLoss().compute(LossInputs(adv, logp_old, old_mean=mu_old), out, cfg())

    rho = torch.exp((xi * delta).flatten(1).mean(dim=1))
    assert loss.item() == pytest.approx((-(adv * rho).mean() / h**2).item(), rel=1e-10)
    assert m["ratio_mean"] == pytest.approx(rho.mean().item(), rel=1e-10)
    # The unguarded ratio is biased low by exp(−mean(Δμ²)/(2τ²)); ppo_kl reports the unguarded one.
    assert m["ppo_kl"] == pytest.approx((logp_old - logp).mean().item(), rel=1e-10)
    assert m["sigma_t"] == pytest.approx(s) and m["sqrt_dt"] == pytest.approx(h)


def make(seed=1):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    old_mean = mean + 0.01 * torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    old_logp = torch.randn(B, generator=g, dtype=torch.float64)
    logp = old_logp + 1e-3 * torch.randn(B, generator=g, dtype=torch.float64)
    s = torch.rand(B, generator=g, dtype=torch.float64) + 0.5
    h = torch.rand(B, generator=g, dtype=torch.float64) * 0.3 + 0.1
    return mean.requires_grad_(True), old_mean, logp.requires_grad_(True), old_logp, s, h


def reference(mean, old_mean, logp, old_logp, s, h, adv, eps, adv_clip, weights=None):
    """Float64 loop over samples with explicit sums (the formula of docs/algorithms.md, 'grpo_guard')."""
    sigma_bar = sum(s.tolist()) / B
    h_bar = sum(h.tolist()) / B
    kappa = sigma_bar * h_bar
    total, biases, ratios = 0.0, [], []
    for i in range(B):
        sq = sum(float(d) ** 2 for d in (mean[i] - old_mean[i]).flatten()) / N
        b = sq / (2 * kappa**2)
        rho = math.exp((float(logp[i]) - float(old_logp[i]) + b) * kappa)
        a = max(-adv_clip, min(adv_clip, adv[i]))
        term = max(-a * rho, -a * min(max(rho, 1 - eps), 1 + eps))
        total += term * (1.0 if weights is None else weights[i])
        biases.append(b)
        ratios.append(rho)
    return total / B / h_bar**2, biases, ratios


def test_bias_term_and_scaling_against_a_loop_reimplementation():
    mean, old_mean, logp, old_logp, s, h = make()
    adv = [0.7, -1.2, 9.0, -0.3]  # 9 is clamped to 5
    weights = [1.0, 0.5, 2.0, 0.0]
    eps = 2e-6
    out = step_out(mean, logp, s, h)
    batch = LossInputs(
        torch.tensor(adv, dtype=torch.float64),
        old_logp,
        old_mean=old_mean,
        weights_B=torch.tensor(weights, dtype=torch.float64),
    )
    loss, m = algorithm("grpo_guard").loss().compute(batch, out, cfg(clip_ratio=eps))
    expected, biases, ratios = reference(
        mean.detach(), old_mean, logp.detach(), old_logp, s, h, adv, eps, 5.0, weights
    )
    assert loss.item() == pytest.approx(expected, rel=1e-10)
    assert m["policy_loss"] == pytest.approx(expected, rel=1e-10)
    assert m["ratio_mean_bias"] == pytest.approx(sum(biases) / B, rel=1e-10)
    assert m["ratio_mean"] == pytest.approx(sum(ratios) / B, rel=1e-10)
    n_hi = sum(r > 1 + eps for r in ratios)
    n_lo = sum(r < 1 - eps for r in ratios)
    assert m["clipfrac_higher"] == n_hi / B and m["clipfrac_lower"] == n_lo / B
    assert m["clipfrac"] == (n_hi + n_lo) / B
    assert all(isinstance(v, float) for v in m.values())


def test_gradients_flow_into_logp_and_mean_only():
    mean, old_mean, logp, old_logp, s, h = make(2)
    s = s.clone().requires_grad_(True)
    h = h.clone().requires_grad_(True)
    old_mean = old_mean.clone().requires_grad_(True)
    old_logp = old_logp.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0], dtype=torch.float64, requires_grad=True)
    out = step_out(mean, logp, s, h)
    loss, _ = GRPOGuardLoss().compute(LossInputs(adv, old_logp, old_mean=old_mean), out, cfg())
    loss.backward()
    for constant in (s, h, old_mean, old_logp, adv):
        assert constant.grad is None
    # closed form, no clipping (ε = 10): ℓ_i = −A_i·ρ_i, ρ_i = exp((Δlogp_i + b_i)·κ)
    with torch.no_grad():
        kappa = s.mean() * h.mean()
        gap = mean - old_mean
        b = gap.pow(2).flatten(1).mean(dim=1) / (2 * kappa**2)
        rho = torch.exp((logp - old_logp + b) * kappa)
        coef = -adv * rho * kappa / (B * h.mean() ** 2)  # dL/d(Δlogp_i + b_i)
    torch.testing.assert_close(logp.grad, coef)
    torch.testing.assert_close(mean.grad, coef.view(B, 1, 1, 1) * gap / (N * kappa**2))


def test_clipped_samples_get_no_gradient_in_the_ppo_direction():
    mean, old_mean, logp, old_logp, s, h = make(3)
    # Make sample 0's ratio large (A > 0, ρ > 1 + ε) and sample 1's small (A < 0, ρ < 1 − ε).
    with torch.no_grad():
        logp[0] = old_logp[0] + 50.0
        logp[1] = old_logp[1] - 50.0
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    out = step_out(mean, logp, s, h)
    loss, m = GRPOGuardLoss().compute(LossInputs(adv, old_logp, old_mean=old_mean), out, cfg(clip_ratio=0.1))
    loss.backward()
    assert logp.grad[0] == 0 and logp.grad[1] == 0
    assert torch.all(mean.grad[0] == 0) and torch.all(mean.grad[1] == 0)
    assert m["clipfrac_higher"] >= 0.25 and m["clipfrac_lower"] >= 0.25


def test_needs_old_mean_and_the_sde_kind():
    mean, old_mean, logp, old_logp, s, h = make(4)
    adv = torch.ones(B, dtype=torch.float64)
    with pytest.raises(ValueError, match="old_mean"):
        GRPOGuardLoss().compute(LossInputs(adv, old_logp), step_out(mean, logp, s, h), cfg())
    cps_like = StepOut(
        next_latents=torch.zeros(B, C, H, W, dtype=torch.float64),
        log_prob_B=logp,
        mean=mean,
        std_B=s,  # cps/dance_sde: std_dev_t already is the transition std
        std_dev_t_B=s,
        sqrt_neg_dt_B=h,
    )
    with pytest.raises(ValueError, match="sde"):
        GRPOGuardLoss().compute(LossInputs(adv, old_logp, old_mean=old_mean), cps_like, cfg())
    zeros = torch.zeros(B, dtype=torch.float64)
    with pytest.raises(ValueError, match="deterministic"):
        GRPOGuardLoss().compute(
            LossInputs(adv, old_logp, old_mean=old_mean), step_out(mean, logp, zeros, h), cfg()
        )
    with pytest.raises(ValueError, match="same samples and latents"):
        GRPOGuardLoss().compute(
            LossInputs(adv, old_logp, old_mean=old_mean[:, :1]), step_out(mean, logp, s, h), cfg()
        )
