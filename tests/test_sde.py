"""diffrl.sde.step against independent float64 formulas (docs/algorithms.md, "One step, one function") and torch.distributions."""

import math

import pytest
import torch

from diffrl.sde import SDE_KINDS, StepOut, step

STOCHASTIC = ("sde", "cps", "dance_sde")
SHAPE = (6, 4, 5, 7)  # [B, C, H, W]
B = SHAPE[0]
ETA = 0.7
SIGMA_1 = 0.96  # a schedule's second sigma, for σ == 1


def _inputs(seed=0, velocity_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(SHAPE, generator=g)
    velocity = torch.randn(SHAPE, generator=g).to(velocity_dtype)
    noise = torch.randn(SHAPE, generator=g)
    return latents, velocity, noise


def _f64(value):
    """A sigma as the fp32 value step() computes with, in float64, shaped to broadcast over SHAPE."""
    t = torch.as_tensor(value, dtype=torch.float32).double()
    return t.view(-1, 1, 1, 1) if t.ndim == 1 else t


def _reference(kind, latents, velocity, sigma, sigma_next, eta, sigma_1=None):
    """(mean, std) of the transition, written from docs/algorithms.md in float64."""
    x, v = latents.double(), velocity.double()
    s, s_next = _f64(sigma), _f64(sigma_next)
    dt = s_next - s
    if kind == "sde":
        s_tilde = torch.where(s == 1, _f64(sigma_1), s) if sigma_1 is not None else s
        std_dev_t = eta * torch.sqrt(s / (1 - s_tilde))
        mean = x * (1 + std_dev_t**2 * dt / (2 * s)) + v * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
        return mean, std_dev_t * torch.sqrt(-dt)
    if kind == "cps":
        std = s_next * math.sin(eta * math.pi / 2)
        x0, x1 = x - s * v, x + (1 - s) * v
        return (1 - s_next) * x0 + torch.sqrt(s_next**2 - std**2) * x1, std
    if kind == "dance_sde":
        x0 = x - s * v
        score = -(x - (1 - s) * x0) / s**2
        return x + dt * v - 0.5 * eta**2 * score * dt, eta * torch.sqrt(s - s_next)
    raise AssertionError(kind)


def _reference_log_prob(kind, next_latents, mean, std):
    x_next = next_latents.double()
    if kind == "cps":
        logp = -((x_next - mean) ** 2)
    else:
        logp = -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return logp.mean(dim=(1, 2, 3))


def _per_sample_sigmas():
    return torch.tensor([0.9, 0.75, 0.6, 0.4, 0.2, 0.05]), torch.tensor([0.8, 0.6, 0.5, 0.3, 0.1, 0.0])


# --- the Gaussian transition, checked independently --------------------------------------------


@pytest.mark.parametrize("kind", ["sde", "dance_sde"])
@pytest.mark.parametrize("per_sample", [False, True])
def test_log_prob_is_the_normal_log_density(kind, per_sample):
    latents, velocity, noise = _inputs()
    sigma, sigma_next = _per_sample_sigmas() if per_sample else (0.7, 0.55)
    out = step(kind, latents, velocity, sigma, sigma_next, ETA, noise=noise)
    mean64, std64 = _reference(kind, latents, velocity, sigma, sigma_next, ETA)
    expected = torch.distributions.Normal(mean64, std64.expand_as(mean64)).log_prob(out.next_latents.double())
    torch.testing.assert_close(out.log_prob_B.double(), expected.mean(dim=(1, 2, 3)), rtol=1e-5, atol=0)
    torch.testing.assert_close(out.std_B.double(), std64.flatten().expand(B), rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", STOCHASTIC)
@pytest.mark.parametrize("case", ["mid", "per_sample", "first", "last"])
def test_fp32_matches_float64_reference(kind, case):
    """Relative error <= 1e-5 on log_prob and mean, with bf16 velocities as the network gives them."""
    latents, velocity, noise = _inputs(seed=1, velocity_dtype=torch.bfloat16)
    sigma, sigma_next = {
        "mid": (0.7, 0.55),
        "per_sample": _per_sample_sigmas(),
        "first": (1.0, SIGMA_1),
        "last": (0.1, 0.0),
    }[case]
    out = step(kind, latents, velocity, sigma, sigma_next, ETA, sigma_1=SIGMA_1, noise=noise)
    mean64, std64 = _reference(kind, latents, velocity, sigma, sigma_next, ETA, sigma_1=SIGMA_1)
    rel_mean = (out.mean.double() - mean64).norm() / mean64.norm()
    assert rel_mean <= 1e-5, rel_mean
    log_prob64 = _reference_log_prob(kind, out.next_latents, mean64, std64)
    # atol only for cps where σ' = 0: there s = 0 and the float64 log-prob is ~1e-16 instead of 0
    torch.testing.assert_close(out.log_prob_B.double(), log_prob64, rtol=1e-5, atol=1e-12)
    if kind == "cps" and case == "last":  # deterministic: the sampled x' has log_prob exactly 0
        assert torch.equal(out.log_prob_B, torch.zeros(B))
    # and x' is μ + std·ε with the given ε
    torch.testing.assert_close(
        out.next_latents.double(), mean64 + std64 * noise.double(), rtol=1e-5, atol=1e-5
    )


def test_sde_std_fields_relate_as_documented():
    latents, velocity, noise = _inputs()
    out = step("sde", latents, velocity, 0.7, 0.55, ETA, noise=noise)
    torch.testing.assert_close(out.std_B, out.std_dev_t_B * out.sqrt_neg_dt_B)
    torch.testing.assert_close(out.std_dev_t_B, torch.full((B,), ETA * math.sqrt(0.7 / 0.3)))
    torch.testing.assert_close(out.sqrt_neg_dt_B, torch.full((B,), math.sqrt(0.15)))
    for kind in ("cps", "dance_sde"):
        out = step(kind, latents, velocity, 0.7, 0.55, ETA, noise=noise)
        assert torch.equal(out.std_B, out.std_dev_t_B)


@pytest.mark.parametrize("kind", STOCHASTIC)
def test_small_noise_tends_to_the_euler_step(kind):
    latents, velocity, noise = _inputs()
    euler = latents + velocity * (0.55 - 0.7)
    mean_err, sample_err = [], []
    for eta in (1e-1, 1e-2, 1e-3, 1e-4):
        out = step(kind, latents, velocity, 0.7, 0.55, eta, noise=noise)
        mean_err.append((out.mean - euler).abs().max().item())
        sample_err.append((out.next_latents - euler).abs().max().item())
    assert sample_err == sorted(sample_err, reverse=True), sample_err
    assert sample_err[-1] < 1e-3 and mean_err[-1] < 1e-5, (mean_err, sample_err)
    assert sample_err[0] > 1e-2  # the noise is really there at η = 0.1


def test_ode_is_the_euler_step():
    latents, velocity, _ = _inputs()
    out = step("ode", latents, velocity, 0.7, 0.55, 0.0)
    torch.testing.assert_close(out.mean, latents + velocity * (0.55 - 0.7))
    assert torch.equal(out.next_latents, out.mean)
    for field in (out.log_prob_B, out.std_B, out.std_dev_t_B):
        assert torch.equal(field, torch.zeros(B))
    # evaluation returns the given x' and log_prob 0; noise/generator are ignored
    given = torch.randn(SHAPE)
    evaluated = step("ode", latents, velocity, 0.7, 0.55, 0.7, next_latents=given)
    assert evaluated.next_latents is given and torch.equal(evaluated.log_prob_B, torch.zeros(B))
    with_noise = step("ode", latents, velocity, 0.7, 0.55, 0.7, noise=torch.randn(SHAPE))
    assert torch.equal(with_noise.next_latents, out.next_latents)


# --- sampler / trainer consistency ---------------------------------------------------------------


@pytest.mark.parametrize("kind", SDE_KINDS)
@pytest.mark.parametrize("sigmas", [(0.7, 0.55), (1.0, SIGMA_1), (0.1, 0.0)])
def test_evaluating_the_sample_reproduces_its_log_prob_exactly(kind, sigmas):
    latents, velocity, noise = _inputs(velocity_dtype=torch.bfloat16)
    sampled = step(kind, latents, velocity, *sigmas, ETA, sigma_1=SIGMA_1, noise=noise)
    evaluated = step(
        kind, latents, velocity, *sigmas, ETA, sigma_1=SIGMA_1, next_latents=sampled.next_latents
    )
    assert evaluated.next_latents is sampled.next_latents
    assert torch.equal(evaluated.log_prob_B, sampled.log_prob_B)
    assert torch.equal(evaluated.mean, sampled.mean)
    assert torch.equal(evaluated.std_B, sampled.std_B)


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_float_sigmas_and_per_sample_sigmas_agree_bitwise(kind):
    """The sampler may pass python floats and the trainer [B] tensors of the same fp32 values."""
    latents, velocity, noise = _inputs()
    sigma, sigma_next = 0.7, 0.55
    scalar = step(kind, latents, velocity, sigma, sigma_next, ETA, noise=noise)
    per_sample = step(
        kind, latents, velocity, torch.full((B,), sigma), torch.full((B,), sigma_next), ETA, noise=noise
    )
    for field in ("next_latents", "log_prob_B", "mean", "std_B", "std_dev_t_B", "sqrt_neg_dt_B"):
        assert torch.equal(getattr(scalar, field), getattr(per_sample, field)), field


@pytest.mark.parametrize("kind", STOCHASTIC)
def test_per_sample_generators_do_not_depend_on_the_batch(kind):
    latents, velocity, _ = _inputs()
    batch = step(
        kind,
        latents,
        velocity,
        0.7,
        0.55,
        ETA,
        generator=[torch.Generator().manual_seed(100 + i) for i in range(B)],
    )
    for i in (0, 3, B - 1):
        alone = step(
            kind,
            latents[i : i + 1],
            velocity[i : i + 1],
            0.7,
            0.55,
            ETA,
            generator=[torch.Generator().manual_seed(100 + i)],
        )
        assert torch.equal(alone.next_latents[0], batch.next_latents[i])
        torch.testing.assert_close(alone.log_prob_B[0], batch.log_prob_B[i], rtol=1e-6, atol=0)
    # the noise is a fresh standard normal per sample, not shared
    eps = (batch.next_latents - batch.mean) / batch.std_B.view(-1, 1, 1, 1)
    assert not torch.allclose(eps[0], eps[1])
    assert abs(eps.mean().item()) < 0.1 and abs(eps.std().item() - 1) < 0.1


def test_one_generator_for_the_batch_is_reproducible():
    latents, velocity, _ = _inputs()
    a = step("sde", latents, velocity, 0.7, 0.55, ETA, generator=torch.Generator().manual_seed(5))
    b = step("sde", latents, velocity, 0.7, 0.55, ETA, generator=torch.Generator().manual_seed(5))
    c = step("sde", latents, velocity, 0.7, 0.55, ETA, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a.next_latents, b.next_latents) and not torch.equal(a.next_latents, c.next_latents)


@pytest.mark.parametrize("kind", ["sde", "dance_sde"])
def test_gradient_flows_through_the_mean_only(kind):
    """x' is data: sampling with autograd on gives the same ∂logp/∂v as scoring the stored x'.

    Without the detach the sampled log-prob would not depend on μ at all (x' − μ = std·ε).
    """
    latents, velocity, noise = _inputs()
    v1 = velocity.clone().requires_grad_(True)
    sampled = step(kind, latents, v1, 0.7, 0.55, ETA, noise=noise)
    assert sampled.next_latents.requires_grad  # the sample keeps its graph for reward backprop
    (grad_sampled,) = torch.autograd.grad(sampled.log_prob_B.sum(), v1)
    v2 = velocity.clone().requires_grad_(True)
    evaluated = step(kind, latents, v2, 0.7, 0.55, ETA, next_latents=sampled.next_latents.detach())
    (grad_evaluated,) = torch.autograd.grad(evaluated.log_prob_B.sum(), v2)
    assert grad_sampled.abs().max() > 1e-3
    torch.testing.assert_close(grad_sampled, grad_evaluated, rtol=1e-6, atol=1e-7)


# --- edges: σ == 1, σ' == 0 ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_last_step_is_finite(kind):
    latents, velocity, noise = _inputs()
    sampled = step(kind, latents, velocity, 0.1, 0.0, ETA, noise=noise)
    shifted = sampled.next_latents + 0.01  # x' from other weights: re-scored, still finite
    evaluated = step(kind, latents, velocity, 0.1, 0.0, ETA, next_latents=shifted)
    for out in (sampled, evaluated):
        for field in ("next_latents", "log_prob_B", "mean", "std_B", "std_dev_t_B", "sqrt_neg_dt_B"):
            assert torch.isfinite(getattr(out, field)).all(), field
    if kind == "cps":  # s = 0: deterministic, x' = x̂₀
        assert torch.equal(sampled.std_B, torch.zeros(B))
        assert torch.equal(sampled.log_prob_B, torch.zeros(B))
        torch.testing.assert_close(sampled.next_latents, latents - 0.1 * velocity)
        torch.testing.assert_close(evaluated.log_prob_B, torch.full((B,), -1e-4))
    if kind in ("sde", "dance_sde"):
        assert (sampled.std_B > 0).all()


def test_sigma_one_needs_sigma_1():
    latents, velocity, noise = _inputs()
    with pytest.raises(ValueError, match="sigma_1"):
        step("sde", latents, velocity, 1.0, SIGMA_1, ETA, noise=noise)
    with pytest.raises(ValueError, match="sigma_1"):
        step("sde", latents, velocity, torch.tensor([1.0] + [0.5] * (B - 1)), 0.4, ETA, noise=noise)
    out = step("sde", latents, velocity, 1.0, SIGMA_1, ETA, sigma_1=SIGMA_1, noise=noise)
    torch.testing.assert_close(out.std_dev_t_B, torch.full((B,), ETA * math.sqrt(1 / (1 - SIGMA_1))))
    # per sample: σ̃ = σ_1 only where σ == 1
    sigma = torch.tensor([1.0, 0.5, 1.0, 0.5, 0.5, 0.5])
    out = step("sde", latents, velocity, sigma, sigma * 0.9, ETA, sigma_1=SIGMA_1, noise=noise)
    expected = torch.where(
        sigma == 1, ETA * math.sqrt(1 / (1 - SIGMA_1)), ETA * torch.sqrt(sigma / (1 - sigma))
    )
    torch.testing.assert_close(out.std_dev_t_B, expected)
    # the other kinds are finite at σ == 1 without it
    for kind in ("cps", "dance_sde", "ode"):
        assert torch.isfinite(step(kind, latents, velocity, 1.0, SIGMA_1, ETA, noise=noise).log_prob_B).all()


def test_a_whole_trajectory_on_a_real_schedule_is_finite():
    from diffrl.schedules import flow_match_schedule

    schedule = flow_match_schedule({"shift": 3.0}, 10, pipeline_convention="sd3")
    for kind in SDE_KINDS:
        gens = [torch.Generator().manual_seed(i) for i in range(B)]
        x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
        for k in range(schedule.num_steps):
            velocity = torch.tanh(x)  # any smooth stand-in for the network
            out = step(
                kind,
                x,
                velocity,
                schedule.sigmas[k],
                schedule.sigmas[k + 1],
                ETA,
                sigma_1=schedule.sigma_1,
                generator=gens,
            )
            assert torch.isfinite(out.next_latents).all() and torch.isfinite(out.log_prob_B).all(), (kind, k)
            x = out.next_latents


def test_outputs_are_fp32_for_bf16_inputs():
    latents, velocity, noise = _inputs(velocity_dtype=torch.bfloat16)
    for kind in SDE_KINDS:
        out = step(kind, latents.bfloat16(), velocity, 0.7, 0.55, ETA, noise=noise.bfloat16())
        assert isinstance(out, StepOut)
        for field in ("next_latents", "log_prob_B", "mean", "std_B", "std_dev_t_B", "sqrt_neg_dt_B"):
            assert getattr(out, field).dtype == torch.float32, (kind, field)
        assert out.log_prob_B.shape == (B,) and out.std_B.shape == (B,) and out.mean.shape == SHAPE


# --- input validation ----------------------------------------------------------------------------


def test_unknown_kind_lists_the_kinds():
    latents, velocity, noise = _inputs()
    with pytest.raises(ValueError, match=r"'flow'.*\('sde', 'cps', 'dance_sde', 'ode'\)"):
        step("flow", latents, velocity, 0.7, 0.55, ETA, noise=noise)


def test_exactly_one_mode():
    latents, velocity, noise = _inputs()
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="exactly one"):
        step("sde", latents, velocity, 0.7, 0.55, ETA)
    with pytest.raises(ValueError, match=r"exactly one.*noise.*generator"):
        step("sde", latents, velocity, 0.7, 0.55, ETA, noise=noise, generator=gen)
    with pytest.raises(ValueError, match=r"exactly one.*noise.*next_latents"):
        step("cps", latents, velocity, 0.7, 0.55, ETA, noise=noise, next_latents=noise)
    with pytest.raises(ValueError, match="exactly one"):
        step("ode", latents, velocity, 0.7, 0.55, ETA, generator=gen, next_latents=noise)


@pytest.mark.parametrize("kind", STOCHASTIC)
def test_zero_noise_level_raises_and_points_to_ode(kind):
    latents, velocity, noise = _inputs()
    with pytest.raises(ValueError, match="ode"):
        step(kind, latents, velocity, 0.7, 0.55, 0.0, noise=noise)


def test_bad_arguments():
    latents, velocity, noise = _inputs()
    bad = [
        (dict(noise_level=-0.1), "noise_level"),
        (dict(noise_level=float("nan")), "noise_level"),
        (dict(kind="cps", noise_level=1.5), "cps"),
        (dict(sigma=0.5, sigma_next=0.6), "sigma_next < sigma"),
        (dict(sigma=1.2, sigma_next=0.6), "sigma <= 1"),
        (dict(sigma_next=-0.1), "0 <= sigma_next"),
        (dict(sigma=torch.ones(B + 1) * 0.7), r"per-sample \[B=6\]"),
        (dict(noise=torch.randn(B, 4, 5, 6)), "noise shape"),
        (dict(velocity=velocity[:, :2]), "velocity shape"),
        (dict(generator=[torch.Generator()] * 2, noise=None), "2 generators for a batch of 6"),
        (dict(sigma=1.0, sigma_next=0.9, sigma_1=1.0), r"sigma_1 must be in \[0, 1\)"),
    ]
    for overrides, message in bad:
        kwargs = dict(
            kind="sde",
            latents=latents,
            velocity=velocity,
            sigma=0.7,
            sigma_next=0.55,
            noise_level=ETA,
            noise=noise,
        )
        kwargs.update(overrides)
        with pytest.raises(ValueError, match=message):
            step(**kwargs)
    with pytest.raises(ValueError, match="at least one non-batch dim"):
        step("sde", latents[:, 0, 0, 0], velocity[:, 0, 0, 0], 0.7, 0.55, ETA, noise=noise[:, 0, 0, 0])
