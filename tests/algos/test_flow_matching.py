"""Supervised flow matching: the interpolation, the loss and the noise-level density."""

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from diffrl.algos.flow_matching import flow_matching_loss, interpolate, sample_sigmas


def test_interpolation_and_loss_match_numpy():
    rng = np.random.default_rng(0)
    x0, eps, v = (rng.standard_normal((3, 2, 4, 4)) for _ in range(3))
    sigma = np.array([0.1, 0.5, 0.9])
    expected_x = (1 - sigma)[:, None, None, None] * x0 + sigma[:, None, None, None] * eps
    got_x = interpolate(torch.tensor(x0), torch.tensor(eps), torch.tensor(sigma))
    np.testing.assert_allclose(got_x.numpy(), expected_x, rtol=1e-12)
    expected_loss = np.mean(np.mean((v - (eps - x0)) ** 2, axis=(1, 2, 3)))
    got = flow_matching_loss(
        torch.tensor(v), torch.tensor(x0), torch.tensor(eps), torch.tensor(sigma), "logit_normal"
    )
    np.testing.assert_allclose(float(got), expected_loss, rtol=1e-6)


def test_the_loss_is_zero_exactly_at_the_true_velocity_and_has_its_gradient():
    x0, eps = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8)
    v = (eps - x0).clone().requires_grad_(True)
    loss = flow_matching_loss(v, x0, eps, torch.tensor([0.3, 0.7]), "logit_normal")
    assert float(loss) == 0.0
    w = (v.detach() + 1.0).requires_grad_(True)
    flow_matching_loss(w, x0, eps, torch.tensor([0.3, 0.7]), "logit_normal").backward()
    # d/dv mean((v - v*)^2) = 2 (v - v*) / numel
    torch.testing.assert_close(w.grad, torch.full_like(w, 2.0 / w.numel()))


def test_logit_normal_noise_levels_follow_the_logit_normal_cdf():
    """With shift 1 the scheduler's sigmas are 1 - i/1000, so σ ≈ 1 − u with u ~ LogitNormal(0, 1),
    whose CDF is Φ(logit(u)) (torch.distributions, independent of diffusers)."""
    sigmas = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0).sigmas
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    drawn = sample_sigmas(sigmas, gens, "logit_normal", 0.0, 1.0).numpy()
    u = 1.0 - drawn
    normal = torch.distributions.Normal(0.0, 1.0)
    for q in (0.2, 0.5, 0.8):
        expected = float(normal.cdf(torch.logit(torch.tensor(q))))
        assert abs(np.mean(u <= q) - expected) < 0.03, q
    # Each draw depends on its own generator only.
    again = sample_sigmas(sigmas, [torch.Generator().manual_seed(7)], "logit_normal")
    assert float(again[0]) == drawn[7]


def test_shift_moves_noise_levels_up():
    shifted = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0).sigmas
    plain = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0).sigmas
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(500)]  # noqa: E731
    assert (
        sample_sigmas(shifted, gens(), "logit_normal").mean()
        > sample_sigmas(plain, gens(), "logit_normal").mean() + 0.1
    )
