import math
from types import SimpleNamespace

import pytest
import torch

from diffrl.algos import LossInputs, algorithm
from diffrl.algos.awm import AWMInputs, AWMLoss
from diffrl.sde import StepOut

B, C, H, W = 4, 2, 3, 2
N = C * H * W


def cfg(**overrides):
    base = dict(
        clip_ratio=1.0,
        adv_clip_max=5.0,
        kl_coef=0.0,
        awm_weighting="uniform",
        awm_ghuber_power=0.25,
        awm_ema_kl_coef=0.0,
    )
    base.update(overrides)
    return SimpleNamespace(**base)


def make(seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    eps = torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    sigmas = torch.tensor([0.2, 0.5, 0.8, 1.0], dtype=torch.float64)
    v = (eps - x0 + 0.3 * torch.randn(B, C, H, W, generator=g, dtype=torch.float64)).requires_grad_(True)
    return x0, eps, sigmas, v


ADV = [1.5, -0.5, 7.0, -2.0]  # 7 is clamped to 5
ADV_CLAMPED = torch.tensor([1.5, -0.5, 5.0, -2.0], dtype=torch.float64)


@pytest.mark.parametrize(
    ("weighting", "w_of_sigma"),
    [("uniform", lambda s: 1.0), ("sigma", lambda s: s), ("sigma_sq", lambda s: s * s)],
)
def test_on_policy_gradient_is_advantage_weighted_flow_matching(weighting, w_of_sigma):
    x0, eps, sigmas, v = make()
    batch = AWMInputs(torch.tensor(ADV, dtype=torch.float64), x0, eps, sigmas)
    loss, m = AWMLoss().compute(batch, v, cfg(awm_weighting=weighting))
    loss.backward()
    # ρ ≡ 1 on-policy: the value is −mean(Â), the gradient Â·w(σ)·d e/dv with e = mean((v − (ε − x₀))²)
    assert loss.item() == pytest.approx(-ADV_CLAMPED.mean().item(), rel=1e-12)
    u = eps - x0
    for i in range(B):
        expected = ADV_CLAMPED[i] * w_of_sigma(float(sigmas[i])) * 2 * (v[i].detach() - u[i]) / (N * B)
        torch.testing.assert_close(v.grad[i], expected)
    assert m["ratio_mean"] == 1.0 and m["clipfrac"] == 0.0 and m["ppo_kl"] == 0.0
    mse = ((v.detach() - u) ** 2).mean().item()  # equal counts per sample: mean of means
    assert m["matching_loss"] == pytest.approx(mse, rel=1e-12)


def test_ghuber_weighting_damps_large_errors():
    x0, eps, sigmas, v = make(1)
    p = 0.25
    batch = AWMInputs(torch.tensor(ADV, dtype=torch.float64), x0, eps, sigmas)
    loss, _ = AWMLoss().compute(batch, v, cfg(awm_weighting="ghuber", awm_ghuber_power=p))
    loss.backward()
    u = eps - x0
    for i in range(B):
        e = float(((v[i].detach() - u[i]) ** 2).mean())
        # d/de ((e + δ)^p − δ^p)/p = (e + δ)^(p − 1)
        factor = float(ADV_CLAMPED[i]) * float(sigmas[i]) * (e + 1e-10) ** (p - 1)
        torch.testing.assert_close(v.grad[i], factor * 2 * (v[i].detach() - u[i]) / (N * B))


def test_off_policy_ratio_and_clip_against_a_scalar_reimplementation():
    x0, eps, sigmas, v = make(2)
    g = torch.Generator().manual_seed(9)
    v_old = v.detach() + 0.2 * torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    clip = 0.05
    weights = [1.0, 2.0, 0.5, 0.0]
    batch = AWMInputs(
        torch.tensor(ADV, dtype=torch.float64),
        x0,
        eps,
        sigmas,
        old_velocity=v_old,
        weights_B=torch.tensor(weights, dtype=torch.float64),
    )
    loss, m = algorithm("awm").loss().compute(batch, v, cfg(awm_weighting="sigma", clip_ratio=clip))
    total, ratios = 0.0, []
    for i in range(B):
        tgt = (eps[i] - x0[i]).flatten().tolist()
        e_new = sum((a - t) ** 2 for a, t in zip(v[i].detach().flatten().tolist(), tgt, strict=True)) / N
        e_old = sum((a - t) ** 2 for a, t in zip(v_old[i].flatten().tolist(), tgt, strict=True)) / N
        rho = math.exp(-float(sigmas[i]) * e_new + float(sigmas[i]) * e_old)
        a = max(-5.0, min(5.0, ADV[i]))
        total += weights[i] * max(-a * rho, -a * min(max(rho, 1 - clip), 1 + clip))
        ratios.append(rho)
    assert loss.item() == pytest.approx(total / B, rel=1e-10)
    assert m["ratio_mean"] == pytest.approx(sum(ratios) / B, rel=1e-10)
    assert m["ppo_kl"] == pytest.approx(-sum(math.log(r) for r in ratios) / B, rel=1e-10)
    assert m["clipfrac"] == sum(abs(r - 1) > clip for r in ratios) / B


def test_kl_terms_and_that_constants_get_no_gradient():
    x0, eps, sigmas, v = make(3)
    g = torch.Generator().manual_seed(4)
    v_ref = torch.randn(B, C, H, W, generator=g, dtype=torch.float64).requires_grad_(True)
    v_ema = torch.randn(B, C, H, W, generator=g, dtype=torch.float64).requires_grad_(True)
    v_old = torch.randn(B, C, H, W, generator=g, dtype=torch.float64).requires_grad_(True)
    adv = torch.zeros(B, dtype=torch.float64, requires_grad=True)  # isolate the KL terms
    x0.requires_grad_(True)
    eps.requires_grad_(True)
    sigmas.requires_grad_(True)
    batch = AWMInputs(adv, x0, eps, sigmas, old_velocity=v_old, ref_velocity=v_ref, ema_velocity=v_ema)
    loss, m = AWMLoss().compute(batch, v, cfg(kl_coef=0.3, awm_ema_kl_coef=2.0))
    loss.backward()
    kl = ((v.detach() - v_ref.detach()) ** 2).mean().item()
    ema_kl = ((v.detach() - v_ema.detach()) ** 2).mean().item()
    assert loss.item() == pytest.approx(0.3 * kl + 2.0 * ema_kl, rel=1e-12)
    assert m["kl"] == pytest.approx(kl, rel=1e-12) and m["ema_kl"] == pytest.approx(ema_kl, rel=1e-12)
    expected = (0.3 * 2 * (v.detach() - v_ref.detach()) + 2.0 * 2 * (v.detach() - v_ema.detach())) / (N * B)
    torch.testing.assert_close(v.grad, expected)
    for constant in (v_ref, v_ema, v_old, adv, x0, eps, sigmas):
        assert constant.grad is None


def test_refuses_sde_step_inputs_and_missing_anchors():
    x0, eps, sigmas, v = make(5)
    step = StepOut(v, torch.zeros(B), v, torch.ones(B), torch.ones(B), torch.ones(B))
    with pytest.raises(ValueError, match="AWMInputs"):
        AWMLoss().compute(LossInputs(torch.zeros(B), torch.zeros(B)), step, cfg())
    batch = AWMInputs(torch.zeros(B, dtype=torch.float64), x0, eps, sigmas)
    with pytest.raises(ValueError, match="ref_velocity"):
        AWMLoss().compute(batch, v, cfg(kl_coef=0.1))
    with pytest.raises(ValueError, match="awm_weighting"):
        AWMLoss().compute(batch, v, cfg(awm_weighting="t"))
    with pytest.raises(ValueError, match="latents' shape"):
        AWMInputs(torch.zeros(B), x0, eps[:, :1], sigmas)
