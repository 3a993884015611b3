import math
from types import SimpleNamespace

import pytest
import torch

from diffrl.algos import FlowGRPOLoss, LossInputs
from diffrl.algos.rollout_correction import (
    divergence_statistic,
    effective_sample_size,
    importance_weights,
    mismatch_metrics,
    rejection_mask,
    rollout_correction,
    rollout_correction_from_config,
)
from diffrl.sde import StepOut

# λ = logp_old − logp_rollout for 3 samples × 2 window steps
LAM = [[0.1, -0.3], [1.0, 0.2], [-2.0, 0.5]]
ROLLOUT = torch.tensor([[-1.0, -2.0], [-0.5, -1.5], [-3.0, -0.2]], dtype=torch.float64)
OLD = ROLLOUT + torch.tensor(LAM, dtype=torch.float64)


def lam():
    return torch.tensor(LAM, dtype=torch.float64)


def test_per_step_truncated_weights():
    w, raw = importance_weights(lam(), "step", "truncate", threshold=2.0, lower=0.5)
    expected_raw = [[math.exp(x) for x in row] for row in LAM]
    torch.testing.assert_close(raw, torch.tensor(expected_raw, dtype=torch.float64))
    # only e^1.0 = 2.718 exceeds the threshold 2
    expected = [[min(x, 2.0) for x in row] for row in expected_raw]
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float64))


def test_sequence_and_geometric_weights_are_per_sample():
    w_seq, raw_seq = importance_weights(lam(), "sequence", "truncate", threshold=3.0, lower=0.5)
    sums = [sum(row) for row in LAM]  # -0.2, 1.2, -1.5
    for b, s in enumerate(sums):
        assert raw_seq[b].tolist() == pytest.approx([math.exp(s)] * 2)
        assert w_seq[b].tolist() == pytest.approx([min(math.exp(s), 3.0)] * 2)
    w_geo, _ = importance_weights(lam(), "geometric", "truncate", threshold=3.0, lower=0.5)
    for b, row in enumerate(LAM):
        # geometric mean of the per-step ratios
        geo = math.sqrt(math.exp(row[0]) * math.exp(row[1]))
        assert w_geo[b].tolist() == pytest.approx([geo, geo])


def test_masked_weights_zero_outside_the_band():
    w, _ = importance_weights(lam(), "step", "mask", threshold=2.0, lower=0.5)
    expected = [[math.exp(x) if 0.5 <= math.exp(x) <= 2.0 else 0.0 for x in row] for row in LAM]
    # e^1.0 > 2 and e^-2 < 0.5 are zeroed
    assert expected[1][0] == 0.0 and expected[2][0] == 0.0
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float64))


def test_weights_are_clamped_before_exp():
    big = torch.tensor([[15.0, 15.0]], dtype=torch.float64)  # sum 30 -> clamped to 20
    w, raw = importance_weights(big, "sequence", "truncate", threshold=2.0, lower=0.5)
    assert raw[0, 0].item() == pytest.approx(math.exp(20.0)) and w[0, 0].item() == 2.0


def test_divergence_statistics():
    x = lam()
    torch.testing.assert_close(divergence_statistic(x, "k1"), -x)
    torch.testing.assert_close(
        divergence_statistic(x, "k2"),
        torch.tensor([[v * v / 2 for v in r] for r in LAM], dtype=torch.float64),
    )
    k3 = [[math.exp(v) - 1 - v for v in r] for r in LAM]
    torch.testing.assert_close(divergence_statistic(x, "k3"), torch.tensor(k3, dtype=torch.float64))
    assert (divergence_statistic(x, "k3") >= 0).all()


@pytest.mark.parametrize(
    ("estimator", "threshold", "level", "expected_keep"),
    [
        # k1 = −λ, |k1| > 0.4 rejected: 1.0, −2.0 and 0.5 (by |·|)
        ("k1", 0.4, "step", [[True, True], [False, True], [False, False]]),
        # k2 = λ²/2: 0.005 0.045 | 0.5 0.02 | 2.0 0.125 ; > 0.1 rejected
        ("k2", 0.1, "step", [[True, True], [False, True], [False, False]]),
        # k3 = e^λ − 1 − λ: 0.0052 0.0408 | 0.718 0.0214 | 1.135 0.149 ; > 0.5 rejected
        ("k3", 0.5, "step", [[True, True], [False, True], [False, True]]),
        # sequence_mean of k2: 0.025 | 0.26 | 1.0625 ; > 0.3 rejects sample 2 only
        ("k2", 0.3, "sequence_mean", [[True, True], [True, True], [False, False]]),
        # sequence_sum of k2: 0.05 | 0.52 | 2.125 ; > 0.3 rejects samples 1 and 2
        ("k2", 0.3, "sequence_sum", [[True, True], [False, False], [False, False]]),
        # sequence_max of k3: 0.0408 | 0.718 | 1.135 ; > 0.1 rejects samples 1 and 2
        ("k3", 0.1, "sequence_max", [[True, True], [False, False], [False, False]]),
        # sequence_mean of k1 (= −mean λ): 0.1 | −0.6 | 0.75 ; |·| > 0.5 rejects samples 1 and 2
        ("k1", 0.5, "sequence_mean", [[True, True], [False, False], [False, False]]),
    ],
)
def test_rejection_masks(estimator, threshold, level, expected_keep):
    keep, stat = rejection_mask(lam(), estimator, threshold, level)
    assert keep.tolist() == expected_keep
    assert stat.shape == ((3, 2) if level == "step" else (3,))


def test_effective_sample_size():
    assert effective_sample_size(torch.ones(7)) == pytest.approx(1.0)
    assert effective_sample_size(torch.tensor([0.0, 0.0, 5.0, 0.0])) == pytest.approx(1 / 4)
    assert effective_sample_size(torch.tensor([1.0, 2.0, 3.0])) == pytest.approx(36 / (3 * 14))
    assert effective_sample_size(torch.zeros(3)) == 0.0


def test_mismatch_metrics_by_hand():
    m = mismatch_metrics(OLD, ROLLOUT)
    flat = [abs(x) for row in LAM for x in row]
    assert m["rollout_correction/abs_logp_diff_mean"] == pytest.approx(sum(flat) / 6)
    assert m["rollout_correction/abs_logp_diff_max"] == pytest.approx(2.0)
    assert m["rollout_correction/step0/abs_logp_diff_mean"] == pytest.approx((0.1 + 1.0 + 2.0) / 3)
    assert m["rollout_correction/step0/abs_logp_diff_max"] == pytest.approx(2.0)
    assert m["rollout_correction/step1/abs_logp_diff_mean"] == pytest.approx((0.3 + 0.2 + 0.5) / 3)
    assert m["rollout_correction/step1/abs_logp_diff_max"] == pytest.approx(0.5)
    assert m["rollout_correction/kl"] == pytest.approx(-sum(x for row in LAM for x in row) / 6)
    k3 = [math.exp(x) - 1 - x for row in LAM for x in row]
    assert m["rollout_correction/k3_kl"] == pytest.approx(sum(k3) / 6)


def test_combined_weights_are_is_times_keep_with_metrics():
    w, m = rollout_correction(
        OLD,
        ROLLOUT,
        is_level="step",
        is_mode="truncate",
        is_threshold=2.0,
        rejection="k2",
        rejection_threshold=0.1,
    )
    assert w.dtype == torch.float32 and w.shape == (3, 2) and not w.requires_grad
    is_w = [[min(math.exp(x), 2.0) for x in row] for row in LAM]
    keep = [[True, True], [False, True], [False, False]]
    expected = [[is_w[b][j] * keep[b][j] for j in range(2)] for b in range(3)]
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float32))
    assert m["rollout_correction/rollout_rs_masked_fraction"] == pytest.approx(3 / 6)
    assert m["rollout_correction/rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 3)
    assert m["rollout_correction/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 6)  # e^1.0
    assert m["rollout_correction/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 6)  # e^-2
    assert m["rollout_correction/rollout_is_max"] == 2.0
    flat = [x for row in expected for x in row]
    ess = sum(flat) ** 2 / (6 * sum(x * x for x in flat))
    assert m["rollout_correction/rollout_is_eff_sample_size"] == pytest.approx(ess)
    assert m["rollout_correction/rollout_rs_k2_max"] == pytest.approx(2.0)


def test_bypass_mode_old_equals_rollout_is_the_identity():
    w, m = rollout_correction(
        ROLLOUT, ROLLOUT, is_level="sequence", is_mode="mask", rejection="k3", rejection_threshold=1e-6
    )
    assert torch.equal(w, torch.ones(3, 2))
    assert m["rollout_correction/abs_logp_diff_max"] == 0.0 and m["rollout_correction/k3_kl"] == 0.0
    assert m["rollout_correction/rollout_rs_masked_fraction"] == 0.0
    assert m["rollout_correction/rollout_is_eff_sample_size"] == 1.0


def test_all_off_gives_ones_and_only_diagnostics():
    w, m = rollout_correction(OLD, ROLLOUT)
    assert torch.equal(w, torch.ones(3, 2))
    assert not any("rollout_is" in k or "rollout_rs" in k for k in m)


def test_from_config_reads_the_named_keys():
    cfg = SimpleNamespace(
        is_level="geometric",
        is_mode="mask",
        is_threshold=1.5,
        is_lower=0.7,
        rejection="k3",
        rejection_threshold=0.5,
        rejection_level="sequence_max",
    )
    w, _ = rollout_correction_from_config(OLD, ROLLOUT, cfg)
    direct, _ = rollout_correction(
        OLD,
        ROLLOUT,
        is_level="geometric",
        is_mode="mask",
        is_threshold=1.5,
        is_lower=0.7,
        rejection="k3",
        rejection_threshold=0.5,
        rejection_level="sequence_max",
    )
    assert torch.equal(w, direct)
    # geometric means e^{-0.1}, e^{0.6}, e^{-0.75}: the last two fall outside [0.7, 1.5];
    # samples 1 and 2 are also rejected (max k3 0.718 and 1.135 > 0.5)
    assert w[:, 0].tolist() == pytest.approx([math.exp(-0.1), 0.0, 0.0])


def test_weights_zero_a_sample_in_the_loss():
    w, _ = rollout_correction(OLD, ROLLOUT, rejection="k2", rejection_threshold=0.1)
    logp = torch.zeros(3, requires_grad=True)
    out = StepOut(torch.zeros(3, 1), logp, torch.zeros(3, 1), torch.ones(3), torch.ones(3), torch.ones(3))
    batch = LossInputs(torch.ones(3), torch.zeros(3), weights_B=w[:, 0])
    loss, _ = FlowGRPOLoss().compute(batch, out, SimpleNamespace(clip_ratio=0.2, adv_clip_max=5.0))
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1 / 3, 0.0, 0.0])


def test_errors():
    with pytest.raises(ValueError, match=r"\(B, W\)"):
        rollout_correction(OLD[0], ROLLOUT[0])
    with pytest.raises(ValueError, match="same shape"):
        rollout_correction(OLD, ROLLOUT[:, :1])
    with pytest.raises(ValueError, match="is_level"):
        rollout_correction(OLD, ROLLOUT, is_level="token")
    with pytest.raises(ValueError, match="is_mode"):
        rollout_correction(OLD, ROLLOUT, is_level="step", is_mode="clip")
    with pytest.raises(ValueError, match="sequence_max"):
        rollout_correction(OLD, ROLLOUT, rejection="k1", rejection_level="sequence_max")
    with pytest.raises(ValueError, match="rejection_level"):
        rollout_correction(OLD, ROLLOUT, rejection="k2", rejection_level="seq")
    with pytest.raises(ValueError, match="is_lower"):
        rollout_correction(OLD, ROLLOUT, is_level="step", is_lower=3.0)
    with pytest.raises(ValueError, match="non-finite"):
        rollout_correction(OLD * float("nan"), ROLLOUT)
