"""Z-Image adapter against diffusers' own ZImagePipeline, on the tiny random Z-Image-Turbo-shaped model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from diffrl import sde
from diffrl.config.schema import PipelineConfig, RolloutConfig, SdeConfig, ValidationConfig
from diffrl.models import load_model
from diffrl.models.zimage import TEXT_BUCKET, ZImageAdapter, build_tiny
from diffrl.rollout import TrajectorySampler
from diffrl.seeding import NOISE_STREAM, generator
from diffrl.transition import evaluate_step

# Different lengths on purpose: each caption is its own length, padded by the transformer itself.
PROMPTS = ["a red circle left of a blue square", "two small green triangles on a white background and a star"]
NEGATIVES = ["blurry", ""]
H = W = 32
MAX_LEN = 64


@pytest.fixture(scope="module")
def tiny_dir(tiny_model) -> Path:
    return tiny_model("zimage")  # built once per session (tests/conftest.py), via diffrl.models.tiny


@pytest.fixture(scope="module")
def adapter(tiny_dir) -> ZImageAdapter:
    return load_model(tiny_dir, dtype="float32")


def _noise(adapter, seeds=(0, 1)):
    return adapter.init_noise([torch.Generator().manual_seed(s) for s in seeds], H, W)


def _ode(adapter, noise, cond, guidance_scale, num_steps):
    schedule = adapter.schedule(num_steps, H, W)
    x = noise
    for k in range(num_steps):
        with torch.no_grad():
            v = adapter.velocity(x, schedule.timesteps[k].expand(x.shape[0]), cond, guidance_scale, H, W)
        x = sde.step("ode", x, v, schedule.sigmas[k], schedule.sigmas[k + 1], 0.0).next_latents
    return x


def _pipe(adapter, prompts, **kwargs):
    # ZImagePipeline.encode_prompt rewrites the prompt list it is given in place (the chat
    # template), so every call gets a fresh list.
    return adapter.pipe(prompt=list(prompts), height=H, width=W, max_sequence_length=MAX_LEN, **kwargs)


def test_loads_through_registry(tiny_dir, adapter):
    assert type(adapter) is ZImageAdapter
    assert json.loads((tiny_dir / "model_index.json").read_text())["_class_name"] == "ZImagePipeline"
    assert type(adapter.pipe.text_encoder).__name__ == "Qwen3Model"
    assert type(adapter.pipe.tokenizer).__name__ == "Qwen2Tokenizer"
    # Qwen3's chat template, as the pipeline applies it (enable_thinking=True: no empty think block)
    text = adapter.pipe.tokenizer.apply_chat_template(
        [{"role": "user", "content": "a cat"}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=True,
    )
    assert text == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"
    # Declared facts name what the transformer really holds: refiners and main layers are one class.
    blocks = [m for m in adapter.transformer.modules() if type(m).__name__ in adapter.block_class_names]
    assert len(blocks) == 4  # 1 noise refiner + 1 caption refiner + 2 layers
    names = [n for n, m in adapter.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in adapter.default_lora_target_modules:  # peft's suffix match
        assert any(n.endswith("." + target) for n in names), target
    assert any(n.startswith("context_refiner.") and n.endswith("attention.to_q") for n in names)
    cfg = adapter.scheduler_config  # Z-Image-Turbo's: static shift 3
    assert (cfg.use_dynamic_shifting, cfg.shift) == (False, 3.0)
    assert sum(f.stat().st_size for f in tiny_dir.rglob("*") if f.is_file()) < 3e6
    # unpacked latents [16, H/8, W/8]; the transformer patchifies 2x2 inside
    assert adapter.latent_shape(64, 32) == (16, 8, 4) and adapter.image_seq_len(64, 32) == 8
    with pytest.raises(ValueError, match="multiples of 16"):
        adapter.latent_shape(40, 32)
    with pytest.raises(ValueError, match="num_frames"):
        adapter.latent_shape(32, 32, num_frames=2)
    # CFG is on for any guidance_scale > 0 (Turbo samples with 0); true CFG is not Z-Image's
    assert not adapter.wants_negative(0.0) and adapter.wants_negative(0.5)
    with pytest.raises(ValueError, match="true_cfg_scale"):
        adapter.velocity(
            _noise(adapter), 500.0, adapter.encode_prompts(PROMPTS, None, 8), 0.0, H, W, true_cfg_scale=4.0
        )


def test_encode_prompts_equals_pipeline(adapter):
    with torch.no_grad():
        pos, neg = adapter.pipe.encode_prompt(
            list(PROMPTS), negative_prompt=list(NEGATIVES), max_sequence_length=MAX_LEN
        )
    lengths = [len(e) for e in pos + neg]
    assert len(set(lengths)) == 4  # every caption its own length
    cond = adapter.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN)
    length = -(-max(lengths) // TEXT_BUCKET) * TEXT_BUCKET
    assert cond.has_negative and cond.embeds.shape == cond.negative_embeds.shape == (2, length, 32)
    for embeds, mask, ref in ((cond.embeds, cond.mask, pos), (cond.negative_embeds, cond.negative_mask, neg)):
        for i, r in enumerate(ref):
            assert torch.equal(embeds[i, : len(r)], r) and mask[i, : len(r)].all()
            assert not embeds[i, len(r) :].any() and not mask[i, len(r) :].any()
    plain = adapter.encode_prompts(PROMPTS, None, MAX_LEN)
    assert not plain.has_negative and torch.equal(plain.mask, cond.mask[:, : plain.mask.shape[1]])
    # max_sequence_length caps the real tokens (the chat template included) and the padding
    capped = adapter.encode_prompts(PROMPTS, None, 8)
    assert capped.embeds.shape[1] == 8 and capped.mask.all()
    with pytest.raises(ValueError, match="max_sequence_length"):
        adapter.encode_prompts(PROMPTS, None, 1024)
    with pytest.raises(ValueError, match="one per prompt"):
        adapter.encode_prompts(PROMPTS, NEGATIVES[:1], MAX_LEN)


@pytest.mark.parametrize("guidance_scale", [0.0, 4.0], ids=["turbo_no_cfg", "cfg"])
def test_ode_matches_pipeline(adapter, guidance_scale):
    """Our ODE loop over adapter.schedule == ZImagePipeline(output_type="latent") from the same noise."""
    steps, cfg_on = 4, guidance_scale > 0
    noise = _noise(adapter)
    cond = adapter.encode_prompts(PROMPTS, NEGATIVES if cfg_on else None, MAX_LEN)
    ours = _ode(adapter, noise, cond, guidance_scale, steps)
    call = adapter.pipeline_call(
        PROMPTS,
        NEGATIVES if cfg_on else None,
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        true_cfg_scale=None,
        height=H,
        width=W,
        num_frames=1,
        max_sequence_length=MAX_LEN,
    )
    ref = adapter.pipeline_latents(noise.clone(), call)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape == (2, 16, 4, 4)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)  # bitwise on this host
    assert (ours - noise).abs().max() > 0.1
    # init_noise draws what the pipeline draws from the same per-sample generators
    gens = [torch.Generator().manual_seed(s) for s in (0, 1)]
    theirs = _pipe(
        adapter,
        PROMPTS,
        generator=gens,
        negative_prompt=list(NEGATIVES) if cfg_on else None,
        guidance_scale=guidance_scale,
        num_inference_steps=steps,
        output_type="latent",
    ).images
    assert torch.equal(theirs, ref)
    if cfg_on:  # CFG matters, so the match above can tell a wrong combination from a right one
        assert (_ode(adapter, noise, cond, 1.0, steps) - ours).abs().max() > 1e-2


def test_decode_equals_pipeline(adapter):
    noise = _noise(adapter, seeds=(3, 4))
    kwargs = dict(guidance_scale=0.0, num_inference_steps=2)
    latents = _pipe(adapter, PROMPTS, latents=noise.clone(), output_type="latent", **kwargs).images
    images = _pipe(adapter, PROMPTS, latents=noise.clone(), output_type="pt", **kwargs).images
    pixels = adapter.decode(latents, H, W)
    assert pixels.dtype == torch.uint8 and pixels.shape == (2, 3, H, W)
    assert torch.equal(pixels, (images * 255).round().to(torch.uint8))
    assert pixels.float().std() > 1  # not a constant image


@pytest.mark.parametrize(("height", "width", "cfg"), [(32, 32, False), (64, 32, True)])
def test_flops_match_flop_counter(adapter, height, width, cfg):
    """The analytic count equals torch's FlopCounterMode on the real forward (SDPA's math backend,
    whose matmuls the counter sees). The prompts' captions all pad to one bucket of 32, so batch
    padding adds nothing here."""
    prompts = ["a cat", "a red dog"]
    cond = adapter.encode_prompts(prompts, ["", "blurry"] if cfg else None, MAX_LEN)
    assert cond.mask.sum(1).max() <= TEXT_BUCKET
    noise = adapter.init_noise([torch.Generator().manual_seed(s) for s in (0, 1)], height, width)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        adapter.velocity(noise, torch.full((2,), 700.0), cond, 4.0 if cfg else 0.0, height, width)
    expected = adapter.flops_per_forward(4 if cfg else 2, height, width, cond.embeds.shape[1])
    assert expected == pytest.approx(counter.get_total_flops(), rel=1e-9)


def test_velocity_one_batched_forward_and_differentiable(adapter):
    cond = adapter.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN)
    rows: list[int] = []
    handle = adapter.transformer.register_forward_hook(
        lambda module, args, kwargs, out: rows.append(len(kwargs["x"])), with_kwargs=True
    )
    try:
        noise = _noise(adapter)
        latents = noise.clone().requires_grad_(True)
        v = adapter.velocity(latents, torch.tensor([900.0, 400.0]), cond, 4.0, H, W)
        assert rows == [4] and v.dtype == torch.float32 and v.shape == noise.shape
        v.square().mean().backward()
        weight = adapter.transformer.layers[0].attention.to_q.weight
        assert weight.grad is not None and weight.grad.abs().sum() > 0 and latents.grad is not None
        assert torch.equal(latents.detach(), noise)
        adapter.transformer.zero_grad(set_to_none=True)
        with torch.no_grad():
            v0 = adapter.velocity(noise, torch.tensor([900.0, 400.0]), cond, 0.0, H, W)  # CFG off
        assert rows == [4, 2] and (v0 - v).abs().max() > 1e-4
    finally:
        handle.remove()
    with pytest.raises(ValueError, match="Z-Image latent layout"):
        adapter.velocity(noise[:, :4], 500.0, cond, 0.0, H, W)


def test_sde_log_probs_are_the_step_math(adapter):
    """An SDE rollout's log-probs: the family-independent `sde.step` on the adapter's velocity at the
    stored latents, a Gaussian density computed here, and the trainer's `evaluate_step`."""
    cfg = RolloutConfig(
        n=2,
        micro_batch_size=4,
        pipeline=PipelineConfig(
            height=H, width=W, num_inference_steps=4, guidance_scale=4.0, max_sequence_length=MAX_LEN
        ),
        sde=SdeConfig(type="sde", noise_level=0.7, window_size=2, window_range=[0, 3]),
        val=ValidationConfig(n=1, seed=3),
    )
    rollout = TrajectorySampler(adapter, cfg, progress=False).sample(PROMPTS, seed=1, step=0)
    assert len(rollout) == 4 and rollout.window_size == 2
    sigma_1 = adapter.schedule(4, H, W).sigma_1
    cond = rollout.sample_cond()
    assert cond.has_negative  # CFG on: both halves train
    for j in range(2):
        x, x_next = rollout.samples.window_latents[:, j], rollout.samples.window_latents[:, j + 1]
        with torch.no_grad():
            v = adapter.velocity(x, rollout.timesteps[j].expand(4), cond, 4.0, H, W)
        out = sde.step(
            "sde", x, v, rollout.sigmas[j], rollout.sigmas[j + 1], 0.7, sigma_1=sigma_1, next_latents=x_next
        )
        assert torch.equal(out.log_prob_B, rollout.samples.log_probs_BW[:, j])
        std = out.std_B.view(-1, 1, 1, 1).expand_as(x)
        gaussian = torch.distributions.Normal(out.mean, std).log_prob(x_next).mean(dim=(1, 2, 3))
        torch.testing.assert_close(gaussian, out.log_prob_B, rtol=0, atol=1e-5)
        with torch.no_grad():
            again = evaluate_step(adapter, rollout, j)
        assert torch.equal(again.log_prob_B, rollout.samples.log_probs_BW[:, j])
    # the validation sampler (ODE) is the pipeline's loop from the same keyed noise
    val = TrajectorySampler(adapter, cfg, progress=False).sample_validation(PROMPTS)
    noise = adapter.init_noise([generator("cpu", NOISE_STREAM, 3, 0, i) for i in range(2)], H, W)
    ref = _pipe(
        adapter,
        PROMPTS,
        latents=noise,
        negative_prompt=[""] * 2,
        guidance_scale=4.0,
        num_inference_steps=4,
        output_type="latent",
    ).images
    torch.testing.assert_close(val.samples.final_latents, ref, rtol=1e-5, atol=1e-5)


def test_builder_is_deterministic(tmp_path, tiny_dir):
    again = build_tiny(tmp_path / "again", seed=0)
    other = build_tiny(tmp_path / "other", seed=1)
    files = sorted(p.relative_to(tiny_dir) for p in tiny_dir.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (tiny_dir / rel).read_bytes() == (again / rel).read_bytes(), rel
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert (tiny_dir / weights).read_bytes() != (other / weights).read_bytes()
