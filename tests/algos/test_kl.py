import pytest
import torch
from torch.distributions import Normal, kl_divergence

from diffrl.algos import KLLoss, LossInputs
from diffrl.config.schema import LossConfig
from diffrl.sde import StepOut

B, C, H, W = 3, 4, 5, 6


def make(seed=0):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(B, C, H, W, generator=g, dtype=torch.float64).requires_grad_(True)
    ref = torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    std_dev_t_B = torch.rand(B, generator=g, dtype=torch.float64) + 0.3
    sqrt_neg_dt_B = torch.rand(B, generator=g, dtype=torch.float64) * 0.3 + 0.05
    out = StepOut(
        next_latents=torch.zeros(B, C, H, W, dtype=torch.float64),
        log_prob_B=torch.zeros(B, dtype=torch.float64),
        mean=mean,
        std_B=std_dev_t_B * sqrt_neg_dt_B,
        std_dev_t_B=std_dev_t_B,
        sqrt_neg_dt_B=sqrt_neg_dt_B,
    )
    batch = LossInputs(advantages_B=torch.zeros(B), old_log_prob_B=torch.zeros(B), ref_mean=ref)
    return out, batch


def test_sde_variant_matches_the_flow_grpo_formula_by_hand():
    out, batch = make()
    loss, metrics = KLLoss().compute(batch, out, LossConfig(kl_std="sde"))
    mu, ref, s = out.mean.detach(), batch.ref_mean, out.std_dev_t_B
    n = C * H * W
    expected = 0.0
    for i in range(B):
        sq = sum(float(d) ** 2 for d in (mu[i] - ref[i]).flatten())
        expected += sq / n / (2 * float(s[i]) ** 2)
    expected /= B
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics == {"kl": pytest.approx(expected, rel=1e-12)}
    # gradient d kl / d μ_θ = (μ_θ − μ_ref) / (s² · n · B)
    loss.backward()
    torch.testing.assert_close(out.mean.grad, (mu - ref) / (s.view(B, 1, 1, 1) ** 2 * n * B))


def test_transition_variant_is_the_exact_gaussian_kl():
    out, batch = make(1)
    loss, metrics = KLLoss().compute(batch, out, LossConfig(kl_std="transition"))
    tau = out.std_B.view(B, 1, 1, 1).expand(B, C, H, W)
    exact = kl_divergence(Normal(out.mean.detach(), tau), Normal(batch.ref_mean, tau))
    torch.testing.assert_close(loss.detach(), exact.flatten(1).mean(1).mean(), rtol=1e-12, atol=0)
    assert metrics["kl"] == pytest.approx(loss.item())


def test_the_two_variants_differ_by_minus_dt_per_sample():
    out, batch = make(2)
    for i in range(B):
        one = StepOut(*(t[i : i + 1].detach() for t in vars(out).values()))
        one_batch = LossInputs(torch.zeros(1), torch.zeros(1), ref_mean=batch.ref_mean[i : i + 1])
        sde, _ = KLLoss().compute(one_batch, one, LossConfig(kl_std="sde"))
        exact, _ = KLLoss().compute(one_batch, one, LossConfig(kl_std="transition"))
        assert sde.item() == pytest.approx(exact.item() * float(out.sqrt_neg_dt_B[i]) ** 2, rel=1e-12)


def test_reference_mean_gets_no_grad():
    out, batch = make(3)
    batch.ref_mean.requires_grad_(True)
    loss, _ = KLLoss().compute(batch, out, LossConfig())
    loss.backward()
    assert batch.ref_mean.grad is None and out.mean.grad is not None


def test_errors():
    out, batch = make()
    no_ref = LossInputs(advantages_B=torch.zeros(B), old_log_prob_B=torch.zeros(B))
    with pytest.raises(ValueError, match=r"needs batch\.ref_mean"):
        KLLoss().compute(no_ref, out, LossConfig())
    with pytest.raises(ValueError, match="kl_std must be one of"):
        KLLoss().compute(batch, out, LossConfig(kl_std="bogus"))
    wrong = LossInputs(torch.zeros(B), torch.zeros(B), ref_mean=torch.zeros(B, C, H, W + 1))
    with pytest.raises(ValueError, match="same samples and latents"):
        KLLoss().compute(wrong, out, LossConfig())
    zero_std = StepOut(**{**vars(out), "std_dev_t_B": torch.zeros(B, dtype=torch.float64)})
    with pytest.raises(ValueError, match="non-positive std"):
        KLLoss().compute(batch, zero_std, LossConfig())
