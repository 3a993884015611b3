import copy

import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from peft import LoraConfig
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from diffrl import sde
from diffrl.models import PromptEmbeds, load_model
from diffrl.models.sd3 import SD3Adapter, build_tiny
from diffrl.models.tiny import build_tiny as build_tiny_family

PROMPTS = ["a red circle left of a blue square", "three small green triangles above a star"]
NEGATIVES = ["", "blurry dark"]
H = W = 64
MAX_LEN = 16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("sd3") / "tiny")


@pytest.fixture(scope="module")
def adapter(tiny_dir):
    return load_model(tiny_dir, dtype="float32")


def _noise(adapter, n, height=H, width=W):
    return adapter.init_noise([torch.Generator().manual_seed(100 + i) for i in range(n)], height, width)


def test_loads_through_registry(adapter, tiny_dir):
    assert isinstance(adapter, SD3Adapter)
    assert isinstance(adapter.pipe, StableDiffusion3Pipeline)
    assert adapter.transformer.dtype == torch.float32
    # a tiny SD3.5: dual attention in a block, and the last block is context_pre_only
    blocks = adapter.transformer.transformer_blocks
    assert type(blocks[0]).__name__ in SD3Adapter.block_class_names
    assert blocks[0].attn2 is not None and blocks[-1].context_pre_only
    assert adapter.latent_shape(H, W) == (16, 8, 8)
    assert adapter.image_seq_len(H, W) == 16 and adapter.image_seq_len(32, 96) == 2 * 6
    with pytest.raises(ValueError, match="divisible by 16"):
        adapter.latent_shape(40, 64)
    # the pipeline's defaults land on the tiny size
    assert adapter.pipe.default_sample_size * adapter.pipe.vae_scale_factor == H
    assert build_tiny_family("sd3", tiny_dir.parent / "via_registry") == tiny_dir.parent / "via_registry"


def test_lora_targets_are_flow_grpos_attention_projections(adapter):
    transformer = copy.deepcopy(adapter.transformer)
    transformer.add_adapter(
        LoraConfig(r=2, lora_alpha=4, target_modules=list(SD3Adapter.default_lora_target_modules))
    )
    adapted = {n.removesuffix(".lora_A") for n, _ in transformer.named_modules() if n.endswith(".lora_A")}
    # both streams of the joint attention in every block; the last block (context_pre_only) has no
    # to_add_out; SD3.5's attn2 and the MLPs stay frozen, as in Flow-GRPO's SD3 recipe
    expected = {
        f"transformer_blocks.{i}.attn.{name}"
        for i in range(2)
        for name in (
            "to_q",
            "to_k",
            "to_v",
            "to_out.0",
            "add_q_proj",
            "add_k_proj",
            "add_v_proj",
            "to_add_out",
        )
        if not (i == 1 and name == "to_add_out")
    }
    assert adapted == expected


@pytest.mark.parametrize("negatives", [None, NEGATIVES])
def test_encode_prompts_equals_pipeline(adapter, negatives):
    cond = adapter.encode_prompts(PROMPTS, negatives, max_sequence_length=MAX_LEN)
    assert isinstance(cond, PromptEmbeds) and cond.batch_size == torch.Size([2])
    assert cond.embeds.shape == (2, 77 + MAX_LEN, adapter.transformer.config.joint_attention_dim)
    assert cond.pooled.shape == (2, adapter.transformer.config.pooled_projection_dim)
    assert not cond.embeds.requires_grad and cond.mask is None
    with torch.no_grad():
        embeds, neg, pooled, neg_pooled = adapter.pipe.encode_prompt(
            PROMPTS,
            None,
            None,
            negative_prompt=negatives,
            do_classifier_free_guidance=negatives is not None,
            max_sequence_length=MAX_LEN,
        )
    assert torch.equal(cond.embeds, embeds) and torch.equal(cond.pooled, pooled)
    if negatives is None:
        assert not cond.has_negative and cond.negative_pooled is None
    else:
        assert cond.has_negative
        assert torch.equal(cond.negative_embeds, neg) and torch.equal(cond.negative_pooled, neg_pooled)
        assert not torch.equal(cond.negative_embeds[0], cond.negative_embeds[1])
    # rows gather like a tensor (one encoding per unique prompt, reused per sample)
    rows = cond[torch.tensor([1, 1, 0])]
    assert torch.equal(rows.embeds[2], cond.embeds[0]) and rows.batch_size == torch.Size([3])


def _ode_sample(adapter, cond, noise, steps, guidance, height=H, width=W):
    schedule = adapter.schedule(steps, height, width)
    x = noise
    for k in range(steps):
        t_B = schedule.timesteps[k].expand(x.shape[0])
        v = adapter.velocity(x, t_B, cond, guidance, height, width)
        assert v.dtype == torch.float32 and v.shape == x.shape
        x = sde.step("ode", x, v, schedule.sigmas[k], schedule.sigmas[k + 1], 0.0).next_latents
    return x


def test_ode_loop_with_cfg_equals_pipeline_latents_and_decode(adapter):
    steps, guidance = 4, 4.5
    noise = _noise(adapter, 2)
    cond = adapter.encode_prompts(PROMPTS, NEGATIVES, max_sequence_length=MAX_LEN)
    with torch.no_grad():
        ours = _ode_sample(adapter, cond, noise, steps, guidance)
    kwargs = dict(
        prompt=PROMPTS,
        negative_prompt=NEGATIVES,
        num_inference_steps=steps,
        guidance_scale=guidance,
        height=H,
        width=W,
        max_sequence_length=MAX_LEN,
    )
    ref = adapter.pipe(latents=noise.clone(), output_type="latent", **kwargs).images
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # CFG matters at this scale: without it the result is far away
    with torch.no_grad():
        no_cfg = _ode_sample(adapter, cond, noise, steps, 1.0)
    assert (no_cfg - ref).abs().max() > 1e-2

    pixels = adapter.decode(ours, H, W)
    assert pixels.dtype == torch.uint8 and pixels.shape == (2, 3, H, W)
    ref_np = adapter.pipe(latents=noise.clone(), output_type="np", **kwargs).images
    ref_pixels = torch.from_numpy((ref_np * 255).round().astype(np.uint8)).permute(0, 3, 1, 2)
    assert (pixels.int() - ref_pixels.int()).abs().max() <= 1
    assert pixels.float().std() > 1  # not a constant image


def test_ode_loop_without_negatives_equals_pipeline_without_cfg(adapter):
    noise = _noise(adapter, 2)
    cond = adapter.encode_prompts(PROMPTS, None, max_sequence_length=MAX_LEN)
    with torch.no_grad():
        ours = _ode_sample(adapter, cond, noise, 2, 4.5)  # no negatives: guidance is not applied
    ref = adapter.pipe(
        prompt=PROMPTS,
        latents=noise.clone(),
        num_inference_steps=2,
        guidance_scale=1.0,
        output_type="latent",
        height=H,
        width=W,
        max_sequence_length=MAX_LEN,
    ).images
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("height", "width", "max_len"), [(64, 64, 16), (32, 96, 8)])
def test_flops_match_flop_counter(adapter, height, width, max_len):
    cond = adapter.encode_prompts(PROMPTS, None, max_sequence_length=max_len)
    x = _noise(adapter, 2, height, width)
    # The math SDPA backend runs attention as matmuls, which the counter sees (the fused CPU kernel it
    # does not count); every other op is a linear or the patch-embedding conv.
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        adapter.transformer(
            hidden_states=x,
            timestep=torch.tensor([1000.0, 500.0]),
            encoder_hidden_states=cond.embeds,
            pooled_projections=cond.pooled,
        )
    ours = adapter.flops_per_forward(2, height, width, text_len=cond.embeds.shape[1])
    assert ours == pytest.approx(counter.get_total_flops(), rel=1e-6)
    assert adapter.flops_per_forward(4, height, width, cond.embeds.shape[1]) == 2 * ours
    with pytest.raises(ValueError, match="num_frames"):
        adapter.flops_per_forward(1, height, width, 10, num_frames=2)


def test_velocity_is_one_batched_forward_and_differentiable(adapter):
    cond = adapter.encode_prompts(PROMPTS, NEGATIVES, max_sequence_length=MAX_LEN)
    batches = []
    handle = adapter.transformer.register_forward_hook(
        lambda mod, args, kwargs, out: batches.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        x = _noise(adapter, 2).requires_grad_(True)
        x_before = x.detach().clone()
        t_B = torch.tensor([900.0, 300.0])  # per-sample timesteps
        v = adapter.velocity(x, t_B, cond, 4.5, H, W)
        assert batches == [4]  # uncond + cond in one forward
        v.square().mean().backward()
        assert torch.equal(x.detach(), x_before)
        grad = adapter.transformer.transformer_blocks[0].attn.to_q.weight.grad
        assert grad is not None and grad.abs().sum() > 0
        assert x.grad is not None and x.grad.abs().sum() > 0

        batches.clear()
        with torch.no_grad():
            v1 = adapter.velocity(x, t_B, cond, 1.0, H, W)  # guidance 1: conditional half only
        assert batches == [2]
        # per-sample timesteps: each row equals running that sample alone
        with torch.no_grad():
            v_row = adapter.velocity(x[1:], t_B[1:], cond[1:], 1.0, H, W)
        torch.testing.assert_close(v1[1:], v_row, rtol=1e-5, atol=1e-6)
    finally:
        handle.remove()
        adapter.transformer.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="rows"):
        adapter.velocity(_noise(adapter, 3), torch.tensor([1.0, 1.0, 1.0]), cond, 4.5, H, W)


def test_builder_is_deterministic(tmp_path):
    a = build_tiny(tmp_path / "a", seed=0)
    b = build_tiny(tmp_path / "b", seed=0)
    c = build_tiny(tmp_path / "c", seed=1)
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    weights = [f for f in files if f.suffix == ".safetensors"]
    assert len(weights) == 5
    assert all((a / f).read_bytes() != (c / f).read_bytes() for f in weights)
    assert sum((a / f).stat().st_size for f in files) < 5e6
