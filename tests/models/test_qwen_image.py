"""Qwen-Image adapter against the diffusers QwenImagePipeline, on the tiny random model."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from diffrl.models import load_model
from diffrl.models.base import to_uint8
from diffrl.models.qwen_image import TEXT_BUCKET, QwenImageAdapter
from diffrl.models.qwen_image_tiny import build_tiny
from diffrl.sde import step

HEIGHT = WIDTH = 64
# Different lengths on purpose: the masks and the padding of [negative, positive] to one length matter.
PROMPTS = ["a red circle", "two blue squares on the left of a green triangle and a yellow star"]
NEGATIVES = ["", "blurry low quality"]


@pytest.fixture(scope="module")
def tiny_dir(tiny_model):
    return tiny_model("qwen_image")  # built once per session (tests/conftest.py), via diffrl.models.tiny


@pytest.fixture(scope="module")
def adapter(tiny_dir):
    return load_model(tiny_dir, dtype="float32")


def _noise(adapter, seeds=(0, 1)):
    return adapter.init_noise([torch.Generator().manual_seed(s) for s in seeds], HEIGHT, WIDTH)


def _ode_sample(adapter, noise, cond, guidance_scale, num_steps):
    schedule = adapter.schedule(num_steps, HEIGHT, WIDTH)
    x = noise
    for k in range(num_steps):
        t_B = schedule.timesteps[k].expand(x.shape[0])
        with torch.no_grad():
            v = adapter.velocity(x, t_B, cond, 1.0, HEIGHT, WIDTH, true_cfg_scale=guidance_scale)
        x = step("ode", x, v, schedule.sigmas[k], schedule.sigmas[k + 1], 0.0).next_latents
    return x


def test_loads_through_registry(adapter, tiny_dir):
    assert type(adapter) is QwenImageAdapter
    assert type(adapter.pipe).__name__ == "QwenImagePipeline"
    assert type(adapter.pipe.tokenizer).__name__ == "Qwen2Tokenizer"
    assert type(adapter.pipe.text_encoder).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(adapter.transformer.transformer_blocks[0]).__name__ in adapter.block_class_names
    for name in adapter.default_lora_target_modules:
        assert any(n.endswith(name) for n, _ in adapter.transformer.named_modules()), name
    assert sum(f.stat().st_size for f in tiny_dir.rglob("*") if f.is_file()) < 5e6
    cfg = adapter.scheduler_config
    assert (cfg.use_dynamic_shifting, cfg.shift_terminal, cfg.max_shift, cfg.max_image_seq_len) == (
        True,
        0.02,
        0.9,
        8192,
    )
    # The template's prefix is exactly what the pipeline drops (34 tokens, like the real tokenizer).
    pipe = adapter.pipe
    tok = pipe.tokenizer
    prefix, suffix = pipe.prompt_template_encode.split("{}")
    assert len(tok(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
    full = tok(pipe.prompt_template_encode.format(PROMPTS[1])).input_ids
    assert full[34:] == tok(PROMPTS[1] + suffix).input_ids
    # packed latents [B, (H/16)(W/16), 64]
    assert adapter.latent_shape(HEIGHT, WIDTH) == (16, 64)
    assert adapter.image_seq_len(HEIGHT, WIDTH) == 16
    with pytest.raises(ValueError, match="multiples of 16"):
        adapter.latent_shape(40, 64)


def test_encode_prompts_equals_pipeline(adapter):
    pipe = adapter.pipe
    with torch.no_grad():
        pos, pos_mask = pipe.encode_prompt(PROMPTS, max_sequence_length=512)
        neg, neg_mask = pipe.encode_prompt(NEGATIVES, max_sequence_length=512)
    assert pos_mask is not None and neg_mask is not None  # prompts of different lengths

    cond = adapter.encode_prompts(PROMPTS, NEGATIVES, max_sequence_length=512)
    # padded to the next multiple of TEXT_BUCKET, so that compiled blocks see few text lengths
    length = -(-max(pos.shape[1], neg.shape[1]) // TEXT_BUCKET) * TEXT_BUCKET
    assert cond.batch_size == torch.Size([2]) and cond.has_negative
    for ours, ours_mask, ref, ref_mask in (
        (cond.embeds, cond.mask, pos, pos_mask),
        (cond.negative_embeds, cond.negative_mask, neg, neg_mask),
    ):
        assert ours.shape == (2, length, ref.shape[2]) and ours_mask.shape == (2, length)
        torch.testing.assert_close(ours[:, : ref.shape[1]], ref, rtol=0, atol=0)
        assert torch.equal(ours_mask[:, : ref.shape[1]], ref_mask)
        assert not ours[:, ref.shape[1] :].any() and not ours_mask[:, ref.shape[1] :].any()

    plain = adapter.encode_prompts(PROMPTS, None, max_sequence_length=512)
    assert not plain.has_negative and plain.negative_mask is None
    assert plain.embeds.shape[1] == -(-pos.shape[1] // TEXT_BUCKET) * TEXT_BUCKET
    torch.testing.assert_close(plain.embeds[:, : pos.shape[1]], pos, rtol=0, atol=0)
    assert torch.equal(plain.mask[:, : pos.shape[1]], pos_mask)
    assert not plain.mask[:, pos.shape[1] :].any()
    # one prompt: the pipeline returns no mask; ours marks its tokens and the bucket's padding
    single = adapter.encode_prompts(PROMPTS[:1], None, max_sequence_length=512)
    real = pipe.encode_prompt(PROMPTS[:1], max_sequence_length=512)[0].shape[1]
    assert single.mask.shape == single.embeds.shape[:2]
    assert single.mask[0, :real].all() and not single.mask[0, real:].any()
    # prompts of different lengths within one bucket give one shape: one compiled graph
    short, longer = ["a cat"], ["a small red cat sitting on a blue mat"]
    lengths = [pipe.encode_prompt(p, max_sequence_length=512)[0].shape[1] for p in (short, longer)]
    assert lengths[0] < lengths[1] <= TEXT_BUCKET
    for p in (short, longer):
        assert adapter.encode_prompts(p, None, max_sequence_length=512).embeds.shape[1] == TEXT_BUCKET
    # the bucket never pads past max_sequence_length, which caps the real tokens first
    assert adapter.encode_prompts(PROMPTS, NEGATIVES, max_sequence_length=4).embeds.shape[1] == 4
    capped = min(pos.shape[1], neg.shape[1]) + 1
    assert adapter.encode_prompts(PROMPTS, NEGATIVES, max_sequence_length=capped).embeds.shape[1] == capped
    with pytest.raises(ValueError, match="max_sequence_length"):
        adapter.encode_prompts(PROMPTS, None, max_sequence_length=2048)


@pytest.mark.parametrize("guidance_scale", [4.0, 1.0])
def test_ode_sampling_matches_pipeline(adapter, guidance_scale):
    """Our loop (adapter.velocity + sde.step('ode') over adapter.schedule) == QwenImagePipeline."""
    num_steps = 4
    cfg_on = guidance_scale > 1
    noise = _noise(adapter)
    cond = adapter.encode_prompts(PROMPTS, NEGATIVES if cfg_on else None, max_sequence_length=512)
    ours = _ode_sample(adapter, noise, cond, guidance_scale, num_steps)

    kwargs = dict(
        prompt=PROMPTS,
        negative_prompt=NEGATIVES if cfg_on else None,
        true_cfg_scale=guidance_scale,
        num_inference_steps=num_steps,
        height=HEIGHT,
        width=WIDTH,
        output_type="latent",
    )
    ref = adapter.pipe(latents=noise.clone(), **kwargs).images
    assert ref.shape == ours.shape == (2, 16, 64)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)
    # CFG must matter, or this test could not tell a wrong CFG from a right one
    assert (ours - noise).abs().max() > 0.1
    if cfg_on:
        # init_noise draws what the pipeline draws from the same per-sample generators
        gens = [torch.Generator().manual_seed(s) for s in (0, 1)]
        torch.testing.assert_close(adapter.pipe(generator=gens, **kwargs).images, ref, rtol=0, atol=0)
        plain = adapter.encode_prompts(PROMPTS, None, max_sequence_length=512)
        assert (_ode_sample(adapter, noise, plain, 1.0, num_steps) - ours).abs().max() > 1e-2


def test_decode_equals_pipeline(adapter):
    noise = _noise(adapter, seeds=(3, 4))
    kwargs = dict(
        prompt=PROMPTS,
        negative_prompt=NEGATIVES,
        true_cfg_scale=4.0,
        num_inference_steps=2,
        height=HEIGHT,
        width=WIDTH,
    )
    latents = adapter.pipe(latents=noise.clone(), output_type="latent", **kwargs).images
    ref_np = adapter.pipe(latents=noise.clone(), output_type="np", **kwargs).images
    ref = torch.from_numpy((ref_np * 255).round().astype("uint8")).permute(0, 3, 1, 2)
    ours = adapter.decode(latents, HEIGHT, WIDTH)
    assert ours.dtype == torch.uint8 and ours.shape == (2, 3, HEIGHT, WIDTH)
    assert torch.equal(ours, ref)
    assert ours.float().std() > 1  # not a constant image
    # the pt output path agrees with base.to_uint8's rounding as well
    ref_pt = adapter.pipe(latents=noise.clone(), output_type="pt", **kwargs).images
    assert torch.equal(to_uint8(ref_pt * 2 - 1), ours)


def test_flops_match_flop_counter(adapter):
    cond = adapter.encode_prompts(PROMPTS, NEGATIVES, max_sequence_length=512)
    text_len = cond.embeds.shape[1]
    noise = _noise(adapter)
    t_B = torch.full((2,), 500.0)
    # The math SDPA backend decomposes attention into matmuls the counter sees (the CPU flash
    # kernel has no registered flop formula).
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        adapter.velocity(noise, t_B, cond, 1.0, HEIGHT, WIDTH, true_cfg_scale=4.0)
    measured = counter.get_total_flops()
    analytic = adapter.flops_per_forward(4, HEIGHT, WIDTH, text_len)  # a CFG pair of 2 = 4 samples
    assert abs(analytic - measured) / measured < 0.02, (analytic, measured)


def test_velocity_one_batched_forward_and_differentiable(adapter):
    cond = adapter.encode_prompts(PROMPTS, NEGATIVES, max_sequence_length=512)
    calls = []
    handle = adapter.transformer.register_forward_hook(
        lambda module, args, kwargs, out: calls.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        noise = _noise(adapter)
        latents = noise.clone().requires_grad_(True)
        v = adapter.velocity(latents, torch.full((2,), 700.0), cond, 1.0, HEIGHT, WIDTH, true_cfg_scale=4.0)
        assert calls == [4] and v.dtype == torch.float32 and v.shape == noise.shape
        v.square().mean().backward()
        weight = adapter.transformer.transformer_blocks[0].attn.to_q.weight
        assert weight.grad is not None and weight.grad.abs().sum() > 0
        assert latents.grad is not None and torch.equal(latents.detach(), noise)  # inputs untouched
        adapter.transformer.zero_grad(set_to_none=True)

        calls.clear()
        with torch.no_grad():
            adapter.velocity(
                noise, torch.full((2,), 700.0), cond, 1.0, HEIGHT, WIDTH, true_cfg_scale=1.0
            )  # CFG off
        assert calls == [2]
    finally:
        handle.remove()


def test_builder_is_deterministic(tmp_path, tiny_dir):
    again = build_tiny(tmp_path / "again", seed=0)
    other = build_tiny(tmp_path / "other", seed=1)
    files = sorted(p.relative_to(tiny_dir) for p in tiny_dir.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (tiny_dir / rel).read_bytes() == (again / rel).read_bytes(), rel
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert (tiny_dir / weights).read_bytes() != (other / weights).read_bytes()
