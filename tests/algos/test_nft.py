from types import SimpleNamespace

import pytest
import torch

from diffrl.algos import LossInputs, algorithm
from diffrl.algos.nft import (
    DiffusionNFTLoss,
    NFTInputs,
    adaptive_weight,
    ema_update_,
    implicit_velocities,
    old_policy_decay,
    optimality_probability,
    timestep_subset,
    timestep_subset_mask,
)

B, C, H, W = 3, 2, 2, 3
N = C * H * W


def cfg(**overrides):
    base = dict(mix_beta=0.1, adv_clip_max=5.0, nft_weight_min=1e-5, kl_coef=0.0)
    base.update(overrides)
    return SimpleNamespace(**base)


# ---------------------------------------------------------------------------- probabilities
ADV = torch.tensor([-7.0, -5.0, -2.5, 0.0, 2.5, 5.0, 9.0])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # r = Â/10 + 1/2 with Â the advantage clamped to ±5, reshaped per mode
        ("continuous", [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]),
        ("positive_only", [0.5, 0.5, 0.5, 0.5, 0.75, 1.0, 1.0]),
        ("negative_only", [0.0, 0.0, 0.25, 0.5, 0.5, 0.5, 0.5]),
        ("one_only", [0.5, 0.5, 0.5, 0.5, 0.6, 0.6, 0.6]),
        ("binary", [0.4, 0.4, 0.4, 0.5, 0.6, 0.6, 0.6]),
    ],
)
def test_optimality_probabilities(mode, expected):
    r = optimality_probability(ADV, 5.0, mode)
    torch.testing.assert_close(r, torch.tensor(expected))


def test_probability_errors():
    with pytest.raises(ValueError, match="adv_mode"):
        optimality_probability(ADV, 5.0, "soft")
    with pytest.raises(ValueError, match="adv_clip_max"):
        optimality_probability(ADV, 0.0)


# ------------------------------------------------------------------------------- velocities
def test_implicit_velocities_mirror_around_the_old_policy():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    v_old = torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    beta = 0.1
    v_pos, v_neg = implicit_velocities(v, v_old, beta)
    torch.testing.assert_close(v_pos, 0.1 * v + 0.9 * v_old)
    torch.testing.assert_close(v_neg, 1.1 * v_old - 0.1 * v)
    torch.testing.assert_close(v_pos + v_neg, 2 * v_old)
    torch.testing.assert_close(v_pos - v_old, beta * (v - v_old))


def test_adaptive_weight_is_the_mean_abs_error_with_a_floor():
    x0 = torch.zeros(2, 4)
    pred = torch.tensor([[1.0, -3.0, 0.0, 0.0], [1e-7, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(
        adaptive_weight(pred, x0, 1e-5), torch.tensor([1.0, 1e-5], dtype=torch.float64)
    )


# ------------------------------------------------------------------------------------- loss
def make(seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    eps = torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    t = torch.tensor([0.3, 0.6, 0.9], dtype=torch.float64)
    x_t = (1 - t.view(B, 1, 1, 1)) * x0 + t.view(B, 1, 1, 1) * eps
    v_old = eps - x0 + 0.2 * torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    v = (v_old + 0.05 * torch.randn(B, C, H, W, generator=g, dtype=torch.float64)).requires_grad_(True)
    r = torch.tensor([0.9, 0.5, 0.1], dtype=torch.float64)
    return r, x0, x_t, t, v_old, v


def reference_loss(r, x0, x_t, t, v_old, v, beta, c, w_min):
    """Scalar float64 loop: the NFT formula per sample and element."""
    total = 0.0
    pos_terms, neg_terms = [], []
    for i in range(B):
        xs = x0[i].flatten().tolist()
        xts = x_t[i].flatten().tolist()
        vs = v[i].flatten().tolist()
        vos = v_old[i].flatten().tolist()
        ti = float(t[i])
        pos = [xt - ti * (beta * a + (1 - beta) * o) for xt, a, o in zip(xts, vs, vos, strict=True)]
        neg = [xt - ti * ((1 + beta) * o - beta * a) for xt, a, o in zip(xts, vs, vos, strict=True)]
        w_pos = max(sum(abs(p - x) for p, x in zip(pos, xs, strict=True)) / N, w_min)
        w_neg = max(sum(abs(q - x) for q, x in zip(neg, xs, strict=True)) / N, w_min)
        pos_l = sum((p - x) ** 2 for p, x in zip(pos, xs, strict=True)) / N / w_pos
        neg_l = sum((q - x) ** 2 for q, x in zip(neg, xs, strict=True)) / N / w_neg
        total += (float(r[i]) * pos_l + (1 - float(r[i])) * neg_l) / beta
        pos_terms.append(pos_l)
        neg_terms.append(neg_l)
    return c * total / B, pos_terms, neg_terms


def test_loss_against_a_scalar_reimplementation():
    r, x0, x_t, t, v_old, v = make()
    loss, m = algorithm("diffusion_nft").loss().compute(NFTInputs(r, x0, x_t, t, v_old), v, cfg())
    expected, pos_terms, neg_terms = reference_loss(r, x0, x_t, t, v_old, v.detach(), 0.1, 5.0, 1e-5)
    assert loss.item() == pytest.approx(expected, rel=1e-10)
    assert m["policy_loss"] == pytest.approx(expected, rel=1e-10)
    assert m["positive_loss"] == pytest.approx(sum(pos_terms) / B, rel=1e-10)
    assert m["negative_loss"] == pytest.approx(sum(neg_terms) / B, rel=1e-10)
    assert m["reward_prob_mean"] == pytest.approx(0.5)
    assert m["old_deviate"] == pytest.approx(((v.detach() - v_old) ** 2).mean().item(), rel=1e-10)


def test_gradient_closed_form_weights_detached_and_constants_without_grad():
    r, x0, x_t, t, v_old, v = make(1)
    beta, c = 0.3, 2.0
    consts = [x.clone().requires_grad_(True) for x in (r, x0, x_t, t, v_old)]
    loss, _ = DiffusionNFTLoss().compute(NFTInputs(*consts), v, cfg(mix_beta=beta, adv_clip_max=c))
    loss.backward()
    for constant in consts:
        assert constant.grad is None
    with torch.no_grad():
        tt = t.view(B, 1, 1, 1)
        e_pos = x_t - tt * (beta * v + (1 - beta) * v_old) - x0
        e_neg = x_t - tt * ((1 + beta) * v_old - beta * v) - x0
        w_pos = e_pos.abs().flatten(1).mean(1).view(B, 1, 1, 1)
        w_neg = e_neg.abs().flatten(1).mean(1).view(B, 1, 1, 1)
        rr = r.view(B, 1, 1, 1)
        # ∂x̂₀⁺/∂v = −β·t, ∂x̂₀⁻/∂v = +β·t; the /β cancels β; w± are constants
        expected = c / B * (rr * 2 * e_pos * (-tt) / (w_pos * N) + (1 - rr) * 2 * e_neg * tt / (w_neg * N))
    torch.testing.assert_close(v.grad, expected)


def test_reference_kl_term():
    r, x0, x_t, t, v_old, v = make(2)
    v_ref = torch.randn(B, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    base, _ = DiffusionNFTLoss().compute(NFTInputs(r, x0, x_t, t, v_old), v, cfg())
    loss, m = DiffusionNFTLoss().compute(NFTInputs(r, x0, x_t, t, v_old, v_ref), v, cfg(kl_coef=0.5))
    kl = ((v.detach() - v_ref) ** 2).mean().item()
    assert m["kl"] == pytest.approx(kl, rel=1e-12)
    assert loss.item() == pytest.approx(base.item() + 0.5 * kl, rel=1e-12)
    with pytest.raises(ValueError, match="ref_velocity"):
        DiffusionNFTLoss().compute(NFTInputs(r, x0, x_t, t, v_old), v, cfg(kl_coef=0.5))


def test_refuses_sde_inputs_and_bad_probabilities():
    r, x0, x_t, t, v_old, v = make(3)
    with pytest.raises(ValueError, match="NFTInputs"):
        DiffusionNFTLoss().compute(LossInputs(torch.zeros(B), torch.zeros(B)), v, cfg())
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        NFTInputs(r * 3, x0, x_t, t, v_old)
    with pytest.raises(ValueError, match="mix_beta"):
        DiffusionNFTLoss().compute(NFTInputs(r, x0, x_t, t, v_old), v, cfg(mix_beta=0.0))


# ------------------------------------------------------------------------------- old policy
@pytest.mark.parametrize(
    ("schedule", "values"),
    [
        ("copy", {0: 0.0, 1: 0.0, 75: 0.0, 10_000: 0.0}),
        # 0.001·step, capped at 0.5 from step 500 on
        ("linear_to_0_5", {0: 0.0, 1: 0.001, 250: 0.25, 499: 0.499, 500: 0.5, 501: 0.5, 10_000: 0.5}),
        # 0 before step 75, then 0.0075 per step, capped at 0.999 (reached between 208 and 209)
        (
            "delayed_linear_to_0_999",
            {0: 0.0, 74: 0.0, 75: 0.0, 76: 0.0075, 175: 0.75, 208: 0.9975, 209: 0.999, 5_000: 0.999},
        ),
        (0.3, {0: 0.3, 7: 0.3, 10_000: 0.3}),
        (0.0, {0: 0.0, 100: 0.0}),
    ],
)
def test_old_policy_decay_values(schedule, values):
    for step, expected in values.items():
        assert old_policy_decay(schedule, step) == pytest.approx(expected, abs=1e-12), step


def test_old_policy_decay_errors():
    with pytest.raises(ValueError, match="unknown old-policy schedule"):
        old_policy_decay("linear", 3)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        old_policy_decay(1.5, 3)
    with pytest.raises(ValueError, match="step"):
        old_policy_decay("copy", -1)


def test_ema_update_in_place():
    g = torch.Generator().manual_seed(0)
    old = [torch.nn.Parameter(torch.randn(3, 2, generator=g)), torch.randn(4, generator=g)]
    new = [torch.randn(3, 2, generator=g), torch.randn(4, generator=g)]
    old0 = [t.detach().clone() for t in old]
    new0 = [t.clone() for t in new]
    ema_update_(old, new, 0.75)
    for o, o0, n0, n in zip(old, old0, new0, new, strict=True):
        torch.testing.assert_close(o.detach(), 0.75 * o0 + 0.25 * n0)
        assert torch.equal(n, n0)  # sources untouched
    assert old[0].grad_fn is None and old[0].requires_grad  # still a leaf parameter
    ema_update_(old, new, 0.0)
    assert all(torch.equal(o.detach(), n) for o, n in zip(old, new, strict=True))
    kept = [t.detach().clone() for t in old]
    ema_update_(old, [torch.zeros_like(t) for t in new], 1.0)
    assert all(torch.equal(o.detach(), k) for o, k in zip(old, kept, strict=True))
    with pytest.raises(ValueError, match="decay"):
        ema_update_(old, new, 1.5)
    with pytest.raises(ValueError, match="targets"):
        ema_update_(old, new[:1], 0.5)


# ------------------------------------------------------------------------ timestep subsets
def gens(*seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_timestep_subset_sizes_distinct_sorted_and_per_sample():
    idx = timestep_subset(10, 0.6, gens(1, 2, 3))
    assert idx.shape == (3, 6) and idx.dtype == torch.int64
    for row in idx.tolist():
        assert row == sorted(set(row)) and all(0 <= j < 10 for j in row)
    # a sample's subset depends on its own generator only
    assert torch.equal(timestep_subset(10, 0.6, gens(2))[0], idx[1])
    assert timestep_subset(10, 0.01, gens(1)).shape == (1, 1)  # at least one step
    assert timestep_subset(4, 1.0, gens(1)).tolist() == [[0, 1, 2, 3]]
    mask = timestep_subset_mask(idx, 10)
    assert mask.shape == (3, 10) and mask.sum(dim=1).tolist() == [6, 6, 6]
    assert all(mask[i, j] for i in range(3) for j in idx[i].tolist())


def test_timestep_subset_is_uniform_over_steps():
    counts = torch.zeros(5)
    for seed in range(2000):
        counts += timestep_subset_mask(timestep_subset(5, 0.4, gens(seed)), 5)[0]
    # each step is in a 2-of-5 subset with probability 0.4: 800 expected per step
    assert ((counts - 800).abs() < 80).all(), counts


def test_timestep_subset_errors():
    with pytest.raises(ValueError, match="fraction"):
        timestep_subset(10, 0.0, gens(1))
    with pytest.raises(ValueError, match="Generator"):
        timestep_subset(10, 0.5, [])
