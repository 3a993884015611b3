"""Qwen-Image-Edit adapters against diffusers' QwenImageEditPipeline / QwenImageEditPlusPipeline,
on tiny random models (Qwen2.5-VL text encoder and processor built offline).

The pipelines resize every condition image to about one megapixel for the VAE, so each encoding
costs seconds on a CPU: the encodings are module fixtures, shared by the tests."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
    CONDITION_IMAGE_SIZE,
    VAE_IMAGE_SIZE,
    calculate_dimensions,
)
from edit_images import condition_image
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from diffrl.models import load_model
from diffrl.models.qwen_image import TEXT_BUCKET
from diffrl.models.qwen_image_edit import (
    ImageOnlyQwen2VLProcessor,
    QwenImageEditAdapter,
    QwenImageEditPlusAdapter,
    build_tiny,
)
from diffrl.sde import step

HEIGHT, WIDTH = 32, 48  # non-square: catches height/width swaps in the RoPE grids
PROMPTS = ["make the circle red", "add a blue square on the left of the star"]
NEGATIVES = ["", "blurry low quality"]


@pytest.fixture(scope="module")
def edit(tiny_model) -> QwenImageEditAdapter:
    return load_model(tiny_model("qwen_image_edit"), dtype="float32")


@pytest.fixture(scope="module")
def plus(tiny_model) -> QwenImageEditPlusAdapter:
    return load_model(tiny_model("qwen_image_edit_plus"), dtype="float32")


@pytest.fixture(scope="module")
def images():
    return [condition_image(1), condition_image(2)]


@pytest.fixture(scope="module")
def edit_cond(edit, images):
    """Both prompts, each with its own image, both CFG sides."""
    return edit.encode_conditioned(PROMPTS, NEGATIVES, 64, [[images[0]], [images[1]]])


@pytest.fixture(scope="module")
def plus_cond(plus, images):
    """The second prompt with both images, no CFG."""
    return plus.encode_conditioned(PROMPTS[1:], None, 64, [images])


def _noise(adapter, seeds):
    return adapter.init_noise([torch.Generator().manual_seed(s) for s in seeds], HEIGHT, WIDTH)


def _ode(adapter, noise, cond, true_cfg_scale, num_steps):
    schedule = adapter.schedule(num_steps, HEIGHT, WIDTH)
    x = noise
    for k in range(num_steps):
        with torch.no_grad():
            v = adapter.velocity(
                x,
                schedule.timesteps[k].expand(x.shape[0]),
                cond,
                1.0,
                HEIGHT,
                WIDTH,
                true_cfg_scale=true_cfg_scale,
            )
        x = step("ode", x, v, schedule.sigmas[k], schedule.sigmas[k + 1], 0.0).next_latents
    return x


def test_loads_through_the_registry_with_its_processor(edit, plus, tiny_model):
    assert type(edit) is QwenImageEditAdapter and type(plus) is QwenImageEditPlusAdapter
    assert type(edit.pipe).__name__ == "QwenImageEditPipeline"
    assert type(plus.pipe).__name__ == "QwenImageEditPlusPipeline"
    for adapter, family in ((edit, "qwen_image_edit"), (plus, "qwen_image_edit_plus")):
        # the directory names the real processor class; this process loads it without its video part
        index = json.loads((tiny_model(family) / "model_index.json").read_text())
        assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
        assert isinstance(adapter.pipe.processor, ImageOnlyQwen2VLProcessor)
        for name in adapter.default_lora_target_modules:
            assert any(n.endswith(name) for n, _ in adapter.transformer.named_modules()), name
        # the template's system part is what the pipeline drops (64 tokens, as the real tokenizer's)
        pipe = adapter.pipe
        system = pipe.prompt_template_encode.split("<|vision_start|>")[0].split("{}")[0]
        assert len(pipe.tokenizer(system).input_ids) == pipe.prompt_template_encode_start_idx == 64
    assert (edit.condition_rule.min_images, edit.condition_rule.max_images) == (1, 1)
    assert (plus.condition_rule.min_images, plus.condition_rule.max_images) == (1, 3)
    # the same schedule as text-to-image: from the target's tokens only
    assert edit.image_seq_len(HEIGHT, WIDTH) == 6 and edit.latent_shape(HEIGHT, WIDTH) == (6, 64)


def test_encode_conditioned_equals_the_pipelines_own_encoding(edit, plus, edit_cond, plus_cond, images):
    # QwenImageEditPipeline: the image resized to ~1024² goes to the text encoder and to the VAE
    pipe = edit.pipe
    width, height = calculate_dimensions(VAE_IMAGE_SIZE, 64 / 48)
    assert (width, height) == (1184, 896)
    resized = pipe.image_processor.resize(images[1], height, width)
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(prompt=[PROMPTS[1]], image=resized)
        negative, _ = pipe.encode_prompt(prompt=[NEGATIVES[1]], image=resized)
        pixels = pipe.image_processor.preprocess(resized, height, width).unsqueeze(2)
        _, latents = pipe.prepare_latents(pixels, 1, 16, HEIGHT, WIDTH, torch.float32, "cpu", None)
    assert mask is None  # one prompt: no padding
    n = embeds.shape[1]
    assert edit_cond.embeds.shape[1] % TEXT_BUCKET == 0
    torch.testing.assert_close(edit_cond.embeds[1:, :n], embeds, rtol=0, atol=0)
    assert edit_cond.mask[1, :n].all() and not edit_cond.mask[1, n:].any()
    torch.testing.assert_close(edit_cond.negative_embeds[1:, : negative.shape[1]], negative, rtol=0, atol=0)
    torch.testing.assert_close(edit_cond.cond_latents[1:], latents, rtol=0, atol=0)
    assert edit_cond.cond_latents.shape == (2, 56 * 74, 64)
    assert edit_cond.cond_shapes.tolist() == [[[56, 74]], [[56, 74]]]
    assert edit_cond.cond_tokens == 56 * 74
    # the text encoder saw the image: another image, other embeddings for the same prompt
    other = edit.encode_conditioned(PROMPTS[1:], None, 64, [[images[0]]])
    assert (other.embeds[:, :n] - embeds).abs().max() > 1e-3

    # QwenImageEditPlusPipeline: each image at ~384² for the text encoder ("Picture k: ..."), ~1024² for the VAE
    pipe = plus.pipe
    text_width, text_height = calculate_dimensions(CONDITION_IMAGE_SIZE, 64 / 48)
    text_images = [pipe.image_processor.resize(im, text_height, text_width) for im in images]
    vae_images = [pipe.image_processor.preprocess(im, height, width).unsqueeze(2) for im in images]
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(prompt=PROMPTS[1:], image=text_images)
        _, latents = pipe.prepare_latents(vae_images, 1, 16, HEIGHT, WIDTH, torch.float32, "cpu", None)
    torch.testing.assert_close(plus_cond.embeds[:, : embeds.shape[1]], embeds, rtol=0, atol=0)
    torch.testing.assert_close(plus_cond.cond_latents, latents, rtol=0, atol=0)
    assert plus_cond.cond_shapes.tolist() == [[[56, 74], [56, 74]]]


def test_ode_sampling_matches_the_edit_pipeline_with_true_cfg(edit, edit_cond, images):
    """Our loop (velocity with the condition tokens + sde.step('ode')) == QwenImageEditPipeline."""
    steps = 2
    noise = _noise(edit, (0, 1))
    ours = _ode(edit, noise, edit_cond, 4.0, steps)
    for i in range(2):  # the pipeline's documented use: one image per call
        ref = edit.pipe(
            image=images[i],
            prompt=[PROMPTS[i]],
            negative_prompt=[NEGATIVES[i]],
            true_cfg_scale=4.0,
            num_inference_steps=steps,
            height=HEIGHT,
            width=WIDTH,
            latents=noise[i : i + 1].clone(),
            output_type="latent",
        ).images
        torch.testing.assert_close(ours[i : i + 1], ref, rtol=1e-4, atol=1e-5)
    assert (ours - noise).abs().max() > 0.1
    # the condition latents matter (so the match is not vacuous): zeroed, the velocity changes
    t_B = torch.full((2,), 800.0)
    blank = edit_cond.clone()
    blank.cond_latents = torch.zeros_like(blank.cond_latents)
    with torch.no_grad():
        v = edit.velocity(noise, t_B, edit_cond, 1.0, HEIGHT, WIDTH, true_cfg_scale=4.0)
        v_blank = edit.velocity(noise, t_B, blank, 1.0, HEIGHT, WIDTH, true_cfg_scale=4.0)
    assert (v - v_blank).abs().max() > 1e-3


def test_ode_sampling_matches_the_plus_pipeline_with_two_images(plus, plus_cond, images):
    steps = 2
    noise = _noise(plus, (3,))
    ours = _ode(plus, noise, plus_cond, None, steps)
    ref = plus.pipe(
        image=images,
        prompt=PROMPTS[1:],
        true_cfg_scale=1.0,
        num_inference_steps=steps,
        height=HEIGHT,
        width=WIDTH,
        latents=noise.clone(),
        output_type="latent",
    ).images
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_flops_count_the_condition_tokens(edit, edit_cond):
    noise = _noise(edit, (0, 1))
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        edit.velocity(noise, torch.full((2,), 500.0), edit_cond, 1.0, HEIGHT, WIDTH, true_cfg_scale=4.0)
    measured = counter.get_total_flops()
    text_len = edit_cond.embeds.shape[1]
    analytic = edit.flops_per_forward(4, HEIGHT, WIDTH, text_len, cond_tokens=edit_cond.cond_tokens)
    assert abs(analytic - measured) / measured < 0.02, (analytic, measured)
    assert edit.flops_per_forward(4, HEIGHT, WIDTH, text_len) < analytic / 100  # the condition dominates


def test_velocity_is_one_differentiable_forward_over_target_and_condition(edit, edit_cond):
    calls = []
    handle = edit.transformer.register_forward_hook(
        lambda m, args, kwargs, out: calls.append((kwargs["hidden_states"].shape, kwargs["img_shapes"])),
        with_kwargs=True,
    )
    try:
        latents = _noise(edit, (0, 1)).requires_grad_(True)
        v = edit.velocity(latents, torch.full((2,), 700.0), edit_cond, 1.0, HEIGHT, WIDTH, true_cfg_scale=4.0)
    finally:
        handle.remove()
    (shape, img_shapes) = calls[0]
    assert len(calls) == 1 and tuple(shape) == (4, 6 + 56 * 74, 64)
    assert img_shapes == [[(1, 2, 3), (1, 56, 74)]] * 4
    assert v.shape == latents.shape and v.dtype == torch.float32
    v.square().mean().backward()
    assert latents.grad is not None and latents.grad.abs().sum() > 0
    edit.transformer.zero_grad(set_to_none=True)


def test_condition_errors_name_the_fix(edit, edit_cond, images):
    with pytest.raises(ValueError, match="needs its condition image"):
        edit.encode_prompts(PROMPTS, None, 64)
    with pytest.raises(ValueError, match="takes exactly 1"):
        edit.encode_conditioned(PROMPTS[:1], None, 64, [images])
    with pytest.raises(ValueError, match="max_sequence_length=2048"):
        edit.encode_conditioned(PROMPTS[:1], None, 2048, [images[:1]])
    text_only = edit_cond.clone()
    text_only.cond_latents = None
    with pytest.raises(ValueError, match="needs condition latents"):
        edit.velocity(_noise(edit, (0, 1)), torch.full((2,), 500.0), text_only, 1.0, HEIGHT, WIDTH)
    mixed = edit_cond.clone()
    mixed.cond_shapes = torch.tensor([[[56, 74]], [[74, 56]]])
    with pytest.raises(ValueError, match="different sizes"):
        edit.velocity(_noise(edit, (0, 1)), torch.full((2,), 500.0), mixed, 1.0, HEIGHT, WIDTH)
    with pytest.raises(ValueError, match="one row of condition images per prompt"):
        edit.pipeline_call(
            PROMPTS,
            None,
            num_inference_steps=2,
            guidance_scale=1.0,
            true_cfg_scale=None,
            height=HEIGHT,
            width=WIDTH,
            num_frames=1,
            max_sequence_length=64,
        )


def test_builder_is_deterministic(tmp_path, tiny_model):
    built = tiny_model("qwen_image_edit")
    again = build_tiny(tmp_path / "again", seed=0)
    files = sorted(p.relative_to(built) for p in built.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (built / rel).read_bytes() == (again / rel).read_bytes(), rel
    assert sum((built / rel).stat().st_size for rel in files) < 5e6
