import math
from types import SimpleNamespace

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from diffrl.algos import LossInputs, algorithm
from diffrl.algos.flow_dppo import FlowDPPOLoss
from diffrl.sde import StepOut

C, H, W = 2, 2, 3
N = C * H * W


def cfg(threshold=1e-5, add_kl_coefficient=True, adv_clip_max=5.0):
    return SimpleNamespace(
        kl_mask_threshold=threshold, add_kl_coefficient=add_kl_coefficient, adv_clip_max=adv_clip_max
    )


def step_out(mean, log_prob_B, std_B):
    return StepOut(
        next_latents=torch.zeros_like(mean.detach()),
        log_prob_B=log_prob_B,
        mean=mean,
        std_B=std_B,
        std_dev_t_B=std_B,
        sqrt_neg_dt_B=torch.ones_like(std_B),
    )


# Eight samples: every combination of advantage sign, ratio direction and inside/outside the region.
#               A     ρ     outside   dropped?
CASES = [
    (+1.5, 1.3, True, True),  # pushes ρ further up, already far: drop
    (+1.5, 0.8, True, False),  # ρ moved against A: keep, it pulls back toward old
    (-0.7, 0.8, True, True),  # pushes ρ further down, already far: drop
    (-0.7, 1.3, True, False),  # ρ moved against A: keep
    (+1.5, 1.3, False, False),  # inside the trust region: always keep
    (+1.5, 0.8, False, False),
    (-0.7, 0.8, False, False),
    (-0.7, 1.3, False, False),
]


def build(cases, std=0.3):
    b = len(cases)
    g = torch.Generator().manual_seed(0)
    old_mean = torch.randn(b, C, H, W, generator=g, dtype=torch.float64)
    # outside: gap 1.0 per element -> D = 1/(2·0.09) ≈ 5.6 ≫ δ; inside: identical means -> D = 0
    gap = torch.tensor([1.0 if outside else 0.0 for _, _, outside, _ in cases], dtype=torch.float64)
    mean = (old_mean + gap.view(b, 1, 1, 1)).requires_grad_(True)
    logp = torch.tensor([math.log(r) for _, r, _, _ in cases], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([a for a, _, _, _ in cases], dtype=torch.float64)
    std_B = torch.full((b,), std, dtype=torch.float64)
    return mean, old_mean, logp, adv, std_B


def test_mask_in_all_sign_cases_and_the_gradient_of_kept_samples():
    mean, old_mean, logp, adv, std_B = build(CASES)
    batch = LossInputs(adv, torch.zeros(len(CASES), dtype=torch.float64), old_mean=old_mean)
    loss, m = FlowDPPOLoss().compute(batch, step_out(mean, logp, std_B), cfg())
    loss.backward()
    b = len(CASES)
    expected_loss = sum(0.0 if drop else -a * r for a, r, _, drop in CASES) / b
    assert loss.item() == pytest.approx(expected_loss, rel=1e-12)
    for i, (a, r, _, drop) in enumerate(CASES):
        # d(−A·ρ)/d logp = −A·ρ; dropped samples contribute nothing
        assert logp.grad[i].item() == pytest.approx(0.0 if drop else -a * r / b, abs=1e-15), i
    assert mean.grad is None  # D only gates; the mean gets no gradient from this loss
    assert m["kl_mask_fraction"] == 4 / 8
    assert m["pos_rm_fraction"] == 1 / 8 and m["neg_rm_fraction"] == 1 / 8
    assert m["masked_fraction"] == 2 / 8
    assert m["ratio_min"] == pytest.approx(0.8) and m["ratio_max"] == pytest.approx(1.3)
    log_r = [math.log(r) for _, r, _, _ in CASES]
    assert m["ppo_kl"] == pytest.approx(-sum(log_r) / b)
    assert m["approx_kl"] == pytest.approx(sum(0.5 * x * x for x in log_r) / b)


def test_divergence_is_the_exact_gaussian_kl_or_uses_unit_std():
    g = torch.Generator().manual_seed(1)
    b = 3
    old_mean = torch.randn(b, C, H, W, generator=g, dtype=torch.float64)
    mean = old_mean + 0.1 * torch.randn(b, C, H, W, generator=g, dtype=torch.float64)
    std_B = torch.tensor([0.2, 0.5, 1.3], dtype=torch.float64)
    batch = LossInputs(
        torch.zeros(b, dtype=torch.float64), torch.zeros(b, dtype=torch.float64), old_mean=old_mean
    )
    _, m = FlowDPPOLoss().compute(batch, step_out(mean, torch.zeros(b, dtype=torch.float64), std_B), cfg())
    tau = std_B.view(b, 1, 1, 1).expand_as(mean)
    exact = kl_divergence(Normal(old_mean, tau), Normal(mean, tau)).flatten(1).mean(dim=1)
    assert m["kl_new_old_mean"] == pytest.approx(exact.mean().item(), rel=1e-12)
    assert m["kl_new_old_max"] == pytest.approx(exact.max().item(), rel=1e-12)
    _, m1 = FlowDPPOLoss().compute(
        batch, step_out(mean, torch.zeros(b, dtype=torch.float64), std_B), cfg(add_kl_coefficient=False)
    )
    unit = kl_divergence(Normal(old_mean, 1.0), Normal(mean, 1.0)).flatten(1).mean(dim=1)
    assert m1["kl_new_old_mean"] == pytest.approx(unit.mean().item(), rel=1e-12)


def test_threshold_is_inclusive_and_read_from_cfg():
    # one sample, A > 0, ρ > 1, D exactly computed: dropped iff D >= δ
    mean, old_mean, logp, adv, std_B = build([(+1.0, 1.2, True, True)])
    d = 1.0 / (2 * 0.3**2)
    batch = LossInputs(adv, torch.zeros(1, dtype=torch.float64), old_mean=old_mean)
    for threshold, dropped in ((d * 0.999, True), (d * 1.001, False)):
        loss, m = algorithm("flow_dppo").loss().compute(batch, step_out(mean, logp, std_B), cfg(threshold))
        assert m["masked_fraction"] == float(dropped)
        assert loss.item() == pytest.approx(0.0 if dropped else -1.2)


def test_weights_advantage_clamp_and_overflowing_ratio():
    cases = [(+9.0, 1.1, False, False), (+1.0, 1.0, True, False), (+1.0, 2.0, True, True)]
    mean, old_mean, logp, adv, std_B = build(cases)
    with torch.no_grad():
        logp[2] = 1e4  # ρ = inf, but dropped: the loss must stay finite
    weights = torch.tensor([0.5, 3.0, 1.0], dtype=torch.float64, requires_grad=True)
    batch = LossInputs(adv, torch.zeros(3, dtype=torch.float64), old_mean=old_mean, weights_B=weights)
    loss, _ = FlowDPPOLoss().compute(batch, step_out(mean, logp, std_B), cfg(adv_clip_max=5.0))
    # sample 0: A clamped to 5; sample 1: ρ = 1 exactly is kept even outside the region
    assert loss.item() == pytest.approx((0.5 * -5.0 * 1.1 + 3.0 * -1.0 * 1.0) / 3)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[2] == 0
    assert weights.grad is None


def test_errors():
    mean, old_mean, logp, adv, std_B = build(CASES[:2])
    zeros = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="old_mean"):
        FlowDPPOLoss().compute(LossInputs(adv, zeros), step_out(mean, logp, std_B), cfg())
    with pytest.raises(ValueError, match="deterministic"):
        FlowDPPOLoss().compute(LossInputs(adv, zeros, old_mean=old_mean), step_out(mean, logp, zeros), cfg())
    # with τ = 1 a zero-std step is accepted
    FlowDPPOLoss().compute(
        LossInputs(adv, zeros, old_mean=old_mean), step_out(mean, logp, zeros), cfg(add_kl_coefficient=False)
    )
