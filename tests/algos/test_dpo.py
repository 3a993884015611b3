import math
from types import SimpleNamespace

import pytest
import torch

from diffrl.algos import LossInputs, algorithm
from diffrl.algos.dpo import DPOInputs, DPOLoss, preference_pairs, sample_logit_normal_sigmas

C, H, W = 2, 2, 2
N = C * H * W


def cfg(beta=2.0):
    return SimpleNamespace(dpo_beta=beta)


# ------------------------------------------------------------------------------------ pairs
def test_best_and_worst_per_group_with_ties():
    rewards = torch.tensor([0.1, 0.9, 0.5, 0.3, 0.3, 0.3, 0.7, 0.2, 0.7, 0.2, 4.0])
    uids = ["a", "a", "a", "b", "b", "b", "c", "c", "c", "c", "d"]
    chosen, rejected = preference_pairs(rewards, uids)
    # a: best 1, worst 0; b: all tie -> no pair; c: best 6 (first of two 0.7), worst 7 (first 0.2);
    # d: a single sample -> no pair
    assert chosen.tolist() == [1, 6] and rejected.tolist() == [0, 7]
    assert chosen.dtype == torch.int64


def test_pairs_follow_group_order_of_first_appearance_and_interleaved_uids():
    rewards = torch.tensor([3.0, 1.0, 2.0, 0.0])
    chosen, rejected = preference_pairs(rewards, torch.tensor([7, 5, 7, 5]))
    assert chosen.tolist() == [0, 1] and rejected.tolist() == [2, 3]
    empty_c, empty_r = preference_pairs(torch.ones(4), [0, 0, 1, 1])
    assert empty_c.numel() == 0 and empty_r.numel() == 0
    with pytest.raises(ValueError, match="non-finite"):
        preference_pairs(torch.tensor([0.0, float("nan")]), [0, 0])


# ----------------------------------------------------------------------------- sigmas
def test_logit_normal_sigmas_are_seeded_and_follow_the_formula():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(5, generator=g, dtype=torch.float64)
    u = 1 / (1 + torch.exp(-(0.5 + 0.8 * z)))
    expected = (3.0 * u / (1 + 2.0 * u)).float()
    got = sample_logit_normal_sigmas(torch.Generator().manual_seed(3), 5, mean=0.5, std=0.8, shift=3.0)
    torch.testing.assert_close(got, expected)
    assert got.dtype == torch.float32 and bool(((got > 0) & (got < 1)).all())
    # one generator per draw: a draw does not depend on the others
    per_pair = sample_logit_normal_sigmas([torch.Generator().manual_seed(s) for s in (1, 2)])
    alone = sample_logit_normal_sigmas([torch.Generator().manual_seed(2)])
    assert per_pair[1] == alone[0]


def test_logit_normal_median_is_sigmoid_of_the_mean():
    s = sample_logit_normal_sigmas(torch.Generator().manual_seed(0), 20000, mean=1.0)
    assert s.median().item() == pytest.approx(1 / (1 + math.exp(-1.0)), abs=0.01)
    with pytest.raises(ValueError, match="num"):
        sample_logit_normal_sigmas(torch.Generator(), None)


# ----------------------------------------------------------------------------------- loss
def constant_case(err_theta, err_ref, beta):
    """Pairs whose per-sample errors are known: v − u is the constant sqrt(e) in every element."""
    p = len(err_theta) // 2
    g = torch.Generator().manual_seed(0)
    chosen = torch.randn(p, C, H, W, generator=g, dtype=torch.float64)
    rejected = torch.randn(p, C, H, W, generator=g, dtype=torch.float64)
    noise = torch.randn(p, C, H, W, generator=g, dtype=torch.float64)
    sigmas = torch.rand(p, generator=g, dtype=torch.float64) * 0.8 + 0.1
    u = torch.cat([noise, noise]) - torch.cat([chosen, rejected])
    shift = lambda e: torch.tensor([math.sqrt(x) for x in e], dtype=torch.float64).view(-1, 1, 1, 1)  # noqa: E731
    v = (u + shift(err_theta)).requires_grad_(True)
    v_ref = u - shift(err_ref)
    return DPOInputs(chosen, rejected, noise, sigmas, v_ref), v


def test_z_loss_and_implicit_accuracy_by_hand():
    beta = 4.0
    # e_θ(w), e_θ(w'), e_θ(l), e_θ(l')  and the reference's
    err_theta = [0.10, 0.35, 0.40, 0.20]
    err_ref = [0.30, 0.30, 0.30, 0.30]
    batch, v = constant_case(err_theta, err_ref, beta)
    loss, m = algorithm("dpo").loss().compute(batch, v, cfg(beta))
    # pair 0: Δ_w = −0.2,  Δ_l = 0.1  -> z = −2·(−0.3)  = 0.6
    # pair 1: Δ_w = 0.05,  Δ_l = −0.1 -> z = −2·(0.15)  = −0.3
    z = [0.6, -0.3]
    expected = sum(-math.log(1 / (1 + math.exp(-x))) for x in z) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-10)
    assert m["dpo_loss"] == pytest.approx(expected, rel=1e-10)
    assert m["implicit_acc"] == 0.5
    assert m["reward_chosen"] == pytest.approx((0.4 + -0.1) / 2, abs=1e-12)  # −(β/2)·Δ_w
    assert m["reward_rejected"] == pytest.approx((-0.2 + 0.2) / 2, abs=1e-12)
    assert m["reward_margin"] == pytest.approx((0.6 - 0.3) / 2, abs=1e-12)
    assert m["mse_chosen"] == pytest.approx(0.225) and m["mse_rejected"] == pytest.approx(0.3)


def test_gradient_and_constants():
    beta = 3.0
    batch, v = constant_case([0.2, 0.3, 0.1, 0.6, 0.25, 0.4], [0.3, 0.2, 0.5, 0.1, 0.3, 0.2], beta)
    for t in (batch.chosen_latents, batch.rejected_latents, batch.noise, batch.sigmas_P, batch.ref_velocity):
        t.requires_grad_(True)
    loss, _ = DPOLoss().compute(batch, v, cfg(beta))
    loss.backward()
    for t in (batch.chosen_latents, batch.rejected_latents, batch.noise, batch.sigmas_P, batch.ref_velocity):
        assert t.grad is None
    with torch.no_grad():
        u = batch.target
        e = (v - u).pow(2).flatten(1).mean(1)
        e_ref = (batch.ref_velocity - u).pow(2).flatten(1).mean(1)
        p = batch.num_pairs
        z = -0.5 * beta * ((e[:p] - e_ref[:p]) - (e[p:] - e_ref[p:]))
        s = torch.sigmoid(-z).view(p, 1, 1, 1)  # −dL/dz·P
        expected = torch.cat([s * beta * (v[:p] - u[:p]) / (N * p), -s * beta * (v[p:] - u[p:]) / (N * p)])
    torch.testing.assert_close(v.grad, expected)


def test_noisy_latents_share_noise_and_level_within_a_pair():
    batch, _ = constant_case([0.1, 0.2], [0.1, 0.2], 1.0)
    x_t = batch.noisy_latents
    t = batch.sigmas_P.view(-1, 1, 1, 1)
    torch.testing.assert_close(x_t[:1], (1 - t) * batch.chosen_latents + t * batch.noise)
    torch.testing.assert_close(x_t[1:], (1 - t) * batch.rejected_latents + t * batch.noise)


def test_large_beta_is_finite_and_errors():
    batch, v = constant_case([0.1, 0.9], [0.9, 0.1], 1.0)
    loss, m = DPOLoss().compute(batch, v, cfg(2000.0))
    assert math.isfinite(loss.item()) and m["implicit_acc"] == 1.0
    batch_bad, v_bad = constant_case([0.9, 0.1], [0.1, 0.9], 1.0)
    loss_bad, _ = DPOLoss().compute(batch_bad, v_bad, cfg(2000.0))
    assert loss_bad.item() == pytest.approx(0.5 * 2000.0 * 1.6, rel=1e-6)  # softplus(z) ≈ z for large z
    with pytest.raises(ValueError, match="DPOInputs"):
        DPOLoss().compute(LossInputs(torch.zeros(2), torch.zeros(2)), v, cfg())
    with pytest.raises(ValueError, match="2P rows"):
        DPOLoss().compute(batch, v[:1], cfg())
    with pytest.raises(ValueError, match="ref_velocity"):
        DPOInputs(batch.chosen_latents, batch.rejected_latents, batch.noise, batch.sigmas_P, v[:1])
