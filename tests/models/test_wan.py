"""Wan2.x text-to-video adapter against diffusers' own WanPipeline, on a tiny random Wan2.1-shaped model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import UniPCMultistepScheduler, WanPipeline
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from diffrl import sde
from diffrl.models import load_model
from diffrl.models.wan import TINY_SHIFT, WanAdapter, build_tiny

PROMPTS = ["a red circle left of a blue square", "two  small green triangles &amp; a star\n"]
NEGATIVES = ["blurry", ""]
MAX_LEN = 16
# 5 frames -> 2 latent frames; 32x48 pixels -> 4x6 latents (non-square, so H/W mix-ups show).
H, W, FRAMES = 32, 48, 5

# Wan2.1-T2V-1.3B-Diffusers' scheduler_config.json (the multistep solver its pipeline samples with).
WAN21_UNIPC = {
    "_class_name": "UniPCMultistepScheduler",
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "disable_corrector": [],
    "dynamic_thresholding_ratio": 0.995,
    "final_sigmas_type": "zero",
    "flow_shift": TINY_SHIFT,
    "lower_order_final": True,
    "num_train_timesteps": 1000,
    "predict_x0": True,
    "prediction_type": "flow_prediction",
    "rescale_betas_zero_snr": False,
    "sample_max_value": 1.0,
    "solver_order": 2,
    "solver_p": None,
    "solver_type": "bh2",
    "steps_offset": 0,
    "thresholding": False,
    "timestep_spacing": "linspace",
    "trained_betas": None,
    "use_beta_sigmas": False,
    "use_exponential_sigmas": False,
    "use_flow_sigmas": True,
    "use_karras_sigmas": False,
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("wan") / "tiny", seed=0)


@pytest.fixture(scope="module")
def adapter(tiny_dir) -> WanAdapter:
    return load_model(tiny_dir, dtype="float32")


@pytest.fixture(scope="module")
def pipe(tiny_dir) -> WanPipeline:
    """diffusers' own pipeline on the same directory: the independent reference."""
    pipe = WanPipeline.from_pretrained(str(tiny_dir), dtype=torch.float32, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _noise(adapter, seeds=(0, 1)):
    return adapter.init_noise([torch.Generator().manual_seed(s) for s in seeds], H, W, FRAMES)


def _ode(adapter, noise, cond, num_steps, guidance_scale):
    schedule = adapter.schedule(num_steps, H, W, FRAMES)
    x = noise
    for k in range(num_steps):
        t_B = schedule.timesteps[k].expand(x.shape[0])
        v = adapter.velocity(x, t_B, cond, guidance_scale, H, W, FRAMES)
        x = sde.step("ode", x, v, schedule.sigmas[k], schedule.sigmas[k + 1], 0.0).next_latents
    return x


def _pipe_call(pipe, noise, num_steps, guidance_scale, output_type):
    return pipe(
        prompt=PROMPTS,
        negative_prompt=NEGATIVES,
        latents=noise.clone(),
        num_inference_steps=num_steps,
        guidance_scale=guidance_scale,
        height=H,
        width=W,
        num_frames=FRAMES,
        max_sequence_length=MAX_LEN,
        output_type=output_type,
    ).frames


def test_loads_through_registry(tiny_dir, adapter):
    assert type(adapter) is WanAdapter and WanAdapter.is_video
    index = json.loads((tiny_dir / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    assert adapter.pipe.scheduler.config.shift == TINY_SHIFT
    assert index["text_encoder"] == ["transformers", "UMT5EncoderModel"]
    # Wan2.1's VAE compression: x4 in time, x8 in space.
    assert (adapter.pipe.vae_scale_factor_temporal, adapter.pipe.vae_scale_factor_spatial) == (4, 8)
    size = sum(f.stat().st_size for f in tiny_dir.rglob("*") if f.is_file())
    assert size < 5e6, size
    # Declared facts name what the transformer really holds.
    blocks = list(adapter.transformer.blocks)
    assert {type(b).__name__ for b in blocks} == set(WanAdapter.block_class_names)
    names = [n for n, m in adapter.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in WanAdapter.default_lora_target_modules:  # peft's suffix match
        hits = [n for n in names if n.endswith("." + target)]
        assert hits and all(n.startswith("blocks.") for n in hits), target
    # q/k/v/o of both the self- and the cross-attention of every block, and both FFN projections.
    for i in range(len(blocks)):
        for attn in ("attn1", "attn2"):
            for proj in ("to_q", "to_k", "to_v", "to_out.0"):
                assert f"blocks.{i}.{attn}.{proj}" in names
    # bf16 loading keeps the VAE in fp32 (as the Wan examples load it)
    bf16 = load_model(tiny_dir, dtype="bfloat16")
    assert bf16.transformer.dtype == torch.bfloat16 and bf16.pipe.vae.dtype == torch.float32


def test_latent_layout(adapter):
    # [C, T', H/8, W/8] with T' = (5 - 1)//4 + 1; tokens: 2 frames x (4/2) x (6/2).
    assert adapter.latent_shape(H, W, FRAMES) == (4, 2, 4, 6)
    assert adapter.latent_shape(H, W, 1) == (4, 1, 4, 6)
    assert adapter.image_seq_len(H, W, FRAMES) == 12
    assert _noise(adapter).shape == (2, 4, 2, 4, 6) and _noise(adapter).dtype == torch.float32
    with pytest.raises(ValueError, match="num_frames"):
        adapter.latent_shape(H, W, 4)
    with pytest.raises(ValueError, match="multiples of 16"):
        adapter.latent_shape(40, W, FRAMES)


def test_encode_prompts_equals_pipeline(adapter, pipe):
    pe = adapter.encode_prompts(PROMPTS, None, MAX_LEN)
    embeds, negative = pipe.encode_prompt(
        PROMPTS, do_classifier_free_guidance=False, max_sequence_length=MAX_LEN
    )
    assert negative is None and not pe.has_negative and pe.mask is None and pe.pooled is None
    assert pe.batch_size == torch.Size([2]) and pe.embeds.shape == (2, MAX_LEN, 32)
    assert not pe.embeds.requires_grad
    torch.testing.assert_close(pe.embeds, embeds.detach(), rtol=0, atol=1e-5)
    # each prompt's embeddings are zero-padded to max_sequence_length after its own tokens (+ eos)
    n_tokens = pipe.tokenizer(["a red circle left of a blue square"]).attention_mask[0].__len__()
    assert n_tokens == 9
    assert pe.embeds[0, :n_tokens].abs().amin(dim=-1).gt(0).all() and (pe.embeds[0, n_tokens:] == 0).all()

    pe = adapter.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN)
    embeds, negative = pipe.encode_prompt(PROMPTS, NEGATIVES, max_sequence_length=MAX_LEN)
    assert pe.has_negative and pe.negative_embeds.shape == (2, MAX_LEN, 32)
    torch.testing.assert_close(pe.embeds, embeds.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(pe.negative_embeds, negative.detach(), rtol=0, atol=1e-5)
    # a row depends only on its own prompt (the sampler encodes unique prompts in any grouping)
    one = adapter.encode_prompts(PROMPTS[1:], NEGATIVES[1:], MAX_LEN)
    torch.testing.assert_close(one.embeds[0], pe.embeds[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(one.negative_embeds[0], pe.negative_embeds[1], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="negative prompts"):
        adapter.encode_prompts(PROMPTS, NEGATIVES[:1], MAX_LEN)


@pytest.mark.parametrize("guidance_scale", [4.0, 1.0])
def test_ode_sampling_equals_pipeline(adapter, pipe, guidance_scale):
    """Our loop (schedule + velocity + sde.step("ode")) == WanPipeline's latents, CFG on and off."""
    noise = _noise(adapter)
    cond = adapter.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN)
    ours = _ode(adapter, noise, cond, 4, guidance_scale)
    theirs = _pipe_call(pipe, noise, 4, guidance_scale, "latent")
    assert theirs.shape == ours.shape == noise.shape
    assert (ours - noise).abs().max() > 0.5  # it did move
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_cfg_is_one_batched_forward_equal_to_two_passes(adapter):
    calls = []
    handle = adapter.transformer.register_forward_hook(
        lambda mod, args, kwargs, out: calls.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        cond = adapter.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN)
        x = _noise(adapter)
        t_B = torch.tensor([700.0, 300.0])
        v = adapter.velocity(x, t_B, cond, 5.0, H, W, FRAMES)
        assert calls == [4]
        # no CFG: guidance 1, or no negatives -> one forward of B
        v_cond = adapter.velocity(x, t_B, cond, 1.0, H, W, FRAMES)
        v_uncond = adapter.velocity(
            x, t_B, type(cond)(embeds=cond.negative_embeds, batch_size=[2]), 5.0, H, W, FRAMES
        )
        assert calls == [4, 2, 2]
    finally:
        handle.remove()
    # the pipeline's form: two passes, uncond + g·(cond − uncond)
    torch.testing.assert_close(v, v_uncond + 5.0 * (v_cond - v_uncond), rtol=1e-5, atol=1e-5)
    # per-sample timesteps reach the right samples
    v0 = adapter.velocity(x[:1], t_B[:1], cond[:1], 5.0, H, W, FRAMES)
    torch.testing.assert_close(v[:1], v0, rtol=1e-5, atol=1e-5)


def test_velocity_is_differentiable(adapter):
    cond = adapter.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN)
    x = _noise(adapter).requires_grad_(True)
    before = x.detach().clone()
    adapter.transformer.zero_grad(set_to_none=True)
    v = adapter.velocity(x, torch.tensor([500.0, 500.0]), cond, 4.0, H, W, FRAMES)
    assert v.dtype == torch.float32 and v.shape == x.shape
    v.pow(2).mean().backward()
    for param in (adapter.transformer.blocks[0].attn1.to_q.weight, adapter.transformer.proj_out.weight):
        assert param.grad is not None and param.grad.abs().sum() > 0
    assert x.grad is not None and torch.equal(x.detach(), before)
    adapter.transformer.zero_grad(set_to_none=True)


def test_bf16_velocity_close_to_fp32(tiny_dir, adapter):
    bf16 = load_model(tiny_dir, dtype="bfloat16")
    x = _noise(adapter)
    t_B = torch.tensor([600.0, 600.0])
    v16 = bf16.velocity(x, t_B, bf16.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN), 4.0, H, W, FRAMES)
    v32 = adapter.velocity(x, t_B, adapter.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN), 4.0, H, W, FRAMES)
    assert v16.dtype == torch.float32
    assert (v16 - v32).norm() / v32.norm() < 0.05


def test_decode_equals_pipeline(adapter, pipe):
    noise = _noise(adapter)
    latents = _pipe_call(pipe, noise, 2, 4.0, "latent")
    frames = _pipe_call(pipe, noise, 2, 4.0, "pt")  # [B, T, 3, H, W] in [0, 1]
    video = adapter.decode(latents, H, W, FRAMES)
    assert video.dtype == torch.uint8 and video.shape == (2, FRAMES, 3, H, W)
    assert torch.equal(video, (frames * 255).round().to(torch.uint8))
    assert video.float().std() > 5  # not a constant picture
    # the test has power: without latents_mean/std de-normalisation the video differs
    with torch.no_grad():
        plain = adapter.pipe.vae.decode(latents, return_dict=False)[0].permute(0, 2, 1, 3, 4)
    assert (video.float() - ((plain / 2 + 0.5).clamp(0, 1) * 255).round()).abs().max() > 10
    with pytest.raises(ValueError, match="expected"):
        adapter.decode(latents, H, W, 9)


def test_expand_timesteps_equals_pipeline(adapter, pipe):
    """Wan2.2 TI2V's per-token timesteps (`expand_timesteps=True`), through the same pipeline code."""
    components = {k: v for k, v in pipe.components.items() if k != "transformer_2"}
    ti2v = WanPipeline(**components, expand_timesteps=True)
    ti2v.set_progress_bar_config(disable=True)
    ours_adapter = WanAdapter(ti2v, torch.device("cpu"), torch.float32)
    noise = _noise(adapter)
    cond = ours_adapter.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN)
    ours = _ode(ours_adapter, noise, cond, 3, 4.0)
    theirs = _pipe_call(ti2v, noise, 3, 4.0, "latent")
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # per-token timesteps cost the time MLP per token
    assert ours_adapter.flops_per_forward(1, H, W, MAX_LEN, FRAMES) > adapter.flops_per_forward(
        1, H, W, MAX_LEN, FRAMES
    )


def test_unipc_flow_sigmas_directory_samples_as_euler(tiny_dir, adapter, pipe, tmp_path):
    """A directory with the real checkpoints' UniPC config loads and gets Euler sigmas with its flow_shift."""
    unipc = WanPipeline.from_pretrained(
        str(tiny_dir),
        scheduler=UniPCMultistepScheduler.from_config(WAN21_UNIPC),
        dtype=torch.float32,
        local_files_only=True,
    )
    unipc.save_pretrained(tmp_path / "unipc")
    loaded = load_model(tmp_path / "unipc", dtype="float32")
    assert type(loaded.pipe.scheduler).__name__ == "UniPCMultistepScheduler"
    for n in (1, 4, 10):
        ours, euler = loaded.schedule(n, H, W, FRAMES), adapter.schedule(n, H, W, FRAMES)
        torch.testing.assert_close(ours.sigmas, euler.sigmas, rtol=0, atol=0)
        torch.testing.assert_close(ours.timesteps, euler.timesteps, rtol=0, atol=0)
    # and the Euler schedule is what WanPipeline itself steps through on the tiny directory
    pipe.scheduler.set_timesteps(10)
    torch.testing.assert_close(adapter.schedule(10, H, W, FRAMES).timesteps, pipe.scheduler.timesteps.float())
    x = _noise(adapter)
    cond = adapter.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN)
    torch.testing.assert_close(_ode(loaded, x, cond, 3, 4.0), _ode(adapter, x, cond, 3, 4.0), rtol=0, atol=0)


@pytest.mark.parametrize(("num_frames", "guidance_scale"), [(FRAMES, 4.0), (1, 1.0), (9, 4.0)])
def test_flops_match_flop_counter(adapter, num_frames, guidance_scale):
    cond = adapter.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN)
    x = adapter.init_noise([torch.Generator().manual_seed(s) for s in (0, 1)], H, W, num_frames)
    # CPU SDPA dispatches to a fused kernel FlopCounterMode has no formula for; the math backend
    # runs the same attention as bmm calls, which it counts.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        adapter.velocity(x, torch.tensor([500.0, 500.0]), cond, guidance_scale, H, W, num_frames)
    measured = counter.get_total_flops()
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    assert counts.keys() == {"aten.convolution", "aten.addmm", "aten.bmm"}  # patch embed, linears, attention
    rows = 4 if guidance_scale > 1 else 2  # a CFG pair counts as 2 samples
    analytic = adapter.flops_per_forward(rows, H, W, MAX_LEN, num_frames)
    # Exact up to float formatting: every matmul of the forward is in the formula, nothing else is.
    assert measured == pytest.approx(analytic, rel=1e-6)
    assert adapter.flops_per_forward(1, H, W, MAX_LEN, num_frames) == pytest.approx(analytic / rows)


def test_builder_is_deterministic(tiny_dir, tmp_path):
    again = build_tiny(tmp_path / "again", seed=0)
    other = build_tiny(tmp_path / "other", seed=1)
    weight_files = sorted(p.relative_to(tiny_dir) for p in tiny_dir.rglob("*.safetensors"))
    assert len(weight_files) == 3  # text_encoder, transformer, vae
    for rel in weight_files:
        a, b, c = load_file(tiny_dir / rel), load_file(again / rel), load_file(other / rel)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rel
        assert any(not torch.equal(a[k], c[k]) for k in a), rel
    for rel in sorted(p.relative_to(tiny_dir) for p in tiny_dir.rglob("*.json")):
        assert (tiny_dir / rel).read_text() == (again / rel).read_text(), rel
