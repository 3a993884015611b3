"""diffrl.schedules against (1) closed forms written here in numpy and (2) what the diffusers pipelines do."""

import math

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from diffrl.schedules import PIPELINE_CONVENTIONS, Schedule, flow_match_schedule

# The scheduler configs the checkpoints ship (scheduler/scheduler_config.json), keys as on the hub.
SD3 = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}
FLUX_DEV = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}
QWEN_IMAGE = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}
# Wan2.1 diffusers checkpoints: a UniPC solver over flow sigmas (flow_shift 3.0 for 480p, 5.0 for 720p).
WAN_UNIPC = {
    "_class_name": "UniPCMultistepScheduler",
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "final_sigmas_type": "zero",
    "flow_shift": 3.0,
    "num_train_timesteps": 1000,
    "predict_x0": True,
    "prediction_type": "flow_prediction",
    "solver_order": 2,
    "solver_type": "bh2",
    "use_flow_sigmas": True,
}


# --- closed forms, independent of diffusers -----------------------------------------------------


def _shift(sigma, shift):
    return shift * sigma / (1 + (shift - 1) * sigma)


def _mu(seq_len, base_len, max_len, base_shift, max_shift):
    """Linear in the sequence length: base_shift at base_len, max_shift at max_len."""
    return base_shift + (max_shift - base_shift) * (seq_len - base_len) / (max_len - base_len)


def _exp_time_shift(sigma, mu):
    return math.exp(mu) / (math.exp(mu) + (1 / sigma - 1))


def _with_zero(sigmas):
    return np.append(sigmas, 0.0)


def _sd3_closed_form(shift, n):
    # The scheduler's training sigmas are already shifted, so the inference linspace runs from
    # shift(1) = 1 to shift(1/1000) and is then shifted a second time.
    sigma_min_train = _shift(1 / 1000, shift)
    return _with_zero(_shift(np.linspace(1.0, sigma_min_train, n), shift))


def _flux_closed_form(n, seq_len):
    mu = _mu(seq_len, 256, 4096, 0.5, 1.15)
    return _with_zero(_exp_time_shift(np.linspace(1.0, 1 / n, n), mu))


def _qwen_closed_form(n, seq_len):
    sigmas = _exp_time_shift(np.linspace(1.0, 1 / n, n), _mu(seq_len, 256, 8192, 0.5, 0.9))
    # stretch so the last nonzero sigma lands on shift_terminal = 0.02
    sigmas = 1 - (1 - sigmas) * (1 - 0.02) / (1 - sigmas[-1])
    return _with_zero(sigmas)


def _assert_schedule(schedule, expected_sigmas):
    assert isinstance(schedule, Schedule)
    n = len(expected_sigmas) - 1
    assert schedule.sigmas.dtype == torch.float32 and schedule.sigmas.shape == (n + 1,)
    assert schedule.timesteps.dtype == torch.float32 and schedule.timesteps.shape == (n,)
    assert schedule.num_steps == n
    # diffusers computes partly in fp32
    np.testing.assert_allclose(schedule.sigmas.numpy(), expected_sigmas, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(schedule.timesteps.numpy(), 1000 * expected_sigmas[:-1], rtol=2e-6, atol=1e-3)
    assert schedule.sigmas[-1] == 0 and schedule.sigma_1 == float(schedule.sigmas[1])


@pytest.mark.parametrize("n", [10, 28])
def test_sd3_closed_form(n):
    schedule = flow_match_schedule(SD3, n, pipeline_convention="sd3")
    expected = _sd3_closed_form(3.0, n)
    _assert_schedule(schedule, expected)
    assert schedule.sigmas[0] == 1.0
    # the double shift is real: the last nonzero sigma is shift(shift(0.001)) ≈ 0.00893, not shift(0.001)
    assert abs(schedule.sigmas[-2].item() - _shift(_shift(0.001, 3.0), 3.0)) < 1e-6
    assert abs(schedule.sigmas[-2].item() - _shift(0.001, 3.0)) > 5e-3


@pytest.mark.parametrize("seq_len", [256, 1024, 4096])
@pytest.mark.parametrize("n", [10, 28])
def test_flux_dev_closed_form(n, seq_len):
    schedule = flow_match_schedule(FLUX_DEV, n, seq_len, pipeline_convention="flux")
    _assert_schedule(schedule, _flux_closed_form(n, seq_len))


def test_flux_shift_grows_with_resolution():
    low, high = (flow_match_schedule(FLUX_DEV, 10, seq, pipeline_convention="flux") for seq in (256, 4096))
    assert (high.sigmas[1:-1] > low.sigmas[1:-1]).all()


@pytest.mark.parametrize("seq_len", [256, 1024, 4096])
@pytest.mark.parametrize("n", [10, 50])
def test_qwen_image_closed_form(n, seq_len):
    schedule = flow_match_schedule(QWEN_IMAGE, n, seq_len, pipeline_convention="qwen_image")
    _assert_schedule(schedule, _qwen_closed_form(n, seq_len))
    assert abs(schedule.sigmas[-2].item() - 0.02) < 1e-6


@pytest.mark.parametrize("shift", [3.0, 5.0])
@pytest.mark.parametrize("n", [10, 20])
def test_wan_is_flow_match_euler_with_its_shift(n, shift):
    expected = _sd3_closed_form(shift, n)
    from_euler = flow_match_schedule({"shift": shift}, n, pipeline_convention="wan")
    from_unipc = flow_match_schedule({**WAN_UNIPC, "flow_shift": shift}, n, pipeline_convention="wan")
    _assert_schedule(from_euler, expected)
    _assert_schedule(from_unipc, expected)


# --- the diffusers pipelines, as a second independent check ---------------------------------------


def _pipeline_sd3(config, n, image_seq_len=None):
    """The lines of StableDiffusion3Pipeline.__call__ that prepare the timesteps."""
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
        calculate_shift,
        retrieve_timesteps,
    )

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    scheduler_kwargs = {}
    if scheduler.config.get("use_dynamic_shifting", None):
        scheduler_kwargs["mu"] = calculate_shift(
            image_seq_len,
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.16),
        )
    timesteps, _ = retrieve_timesteps(scheduler, n, "cpu", sigmas=None, **scheduler_kwargs)
    return scheduler.sigmas, timesteps


def _pipeline_flux_like(module, config, n, seq_len):
    """The lines of FluxPipeline / QwenImagePipeline.__call__ that prepare the timesteps."""
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    sigmas = np.linspace(1.0, 1 / n, n)
    mu = module.calculate_shift(
        seq_len,
        scheduler.config.get("base_image_seq_len", 256),
        scheduler.config.get("max_image_seq_len", 4096),
        scheduler.config.get("base_shift", 0.5),
        scheduler.config.get("max_shift", 1.15),
    )
    timesteps, _ = module.retrieve_timesteps(scheduler, n, "cpu", sigmas=sigmas, mu=mu)
    return scheduler.sigmas, timesteps


def _assert_same(schedule, sigmas, timesteps):
    assert torch.equal(schedule.sigmas, sigmas.float()), (schedule.sigmas, sigmas)
    assert torch.equal(schedule.timesteps, timesteps.float()), (schedule.timesteps, timesteps)


@pytest.mark.parametrize("n", [10, 28])
def test_sd3_matches_the_pipeline(n):
    _assert_same(flow_match_schedule(SD3, n, pipeline_convention="sd3"), *_pipeline_sd3(SD3, n))


def test_sd3_with_dynamic_shifting_matches_the_pipeline():
    config = {**SD3, "use_dynamic_shifting": True}
    schedule = flow_match_schedule(config, 28, 1024, pipeline_convention="sd3")
    _assert_same(schedule, *_pipeline_sd3(config, 28, 1024))
    # closed form: unshifted training sigmas, linspace(1, 1/1000), then the exponential time shift
    expected = _with_zero(_exp_time_shift(np.linspace(1.0, 1 / 1000, 28), _mu(1024, 256, 4096, 0.5, 1.15)))
    _assert_schedule(schedule, expected)


@pytest.mark.parametrize("seq_len", [256, 1024, 4096])
def test_flux_matches_the_pipeline(seq_len):
    from diffusers.pipelines.flux import pipeline_flux

    expected = _pipeline_flux_like(pipeline_flux, FLUX_DEV, 28, seq_len)
    _assert_same(flow_match_schedule(FLUX_DEV, 28, seq_len, pipeline_convention="flux"), *expected)


@pytest.mark.parametrize("seq_len", [256, 1024, 4096])
def test_qwen_image_matches_the_pipeline(seq_len):
    from diffusers.pipelines.qwenimage import pipeline_qwenimage

    expected = _pipeline_flux_like(pipeline_qwenimage, QWEN_IMAGE, 50, seq_len)
    _assert_same(flow_match_schedule(QWEN_IMAGE, 50, seq_len, pipeline_convention="qwen_image"), *expected)


@pytest.mark.parametrize("shift", [3.0, 5.0])
def test_wan_matches_the_pipeline_with_an_euler_scheduler(shift):
    """WanPipeline calls scheduler.set_timesteps(N); RL recipes give it FlowMatchEulerDiscreteScheduler(shift)."""
    import diffusers.pipelines.wan.pipeline_wan  # noqa: F401  (the pipeline's scheduler type)

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(20, device="cpu")
    _assert_same(
        flow_match_schedule({**WAN_UNIPC, "flow_shift": shift}, 20, pipeline_convention="wan"),
        scheduler.sigmas,
        scheduler.timesteps,
    )


def test_the_conventions_really_differ():
    """The same config gives different schedules under sd3 and flux conventions (so none is a default)."""
    config = {**FLUX_DEV}
    sd3 = flow_match_schedule(config, 10, 1024, pipeline_convention="sd3")
    flux = flow_match_schedule(config, 10, 1024, pipeline_convention="flux")
    assert not torch.allclose(sd3.sigmas, flux.sigmas)
    assert set(PIPELINE_CONVENTIONS) == {"sd3", "flux", "qwen_image", "wan"}


def test_shared_scheduler_state_is_not_mutated():
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(FLUX_DEV)
    sigmas_before = scheduler.sigmas.clone()
    config_before = dict(scheduler.config)
    flow_match_schedule(scheduler.config, 7, 1024, pipeline_convention="flux")
    assert torch.equal(scheduler.sigmas, sigmas_before) and len(scheduler.timesteps) == 1000
    assert dict(scheduler.config) == config_before


def test_one_step():
    schedule = flow_match_schedule(SD3, 1, pipeline_convention="sd3")
    assert schedule.sigmas.tolist() == [1.0, 0.0] and schedule.timesteps.tolist() == [1000.0]


# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, -3, 2.5, True])
def test_bad_num_steps(n):
    with pytest.raises(ValueError, match="num_steps"):
        flow_match_schedule(SD3, n, pipeline_convention="sd3")


@pytest.mark.parametrize(("config", "convention"), [(FLUX_DEV, "flux"), (QWEN_IMAGE, "qwen_image")])
def test_dynamic_shifting_needs_image_seq_len(config, convention):
    with pytest.raises(ValueError, match="image_seq_len"):
        flow_match_schedule(config, 10, pipeline_convention=convention)


def test_not_a_flow_matching_config():
    ddim = dict(DDIMScheduler().config)  # as an in-memory scheduler's config: no _class_name
    with pytest.raises(ValueError, match=r"does not take: .*'beta_end'"):
        flow_match_schedule(ddim, 10, pipeline_convention="sd3")
    with pytest.raises(ValueError, match="is a DDIMScheduler"):  # as saved in scheduler_config.json
        flow_match_schedule({**ddim, "_class_name": "DDIMScheduler"}, 10, pipeline_convention="sd3")
    with pytest.raises(ValueError, match="beta_schedule"):
        flow_match_schedule({"beta_schedule": "linear", "shift": 3.0}, 10, pipeline_convention="sd3")
    # a UniPC config is only read as flow-match Euler for Wan, and only with flow sigmas
    with pytest.raises(ValueError, match="UniPCMultistepScheduler"):
        flow_match_schedule(WAN_UNIPC, 10, pipeline_convention="sd3")
    with pytest.raises(ValueError, match="use_flow_sigmas=True"):
        unipc = {**UniPCMultistepScheduler().config, "_class_name": "UniPCMultistepScheduler"}
        flow_match_schedule(unipc, 10, pipeline_convention="wan")
    with pytest.raises(ValueError, match="invert_sigmas"):
        flow_match_schedule({**SD3, "invert_sigmas": True}, 10, pipeline_convention="sd3")


def test_unknown_convention_lists_them():
    with pytest.raises(ValueError, match=r"'sdxl'.*\('sd3', 'flux', 'qwen_image', 'wan'\)"):
        flow_match_schedule(SD3, 10, pipeline_convention="sdxl")


def test_shift_terminal_with_one_step_is_a_clear_error():
    with pytest.raises(ValueError, match="shift_terminal needs num_steps >= 2"):
        flow_match_schedule(QWEN_IMAGE, 1, 1024, pipeline_convention="qwen_image")


def test_an_image_whose_dynamic_shift_overflows_is_refused_naming_the_largest_token_count():
    """Issue 51 re-probe: `diffrl sample --height 32768 --width 32768` (FLUX, 2048² = 4.2M tokens)
    ended in diffusers' `OverflowError: math range error` (exp(mu), mu ~ 710). Below that, an image
    so large that the shift pushes every float32 sigma to 1 says so too."""
    slope = (1.15 - 0.5) / (4096 - 256)
    largest = int((math.log(float(np.finfo(np.float64).max)) - (0.5 - slope * 256)) / slope)
    with pytest.raises(
        ValueError, match=rf"an image of {2048 * 2048} tokens .* at most {largest} image tokens"
    ):
        flow_match_schedule(FLUX_DEV, 4, 2048 * 2048, pipeline_convention="flux")
    with pytest.raises(
        ValueError, match=r"or a smaller image: with dynamic shifting this one's 400000 tokens"
    ):
        flow_match_schedule(FLUX_DEV, 4, 400_000, pipeline_convention="flux")
    flow_match_schedule(FLUX_DEV, 4, 64 * 64, pipeline_convention="flux")  # a 1024² image
