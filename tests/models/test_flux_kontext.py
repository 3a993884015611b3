"""FLUX.1 Kontext adapter against diffusers' own FluxKontextPipeline, on a tiny random model."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS
from edit_images import condition_image
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from diffrl import sde
from diffrl.models import load_model
from diffrl.models.conditions import KONTEXT_RESOLUTIONS, kontext_size
from diffrl.models.flux_kontext import FluxKontextAdapter

PROMPTS = ["make the circle red", "two small green triangles on a white background"]
NEGATIVES = ["blurry", "a photo of a dog"]
MAX_LEN = 24
HEIGHT, WIDTH = 32, 64  # non-square: catches h/w swaps in the ids


@pytest.fixture(scope="module")
def adapter(tiny_model) -> FluxKontextAdapter:
    return load_model(tiny_model("flux_kontext"), dtype="float32")


@pytest.fixture(scope="module")
def images():
    return [condition_image(1), condition_image(2)]


@pytest.fixture(scope="module")
def cond(adapter, images):
    return adapter.encode_conditioned(PROMPTS, NEGATIVES, MAX_LEN, [[images[0]], [images[1]]])


def _ode(adapter, noise, cond, num_steps, guidance_scale, **kwargs):
    schedule = adapter.schedule(num_steps, HEIGHT, WIDTH)
    x = noise
    for k in range(num_steps):
        with torch.no_grad():
            v = adapter.velocity(
                x, schedule.timesteps[k].expand(x.shape[0]), cond, guidance_scale, HEIGHT, WIDTH, **kwargs
            )
        x = sde.step("ode", x, v, schedule.sigmas[k], schedule.sigmas[k + 1], 0.0).next_latents
    return x


def test_loads_through_the_registry(adapter, tiny_model):
    assert type(adapter) is FluxKontextAdapter
    index = json.loads((tiny_model("flux_kontext") / "model_index.json").read_text())
    assert index["_class_name"] == "FluxKontextPipeline"
    assert adapter.transformer.config.guidance_embeds and not adapter.wants_negative(2.5)
    names = [n for n, m in adapter.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in adapter.default_lora_target_modules:
        assert any(n.endswith("." + target) for n in names), target
    assert tuple(PREFERRED_KONTEXT_RESOLUTIONS) == KONTEXT_RESOLUTIONS
    # the size the pipeline encodes at: the trained resolution of the nearest aspect ratio
    assert kontext_size(64, 48) == (1184, 880) and kontext_size(1000, 1000) == (1024, 1024)
    assert kontext_size(64, 48, auto_resize=False) == (64, 48)


def test_encode_conditioned_equals_the_pipelines_own_encoding(adapter, cond, images):
    pipe = adapter.pipe
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt(prompt=PROMPTS, prompt_2=None, max_sequence_length=MAX_LEN)
        pixels = pipe.image_processor.preprocess(pipe.image_processor.resize(images[1], 880, 1184), 880, 1184)
        _, latents, _, image_ids = pipe.prepare_latents(
            pixels, 1, 16, HEIGHT, WIDTH, torch.float32, "cpu", None, torch.zeros(1, 8, 64)
        )
    torch.testing.assert_close(cond.embeds, embeds, rtol=0, atol=0)
    torch.testing.assert_close(cond.pooled, pooled, rtol=0, atol=0)
    torch.testing.assert_close(cond.cond_latents[1:], latents, rtol=0, atol=0)
    assert cond.cond_shapes.tolist() == [[[55, 74]], [[55, 74]]] and cond.cond_tokens == 55 * 74
    assert image_ids.shape == (55 * 74, 3) and (image_ids[:, 0] == 1).all()
    with pytest.raises(ValueError, match="needs its condition image"):
        adapter.encode_prompts(PROMPTS, None, MAX_LEN)
    with pytest.raises(ValueError, match="exactly 1 condition image"):
        adapter.encode_conditioned(PROMPTS[:1], None, MAX_LEN, [images])


@pytest.mark.parametrize("true_cfg", [False, True], ids=["distilled_guidance", "true_cfg"])
def test_ode_matches_the_kontext_pipeline(adapter, cond, images, true_cfg):
    """Our ODE loop == FluxKontextPipeline(output_type="latent") from the same noise and image."""
    steps, guidance = 2, 2.5
    noise = adapter.init_noise([torch.Generator().manual_seed(s) for s in (0, 1)], HEIGHT, WIDTH)
    cfg_kwargs = {"true_cfg_scale": 4.0} if true_cfg else {}
    ours = _ode(adapter, noise, cond, steps, guidance, **cfg_kwargs)
    pipe_kwargs = {"negative_prompt": NEGATIVES, "true_cfg_scale": 4.0} if true_cfg else {}
    ref = adapter.pipe(
        image=images,
        prompt=PROMPTS,
        latents=noise.clone(),
        num_inference_steps=steps,
        guidance_scale=guidance,
        height=HEIGHT,
        width=WIDTH,
        max_area=HEIGHT * WIDTH,  # else the pipeline rescales the requested size to one megapixel
        max_sequence_length=MAX_LEN,
        output_type="latent",
        **pipe_kwargs,
    ).images
    assert ours.shape == ref.shape == noise.shape
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=2e-5)
    # the adapter's own description of that call says the same
    call = adapter.pipeline_call(
        PROMPTS,
        NEGATIVES if true_cfg else None,
        num_inference_steps=steps,
        guidance_scale=guidance,
        true_cfg_scale=4.0 if true_cfg else None,
        height=HEIGHT,
        width=WIDTH,
        num_frames=1,
        max_sequence_length=MAX_LEN,
        images=[[images[0]], [images[1]]],
    )
    assert call["max_area"] == HEIGHT * WIDTH and call["image"] == images and call["_auto_resize"]
    if not true_cfg:
        # the condition matters: with the images' latents zeroed the velocity changes
        blank = cond.clone()
        blank.cond_latents = torch.zeros_like(blank.cond_latents)
        t_B = torch.full((2,), 800.0)
        with torch.no_grad():
            v = adapter.velocity(noise, t_B, cond, guidance, HEIGHT, WIDTH)
            v_blank = adapter.velocity(noise, t_B, blank, guidance, HEIGHT, WIDTH)
        assert (v - v_blank).abs().max() > 1e-3


def test_flops_count_the_condition_tokens(adapter, cond):
    x = adapter.init_noise(
        [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)], HEIGHT, WIDTH
    )
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        adapter.velocity(x, torch.full((2,), 700.0), cond, 2.5, HEIGHT, WIDTH)
    expected = adapter.flops_per_forward(2, HEIGHT, WIDTH, MAX_LEN, cond_tokens=cond.cond_tokens)
    assert expected == pytest.approx(counter.get_total_flops(), rel=1e-9)


def test_velocity_is_differentiable_and_needs_the_condition(adapter, cond):
    x = adapter.init_noise(
        [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)], HEIGHT, WIDTH
    )
    latents = x.clone().requires_grad_(True)
    v = adapter.velocity(latents, torch.full((2,), 700.0), cond, 2.5, HEIGHT, WIDTH)
    assert v.shape == x.shape and v.dtype == torch.float32
    v.square().mean().backward()
    assert latents.grad is not None and latents.grad.abs().sum() > 0
    adapter.transformer.zero_grad(set_to_none=True)
    text_only = cond.clone()
    text_only.cond_latents = None
    with pytest.raises(ValueError, match="needs condition latents"):
        adapter.velocity(x, torch.full((2,), 700.0), text_only, 2.5, HEIGHT, WIDTH)
