"""FLUX.1 adapter against diffusers' own FluxPipeline, on a tiny random FLUX.1-dev-shaped model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from diffrl import sde
from diffrl.models import load_model
from diffrl.models.flux import FluxAdapter, build_tiny

PROMPTS = ["a red circle left of a blue square", "two small green triangles on a white background"]
NEGATIVES = ["blurry", "a photo of a dog"]
MAX_LEN = 24


@pytest.fixture(scope="module")
def tiny_dir(tiny_model) -> Path:
    return tiny_model("flux")  # built once per session (tests/conftest.py), via diffrl.models.tiny


@pytest.fixture(scope="module")
def adapter(tiny_dir) -> FluxAdapter:
    return load_model(tiny_dir, dtype="float32")


def _noise(adapter, height, width, seeds=(0, 1)):
    return adapter.init_noise([torch.Generator().manual_seed(s) for s in seeds], height, width)


def _ode(adapter, noise, cond, num_steps, height, width, guidance_scale, **kwargs):
    schedule = adapter.schedule(num_steps, height, width)
    x = noise
    for k in range(num_steps):
        t_B = schedule.timesteps[k].expand(x.shape[0])
        v = adapter.velocity(x, t_B, cond, guidance_scale, height, width, **kwargs)
        x = sde.step("ode", x, v, schedule.sigmas[k], schedule.sigmas[k + 1], 0.0).next_latents
    return x


def test_loads_through_registry(tiny_dir, adapter):
    assert type(adapter) is FluxAdapter
    assert json.loads((tiny_dir / "model_index.json").read_text())["_class_name"] == "FluxPipeline"
    assert adapter.transformer.config.guidance_embeds  # FLUX.1-dev-shaped: guidance-distilled
    assert not adapter.wants_negative(3.5)  # guidance is an embedding, not CFG
    # Declared facts name what the transformer really holds.
    classes = {type(m).__name__ for m in adapter.transformer.modules()}
    assert set(FluxAdapter.block_class_names) <= classes
    names = [n for n, m in adapter.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in FluxAdapter.default_lora_target_modules:  # peft's suffix match
        assert any(n.endswith("." + target) for n in names), target
    assert any(n.startswith("single_transformer_blocks.") and n.endswith(".attn.to_q") for n in names)


def test_latent_layout(adapter):
    # 64x32 pixels -> VAE latent 16ch x 8x4 -> 2x2 packing -> 4x2 = 8 tokens of 64 channels.
    assert adapter.latent_shape(64, 32) == (8, 64)
    assert adapter.image_seq_len(64, 32) == 8
    assert adapter.init_noise([torch.Generator().manual_seed(0)], 64, 32).dtype == torch.float32
    with pytest.raises(ValueError, match="multiples of 16"):
        adapter.latent_shape(40, 32)
    with pytest.raises(ValueError, match="num_frames"):
        adapter.latent_shape(32, 32, num_frames=2)


def test_encode_prompts_equals_pipeline(adapter):
    pe = adapter.encode_prompts(PROMPTS, None, MAX_LEN)
    with torch.no_grad():  # as encode_prompts (grad mode can pick other kernels: ~1e-6 apart)
        embeds, pooled, _ = adapter.pipe.encode_prompt(prompt=PROMPTS, max_sequence_length=MAX_LEN)
        neg_embeds, neg_pooled, _ = adapter.pipe.encode_prompt(prompt=NEGATIVES, max_sequence_length=MAX_LEN)
    assert pe.batch_size == torch.Size([2]) and not pe.has_negative and pe.mask is None
    assert pe.embeds.shape == (2, MAX_LEN, 32) and pe.embeds.requires_grad is False
    torch.testing.assert_close(pe.embeds, embeds, rtol=0, atol=0)
    torch.testing.assert_close(pe.pooled, pooled, rtol=0, atol=0)

    pe = adapter.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN)
    assert pe.has_negative
    torch.testing.assert_close(pe.embeds, embeds, rtol=0, atol=0)
    torch.testing.assert_close(pe.negative_embeds, neg_embeds, rtol=0, atol=0)
    torch.testing.assert_close(pe.negative_pooled, neg_pooled, rtol=0, atol=0)
    assert not torch.equal(pe.negative_embeds, pe.embeds)
    # Rows gather like any tensorclass (the sampler's per-sample cond).
    assert torch.equal(pe[torch.tensor([1, 1, 0])].negative_pooled[0], neg_pooled[1])
    with pytest.raises(ValueError, match="one negative per prompt"):
        adapter.encode_prompts(PROMPTS, NEGATIVES[:1], MAX_LEN)


@pytest.mark.parametrize("true_cfg", [False, True], ids=["distilled_guidance", "true_cfg"])
def test_ode_matches_pipeline(adapter, true_cfg):
    """Our ODE loop over adapter.schedule == FluxPipeline(output_type="latent") from the same noise."""
    height, width, steps, guidance = 32, 64, 4, 3.5  # non-square: catches h/w swaps in the ids
    noise = _noise(adapter, height, width)
    cond = adapter.encode_prompts(PROMPTS, NEGATIVES if true_cfg else None, MAX_LEN)
    cfg_kwargs = {"true_cfg_scale": 4.0} if true_cfg else {}
    ours = _ode(adapter, noise, cond, steps, height, width, guidance, **cfg_kwargs)
    pipe_kwargs = {"negative_prompt": NEGATIVES, "true_cfg_scale": 4.0} if true_cfg else {}
    ref = adapter.pipe(
        prompt=PROMPTS,
        latents=noise.clone(),
        num_inference_steps=steps,
        guidance_scale=guidance,
        height=height,
        width=width,
        max_sequence_length=MAX_LEN,
        output_type="latent",
        **pipe_kwargs,
    ).images
    assert ours.dtype == torch.float32 and ours.shape == ref.shape == noise.shape
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # The settings matter (so the match above is not vacuous): another guidance embedding value or
    # dropping true CFG changes the result.
    other = _ode(adapter, noise, cond, steps, height, width, 1.0, **cfg_kwargs)
    assert (other - ref).abs().max() > 1e-3
    if true_cfg:
        no_cfg = _ode(adapter, noise, cond, steps, height, width, guidance)
        assert (no_cfg - ref).abs().max() > 1e-3


def test_decode_equals_pipeline(adapter):
    height, width = 64, 32
    noise = _noise(adapter, height, width)
    kwargs = dict(
        prompt=PROMPTS,
        latents=noise,
        num_inference_steps=2,
        guidance_scale=3.5,
        height=height,
        width=width,
        max_sequence_length=MAX_LEN,
    )
    latents = adapter.pipe(**kwargs, output_type="latent").images
    images = adapter.pipe(**kwargs, output_type="pt").images  # [B, 3, H, W] in [0, 1]
    pixels = adapter.decode(latents, height, width)
    assert pixels.dtype == torch.uint8 and pixels.shape == (2, 3, height, width)
    assert torch.equal(pixels, (images * 255).round().to(torch.uint8))
    assert pixels.float().std() > 1  # not a constant image


def test_encode_is_the_training_scripts_packed_latent(adapter):
    """`diffrl sft`'s encoder: the VAE posterior's mode, (z - shift) * scale, packed as the pipeline packs."""
    pixels = (torch.arange(2 * 3 * 64 * 32) % 251).to(torch.uint8).reshape(2, 3, 64, 32)
    latents = adapter.encode(pixels)
    assert latents.shape == (2, *adapter.latent_shape(64, 32)) and latents.dtype == torch.float32
    vae = adapter.pipe.vae
    with torch.no_grad():
        z = vae.encode(pixels.float() / 127.5 - 1).latent_dist.mode()
    expected = (z - vae.config.shift_factor) * vae.config.scaling_factor
    torch.testing.assert_close(latents, adapter.pipe._pack_latents(expected, 2, 16, 8, 4))
    with pytest.raises(ValueError, match="multiples of 16"):
        adapter.encode(pixels[..., :24])


@pytest.mark.parametrize(("height", "width", "cfg"), [(32, 32, False), (64, 32, True)])
def test_flops_match_flop_counter(adapter, height, width, cfg):
    """The analytic count equals torch's FlopCounterMode on the real forward.

    SDPA runs on its math backend here: CPU's fused flash kernel has no flop formula in torch, so
    under the default backend the counter would miss attention; the math backend decomposes it into
    the bmm calls (QK^T, AV) that the counter sees. Everything else is nn.Linear (addmm).
    """
    cond = adapter.encode_prompts(PROMPTS, NEGATIVES if cfg else None, MAX_LEN)
    x = _noise(adapter, height, width)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        adapter.velocity(x, torch.full((2,), 700.0), cond, 3.5, height, width, true_cfg_scale=4.0)
    rows = 4 if cfg else 2  # a CFG pair counts as 2 samples
    expected = adapter.flops_per_forward(rows, height, width, MAX_LEN)
    assert expected == pytest.approx(counter.get_total_flops(), rel=1e-9)


def test_velocity_one_batched_forward_and_differentiable(adapter):
    height, width = 32, 32
    cond = adapter.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN)
    x = _noise(adapter, height, width)
    x_before = x.clone()
    t_B = torch.tensor([900.0, 400.0])
    rows: list[int] = []
    handle = adapter.transformer.register_forward_hook(
        lambda module, args, kwargs, out: rows.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        v = adapter.velocity(x, t_B, cond, 3.5, height, width, true_cfg_scale=4.0)
        assert rows == [4]  # one forward of [uncond, cond]
        v.square().mean().backward()
        v1 = adapter.velocity(x, t_B, cond, 3.5, height, width, true_cfg_scale=1.0)
        assert rows == [4, 2]  # true_cfg_scale <= 1: one conditional pass, as the pipeline
        plain = adapter.encode_prompts(PROMPTS, None, MAX_LEN)
        v_plain = adapter.velocity(x, t_B, plain, 3.5, height, width)
        assert rows == [4, 2, 2]
    finally:
        handle.remove()
    assert v.dtype == torch.float32 and v.shape == x.shape
    assert torch.equal(x, x_before)
    grads = [p.grad for p in adapter.transformer.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    adapter.transformer.zero_grad(set_to_none=True)
    torch.testing.assert_close(v1, v_plain)
    assert (v - v1).abs().max() > 1e-4
    with pytest.raises(ValueError, match="packed FLUX layout"):
        adapter.velocity(x[:, :2], t_B, cond, 3.5, height, width)


def test_bfloat16_velocity_is_fp32(tiny_dir):
    adapter = load_model(tiny_dir, dtype="bfloat16")
    assert adapter.transformer.dtype == torch.bfloat16
    cond = adapter.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN)
    x = _noise(adapter, 32, 32)
    v = adapter.velocity(x, torch.tensor([1000.0, 500.0]), cond, 3.5, 32, 32, true_cfg_scale=4.0)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()
    assert adapter.decode(x, 32, 32).dtype == torch.uint8


def test_builder_is_deterministic(tmp_path):
    def weights(path: Path) -> dict[str, torch.Tensor]:
        return {
            f"{f.parent.name}/{key}": value
            for f in sorted(path.rglob("*.safetensors"))
            for key, value in load_file(f).items()
        }

    a, b, c = (build_tiny(tmp_path / name, seed=seed) for name, seed in (("a", 0), ("b", 0), ("c", 1)))
    wa, wb, wc = weights(a), weights(b), weights(c)
    assert wa.keys() == wb.keys() == wc.keys() and len(wa) > 100
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)
    configs = sorted(p.relative_to(a) for p in a.rglob("*.json"))
    assert configs == sorted(p.relative_to(b) for p in b.rglob("*.json"))
    for rel in configs:
        assert (a / rel).read_text() == (b / rel).read_text(), rel
    size = sum(f.stat().st_size for f in a.rglob("*") if f.is_file())
    assert size < 5 * 2**20
