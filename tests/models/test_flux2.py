"""FLUX.2 [klein] adapter against diffusers' own Flux2KleinPipeline, on tiny random klein models
(step-distilled, as FLUX.2-klein-4B/9B, and base, which samples with CFG)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from diffrl import sde
from diffrl.config.schema import PipelineConfig, RolloutConfig, SdeConfig, ValidationConfig
from diffrl.models import load_model
from diffrl.models.flux2 import Flux2KleinAdapter, build_tiny
from diffrl.rollout import TrajectorySampler
from diffrl.transition import evaluate_step

PROMPTS = ["a red circle left of a blue square", "two small green triangles on a white background"]
NEGATIVES = ["blurry", "a photo of a dog"]
H, W = 32, 64  # non-square: catches h/w swaps in the ids and the unpacking
MAX_LEN = 32


@pytest.fixture(scope="module")
def distilled(tiny_model) -> Flux2KleinAdapter:
    return load_model(tiny_model("flux2_klein"), dtype="float32")


@pytest.fixture(scope="module")
def base(tiny_model) -> Flux2KleinAdapter:
    return load_model(tiny_model("flux2_klein_base"), dtype="float32")


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


def _call(adapter, negatives, guidance_scale, steps):
    return adapter.pipeline_call(
        PROMPTS,
        negatives,
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        true_cfg_scale=None,
        height=H,
        width=W,
        num_frames=1,
        max_sequence_length=MAX_LEN,
    )


def test_loads_through_registry(tiny_model, distilled, base):
    for adapter, is_distilled in ((distilled, True), (base, False)):
        assert type(adapter) is Flux2KleinAdapter and adapter.distilled is is_distilled
    index = json.loads((tiny_model("flux2_klein") / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2KleinPipeline" and index["is_distilled"] is True
    assert type(distilled.pipe.text_encoder).__name__ == "Qwen3ForCausalLM"
    assert not distilled.transformer.config.guidance_embeds
    text = distilled.pipe.tokenizer.apply_chat_template(
        [{"role": "user", "content": "a cat"}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    assert text == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    classes = {type(m).__name__ for m in distilled.transformer.modules()}
    assert set(distilled.block_class_names) <= classes
    names = [n for n, m in distilled.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in distilled.default_lora_target_modules:  # peft's suffix match
        assert any(n.endswith("." + target) for n in names), target
    assert sum(f.stat().st_size for f in tiny_model("flux2_klein").rglob("*") if f.is_file()) < 3e6
    # packed [B, (H/16)(W/16), 128]: 32 VAE channels x 2 x 2
    assert distilled.latent_shape(H, W) == (8, 128) and distilled.image_seq_len(H, W) == 8
    with pytest.raises(ValueError, match="multiples of 16"):
        distilled.latent_shape(40, 32)
    # CFG: classic for g > 1 on a base model; a distilled one refuses g > 1 (its pipeline ignores it)
    assert base.wants_negative(4.0) and not base.wants_negative(1.0) and not distilled.wants_negative(1.0)
    with pytest.raises(ValueError, match=r"step-distilled.*guidance_scale=1\.0"):
        distilled.wants_negative(4.0)


def test_encode_prompts_equals_pipeline(distilled):
    cond = distilled.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN)
    with torch.no_grad():
        pos, _ = distilled.pipe.encode_prompt(list(PROMPTS), max_sequence_length=MAX_LEN)
        neg, _ = distilled.pipe.encode_prompt(list(NEGATIVES), max_sequence_length=MAX_LEN)
    assert cond.embeds.shape == (2, MAX_LEN, 48) and cond.mask is None  # 3 Qwen3 layers of 16
    assert torch.equal(cond.embeds, pos) and torch.equal(cond.negative_embeds, neg)
    with pytest.raises(ValueError, match="max_sequence_length"):
        distilled.encode_prompts(PROMPTS, None, 1024)


def test_schedule_is_the_pipelines(distilled):
    """FLUX.2's own mu (`compute_empirical_mu`, of the token count and the step count), read back
    from the scheduler the pipeline ran."""
    for steps in (4, 9):
        ours = distilled.schedule(steps, H, W)
        distilled.pipe(**_call(distilled, None, 1.0, steps), latents=None, output_type="latent")
        theirs = distilled.pipe.scheduler
        assert torch.equal(ours.timesteps, theirs.timesteps.float())
        assert torch.equal(ours.sigmas, theirs.sigmas.float())


@pytest.mark.parametrize("variant", ["distilled", "base_cfg", "base_no_cfg"])
def test_ode_matches_pipeline(distilled, base, variant):
    """Our ODE loop over adapter.schedule == the pipeline's latents after its last step."""
    adapter = distilled if variant == "distilled" else base
    guidance, negatives = (4.0, NEGATIVES) if variant == "base_cfg" else (1.0, None)
    steps = 3
    noise = _noise(adapter)
    cond = adapter.encode_prompts(PROMPTS, negatives, MAX_LEN)
    ours = _ode(adapter, noise, cond, guidance, steps)
    ref = adapter.pipeline_latents(noise.clone(), _call(adapter, negatives, guidance, steps))
    assert ours.dtype == torch.float32 and ours.shape == ref.shape == (2, 8, 128)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)  # bitwise on this host
    assert (ours - noise).abs().max() > 0.1
    if variant == "base_cfg":  # the negatives and the scale matter, so the match can tell
        assert (_ode(adapter, noise, cond, 2.0, steps) - ours).abs().max() > 1e-3
        other = adapter.encode_prompts(PROMPTS, ["", ""], MAX_LEN)
        assert (_ode(adapter, noise, other, guidance, steps) - ours).abs().max() > 1e-3
    # init_noise draws what the pipeline draws from the same per-sample generators
    gens = [torch.Generator().manual_seed(s) for s in (0, 1)]
    drawn, _ = adapter.pipe.prepare_latents(2, 32, H, W, torch.float32, "cpu", gens)
    assert torch.equal(drawn, noise)


def test_decode_equals_pipeline(distilled):
    noise = _noise(distilled, seeds=(3, 4))
    call = _call(distilled, None, 1.0, 2)
    latents = distilled.pipeline_latents(noise.clone(), call)
    unpacked = noise.permute(0, 2, 1).reshape(2, 128, H // 16, W // 16)
    images = distilled.pipe(latents=unpacked, output_type="pt", **_call(distilled, None, 1.0, 2)).images
    pixels = distilled.decode(latents, H, W)
    assert pixels.dtype == torch.uint8 and pixels.shape == (2, 3, H, W)
    assert torch.equal(pixels, (images * 255).round().to(torch.uint8))
    assert pixels.float().std() > 1


@pytest.mark.parametrize("cfg", [False, True])
def test_flops_match_flop_counter(base, cfg):
    cond = base.encode_prompts(PROMPTS, NEGATIVES if cfg else None, MAX_LEN)
    noise = _noise(base)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        base.velocity(noise, torch.full((2,), 700.0), cond, 4.0 if cfg else 1.0, H, W)
    expected = base.flops_per_forward(4 if cfg else 2, H, W, MAX_LEN)
    assert expected == pytest.approx(counter.get_total_flops(), rel=1e-9)


def test_velocity_one_batched_forward_and_differentiable(base):
    cond = base.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN)
    rows: list[int] = []
    handle = base.transformer.register_forward_hook(
        lambda module, args, kwargs, out: rows.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        noise = _noise(base)
        latents = noise.clone().requires_grad_(True)
        v = base.velocity(latents, torch.tensor([900.0, 400.0]), cond, 4.0, H, W)
        assert rows == [4] and v.dtype == torch.float32 and v.shape == noise.shape
        v.square().mean().backward()
        weight = base.transformer.single_transformer_blocks[0].attn.to_qkv_mlp_proj.weight
        assert weight.grad is not None and weight.grad.abs().sum() > 0 and latents.grad is not None
        base.transformer.zero_grad(set_to_none=True)
        with torch.no_grad():
            v1 = base.velocity(noise, torch.tensor([900.0, 400.0]), cond, 1.0, H, W)  # CFG off
        assert rows == [4, 2] and (v1 - v).abs().max() > 1e-4
    finally:
        handle.remove()
    with pytest.raises(ValueError, match=r"packed FLUX\.2 layout"):
        base.velocity(noise[:, :2], 500.0, cond, 1.0, H, W)


def test_sde_log_probs_are_the_step_math(base):
    """An SDE rollout's log-probs (CFG on): `sde.step` on the adapter's velocity at the stored
    latents, a Gaussian density computed here, and the trainer's `evaluate_step`, bit for bit."""
    cfg = RolloutConfig(
        n=2,
        micro_batch_size=4,
        pipeline=PipelineConfig(
            height=H, width=W, num_inference_steps=4, guidance_scale=4.0, max_sequence_length=MAX_LEN
        ),
        sde=SdeConfig(type="sde", noise_level=0.7, window_size=2, window_range=[0, 3]),
        val=ValidationConfig(n=1, seed=3),
    )
    rollout = TrajectorySampler(base, cfg, progress=False).sample(PROMPTS, seed=1, step=0)
    sigma_1 = base.schedule(4, H, W).sigma_1
    cond = rollout.sample_cond()
    assert cond.has_negative and rollout.window_size == 2
    for j in range(2):
        x, x_next = rollout.samples.window_latents[:, j], rollout.samples.window_latents[:, j + 1]
        with torch.no_grad():
            v = base.velocity(x, rollout.timesteps[j].expand(4), cond, 4.0, H, W)
        out = sde.step(
            "sde", x, v, rollout.sigmas[j], rollout.sigmas[j + 1], 0.7, sigma_1=sigma_1, next_latents=x_next
        )
        assert torch.equal(out.log_prob_B, rollout.samples.log_probs_BW[:, j])
        std = out.std_B.view(-1, 1, 1).expand_as(x)
        gaussian = torch.distributions.Normal(out.mean, std).log_prob(x_next).mean(dim=(1, 2))
        torch.testing.assert_close(gaussian, out.log_prob_B, rtol=0, atol=1e-5)
        with torch.no_grad():
            again = evaluate_step(base, rollout, j)
        assert torch.equal(again.log_prob_B, rollout.samples.log_probs_BW[:, j])


def test_builder_is_deterministic(tmp_path, tiny_model):
    tiny_dir = tiny_model("flux2_klein")
    again = build_tiny(tmp_path / "again", seed=0)
    other = build_tiny(tmp_path / "other", seed=1)
    files = sorted(p.relative_to(tiny_dir) for p in tiny_dir.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (tiny_dir / rel).read_bytes() == (again / rel).read_bytes(), rel
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert (tiny_dir / weights).read_bytes() != (other / weights).read_bytes()
