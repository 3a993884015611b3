import math

import pytest
import torch

from diffrl.algos import FlowGRPOLoss, LossInputs, algorithm
from diffrl.config.schema import LossConfig
from diffrl.sde import StepOut


def step_out(log_prob_B):
    batch = log_prob_B.shape[0]
    ones = torch.ones(batch)
    return StepOut(
        next_latents=torch.zeros(batch, 2),
        log_prob_B=log_prob_B,
        mean=torch.zeros(batch, 2),
        std_B=ones,
        std_dev_t_B=ones,
        sqrt_neg_dt_B=ones,
    )


def run(adv, old_logp, logp, cfg, weights=None):
    """Loss, metrics and d loss / d logp (logp is a fresh leaf)."""
    logp = torch.as_tensor(logp, dtype=torch.float32).clone().requires_grad_(True)
    batch = LossInputs(
        advantages_B=torch.as_tensor(adv, dtype=torch.float32),
        old_log_prob_B=torch.as_tensor(old_logp, dtype=torch.float32),
        weights_B=None if weights is None else torch.as_tensor(weights, dtype=torch.float32),
    )
    loss, metrics = FlowGRPOLoss().compute(batch, step_out(logp), cfg)
    loss.backward()
    return loss, metrics, logp.grad


def test_on_policy_loss_and_gradient():
    adv = [0.5, -1.5, 7.0, -9.0, 0.0, 2.0]  # 7 and -9 are clamped to ±5
    clamped = torch.tensor([0.5, -1.5, 5.0, -5.0, 0.0, 2.0])
    old = torch.randn(6, generator=torch.Generator().manual_seed(0)) - 3.0
    loss, metrics, grad = run(adv, old, old, LossConfig())
    batch = len(adv)
    torch.testing.assert_close(loss, -clamped.mean())
    torch.testing.assert_close(grad, -clamped / batch)
    assert metrics["ppo_kl"] == 0.0 and metrics["clipfrac"] == 0.0
    assert metrics["ratio_mean"] == 1.0 and metrics["ratio_std"] == 0.0
    assert metrics["policy_loss"] == pytest.approx(loss.item())


def test_adv_clip_max_is_read_from_cfg():
    _, _, grad = run([3.0, -3.0], [0.0, 0.0], [0.0, 0.0], LossConfig(adv_clip_max=1.0))
    torch.testing.assert_close(grad, torch.tensor([-1.0, 1.0]) / 2)


def test_clipping_stops_the_gradient_in_the_ppo_direction():
    eps = 0.2
    ratio = [1.5, 0.5, 0.5, 1.5, 1.1, 0.9]
    adv = [1.0, 1.0, -1.0, -1.0, 2.0, -2.0]
    logp = [math.log(r) for r in ratio]
    _, _, grad = run(adv, [0.0] * 6, logp, LossConfig(clip_ratio=eps))
    batch = 6
    # d/dlogp of −A·ρ is −A·ρ; the clipped branch is constant.
    assert grad[0] == 0.0  # A>0, ρ>1+ε: already pushed up enough -> zero
    assert grad[1] == pytest.approx(-1.0 * 0.5 / batch)  # A>0, ρ<1−ε: still pushed up
    assert grad[2] == 0.0  # A<0, ρ<1−ε: already pushed down enough -> zero
    assert grad[3] == pytest.approx(+1.0 * 1.5 / batch)  # A<0, ρ>1+ε: still pushed down
    assert grad[4] == pytest.approx(-2.0 * 1.1 / batch)  # inside the clip range
    assert grad[5] == pytest.approx(+2.0 * 0.9 / batch)


# Hand-made case, ε = 0.2, logp_old = 0, ρ = (1.5, 0.5, 0.5, 1.5, 1.1, 1.3), A = (1, 1, -1, -1, 2, -0.5).
# Per-sample ℓ = max(−Aρ, −A·clip(ρ)):
#   max(-1.5, -1.2) = -1.2 | max(-0.5, -0.8) = -0.5 | max(0.5, 0.8) = 0.8 | max(1.5, 1.2) = 1.5
#   | -2.2 (inside the clip range) | max(0.65, 0.6) = 0.65;  sum = -0.95
HAND_RATIO = [1.5, 0.5, 0.5, 1.5, 1.1, 1.3]
HAND_ADV = [1.0, 1.0, -1.0, -1.0, 2.0, -0.5]
HAND_TERMS = [-1.2, -0.5, 0.8, 1.5, -2.2, 0.65]


def test_metrics_on_a_hand_made_case():
    logp = [math.log(r) for r in HAND_RATIO]
    loss, m, _ = run(HAND_ADV, [0.0] * 6, logp, LossConfig(clip_ratio=0.2))
    assert loss.item() == pytest.approx(-0.95 / 6, rel=1e-6)
    assert m["policy_loss"] == pytest.approx(-0.95 / 6, rel=1e-6)
    log_sum = 2 * math.log(1.5) + 2 * math.log(0.5) + math.log(1.1) + math.log(1.3)
    assert m["ppo_kl"] == pytest.approx(-log_sum / 6, rel=1e-6)
    assert m["clipfrac"] == pytest.approx(5 / 6)  # all but ρ = 1.1
    assert m["clipfrac_higher"] == pytest.approx(3 / 6)  # 1.5, 1.5, 1.3
    assert m["clipfrac_lower"] == pytest.approx(2 / 6)  # 0.5, 0.5
    assert m["ratio_mean"] == pytest.approx(6.4 / 6, rel=1e-6)
    # population variance = mean(ρ²) − mean(ρ)²; Σρ² = 2.25 + .25 + .25 + 2.25 + 1.21 + 1.69 = 7.9
    assert m["ratio_std"] == pytest.approx(math.sqrt(7.9 / 6 - (6.4 / 6) ** 2), rel=1e-6)
    assert all(isinstance(v, float) for v in m.values())


def test_weights_scale_per_sample_terms_and_get_no_grad():
    weights = torch.tensor([2.0, 0.0, 0.5, 1.0, 3.0, 1.5], requires_grad=True)
    logp = [math.log(r) for r in HAND_RATIO]
    cfg = LossConfig(clip_ratio=0.2)
    loss_w, m_w, grad_w = run(HAND_ADV, [0.0] * 6, logp, cfg, weights=weights)
    _, m, grad = run(HAND_ADV, [0.0] * 6, logp, cfg)
    expected = sum(w * t for w, t in zip(weights.tolist(), HAND_TERMS, strict=True)) / 6
    assert loss_w.item() == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(grad_w, grad * weights.detach())
    assert weights.grad is None
    # diagnostics are unweighted
    assert m_w["clipfrac"] == m["clipfrac"] and m_w["ratio_mean"] == m["ratio_mean"]


def test_old_log_prob_and_advantages_are_constants():
    adv = torch.tensor([1.0, -1.0], requires_grad=True)
    old = torch.tensor([0.1, 0.2], requires_grad=True)
    logp = torch.tensor([0.1, 0.2], requires_grad=True)
    loss, _ = algorithm("flow_grpo").loss().compute(LossInputs(adv, old), step_out(logp), LossConfig())
    loss.backward()
    assert adv.grad is None and old.grad is None and logp.grad is not None


def test_shape_errors():
    with pytest.raises(ValueError, match="old_log_prob_B must have shape"):
        LossInputs(advantages_B=torch.zeros(3), old_log_prob_B=torch.zeros(2))
    with pytest.raises(ValueError, match="weights_B must have shape"):
        LossInputs(torch.zeros(3), torch.zeros(3), weights_B=torch.ones(3, 1))
    with pytest.raises(ValueError, match="ref_mean must have shape"):
        LossInputs(torch.zeros(3), torch.zeros(3), ref_mean=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="same samples"):
        FlowGRPOLoss().compute(
            LossInputs(torch.zeros(3), torch.zeros(3)), step_out(torch.zeros(4)), LossConfig()
        )
