"""HunyuanVideo-1.5 adapter against diffusers' own HunyuanVideo15Pipeline, on the tiny random model."""

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
from diffrl.models.hunyuan_video15 import BYT5_TOKENS, MLLM_TOKENS, HunyuanVideo15Adapter
from diffrl.models.hunyuan_video15_tiny import _system_message, build_tiny
from diffrl.rollout import TrajectorySampler
from diffrl.transition import evaluate_step

# The second quotes text: its glyph goes through ByT5 (the first's ByT5 table is zeros, masked).
PROMPTS = ["a red circle left of a blue square", 'a sign that says "hello"']
H = W = 32
FRAMES = 5  # 2 latent frames of 2x2
MAX_LEN = MLLM_TOKENS  # the pipeline's text length: the transformer sees the same sequence
SHORT = 64  # where no pipeline is compared: the masked padding only costs time


@pytest.fixture(scope="module")
def tiny_dir(tiny_model) -> Path:
    return tiny_model("hunyuan_video15")  # built once per session (tests/conftest.py)


@pytest.fixture(scope="module")
def adapter(tiny_dir) -> HunyuanVideo15Adapter:
    return load_model(tiny_dir, dtype="float32")


@pytest.fixture(scope="module")
def cond(adapter):
    return adapter.encode_prompts(PROMPTS, ["", ""], MAX_LEN)


@pytest.fixture(scope="module")
def short_cond(adapter):
    return adapter.encode_prompts(PROMPTS, ["", ""], SHORT)


def _noise(adapter, seeds=(0, 1)):
    return adapter.init_noise([torch.Generator().manual_seed(s) for s in seeds], H, W, FRAMES)


def _ode(adapter, noise, cond, guidance_scale, num_steps):
    schedule = adapter.schedule(num_steps, H, W, FRAMES)
    x = noise
    for k in range(num_steps):
        with torch.no_grad():
            t = schedule.timesteps[k].expand(x.shape[0])
            v = adapter.velocity(x, t, cond, guidance_scale, H, W, FRAMES)
        x = sde.step("ode", x, v, schedule.sigmas[k], schedule.sigmas[k + 1], 0.0).next_latents
    return x


def test_loads_through_registry_and_declares_its_facts(tiny_dir, adapter):
    assert type(adapter) is HunyuanVideo15Adapter
    assert json.loads((tiny_dir / "model_index.json").read_text())["_class_name"] == "HunyuanVideo15Pipeline"
    pipe = adapter.pipe
    assert type(pipe.text_encoder).__name__ == "Qwen2_5_VLTextModel"
    assert (
        type(pipe.tokenizer_2).__name__ == "ByT5Tokenizer"
        and type(pipe.guider).__name__ == "ClassifierFreeGuidance"
    )
    # the tiny tokenizer splits the system part of the template into the 108 tokens the pipeline crops
    assert pipe.system_message == _system_message()
    text = pipe.tokenizer.apply_chat_template(
        [{"role": "system", "content": pipe.system_message}, {"role": "user", "content": "a cat"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text.endswith("<|im_end|>\n<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n")
    prefix = text.split("a cat")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 108
    blocks = [m for m in adapter.transformer.modules() if type(m).__name__ in adapter.block_class_names]
    assert len(blocks) == 2
    names = [n for n, m in adapter.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in adapter.default_lora_target_modules:  # peft's suffix match
        assert any(n.endswith("." + target) for n in names), target
    assert (adapter.scheduler_config.shift, adapter.scheduler_config.use_dynamic_shifting) == (5.0, False)
    assert sum(f.stat().st_size for f in tiny_dir.rglob("*") if f.is_file()) < 25e6
    # [C, T', H/16, W/16], patch 1: every latent position is a token
    assert adapter.latent_shape(64, 32, 9) == (4, 3, 4, 2) and adapter.image_seq_len(64, 32, 9) == 24
    with pytest.raises(ValueError, match="multiples of 16"):
        adapter.latent_shape(40, 32, 5)
    with pytest.raises(ValueError, match="num_frames"):
        adapter.latent_shape(32, 32, 4)
    # the guider's rule: CFG unless the scale is 1
    assert adapter.wants_negative(6.0) and not adapter.wants_negative(1.0)
    # the schedule is the pipeline's (its own sigmas through the scheduler, static shift 5)
    reference = adapter.guided_pipeline(6.0)
    import numpy as np
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import retrieve_timesteps

    timesteps, _ = retrieve_timesteps(reference.scheduler, 7, "cpu", sigmas=np.linspace(1.0, 0.0, 8)[:-1])
    assert torch.equal(adapter.schedule(7, H, W, FRAMES).timesteps, timesteps.float())


def test_encode_prompts_equals_pipeline(adapter, cond):
    with torch.no_grad():
        mllm, mllm_mask, byt5, byt5_mask = adapter.pipe.encode_prompt(list(PROMPTS), batch_size=2)
    assert cond.embeds.shape == (2, MAX_LEN + BYT5_TOKENS, 32) and cond.has_negative
    assert torch.equal(cond.embeds[:, :MAX_LEN], mllm) and torch.equal(
        cond.mask[:, :MAX_LEN], mllm_mask.long()
    )
    assert torch.equal(cond.embeds[:, MAX_LEN:, :16], byt5) and not cond.embeds[:, MAX_LEN:, 16:].any()
    assert torch.equal(cond.mask[:, MAX_LEN:], byt5_mask.long())
    assert byt5_mask[0].sum() == 0 and byt5_mask[1].sum() > 0  # only the quoting prompt has glyph text
    assert not cond.negative_mask[:, MAX_LEN:].any()  # "" quotes nothing
    short = adapter.encode_prompts(PROMPTS, None, SHORT)
    assert short.embeds.shape[1] == SHORT + BYT5_TOKENS and not short.has_negative
    assert torch.equal(short.embeds[:, :SHORT], cond.embeds[:, :SHORT])
    assert torch.equal(short.embeds[:, SHORT:], cond.embeds[:, MAX_LEN:])
    with pytest.raises(ValueError, match="max_sequence_length"):
        adapter.encode_prompts(PROMPTS, None, 1001)


@pytest.mark.parametrize(("guidance_scale", "steps"), [(1.0, 2), (6.0, 1)], ids=["no_cfg", "cfg"])
def test_ode_matches_pipeline(adapter, cond, guidance_scale, steps):
    """Our ODE loop over adapter.schedule == HunyuanVideo15Pipeline(output_type="latent") from the
    same noise, its guider set to the scale; and init_noise is the pipeline's draw. (Two steps
    show the shift; one step with CFG keeps the pipeline's two forwards per step cheap.)"""
    cfg_on = guidance_scale != 1.0
    noise = _noise(adapter)
    ours = _ode(adapter, noise, cond, guidance_scale, steps)
    call = adapter.pipeline_call(
        PROMPTS,
        ["", ""] if cfg_on else None,
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        true_cfg_scale=None,
        height=H,
        width=W,
        num_frames=FRAMES,
        max_sequence_length=MAX_LEN,
    )
    gens = [torch.Generator().manual_seed(s) for s in (0, 1)]
    pipe = adapter.guided_pipeline(call.pop("guidance_scale"))
    ref = pipe(generator=gens, output_type="latent", **call).frames
    assert ours.dtype == torch.float32 and ours.shape == ref.shape == (2, 4, 2, 2, 2)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert (ours - noise).abs().max() > 0.1
    if cfg_on:  # CFG matters, so the match can tell a wrong combination from a right one
        assert (_ode(adapter, noise, cond, 1.0, steps) - ours).abs().max() > 1e-2


def test_decode_equals_pipeline(adapter):
    noise = _noise(adapter, seeds=(3,))
    pipe = adapter.guided_pipeline(1.0)
    kwargs = dict(prompt=[PROMPTS[0]], height=H, width=W, num_frames=FRAMES, num_inference_steps=1)
    latents = pipe(latents=noise.clone(), output_type="latent", **kwargs).frames
    video = pipe(latents=noise.clone(), output_type="pt", **kwargs).frames  # [B, T, 3, H, W] in [0, 1]
    pixels = adapter.decode(latents, H, W, FRAMES)
    assert pixels.dtype == torch.uint8 and pixels.shape == (1, FRAMES, 3, H, W)
    assert torch.equal(pixels, (video * 255).round().to(torch.uint8))
    assert pixels.float().std() > 1


def test_flops_match_flop_counter(adapter):
    """The analytic count equals torch's FlopCounterMode on the real forward (SDPA's math backend,
    whose matmuls the counter sees), CFG rows and a non-square size included."""
    length, height, width = 40, 64, 32
    text = adapter.encode_prompts(PROMPTS, ["", ""], length)
    noise = adapter.init_noise([torch.Generator().manual_seed(s) for s in (0, 1)], height, width, FRAMES)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        adapter.velocity(noise, torch.full((2,), 700.0), text, 6.0, height, width, FRAMES)
    expected = adapter.flops_per_forward(4, height, width, length, FRAMES)
    assert expected == pytest.approx(counter.get_total_flops(), rel=1e-9)


def test_velocity_one_batched_forward_and_differentiable(adapter, short_cond):
    cond = short_cond
    rows: list[int] = []
    handle = adapter.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(len(kwargs["hidden_states"])), with_kwargs=True
    )
    try:
        noise = _noise(adapter)
        latents = noise.clone().requires_grad_(True)
        v = adapter.velocity(latents, torch.tensor([900.0, 400.0]), cond, 6.0, H, W, FRAMES)
        assert rows == [4] and v.dtype == torch.float32 and v.shape == noise.shape
        v.square().mean().backward()
        weight = adapter.transformer.transformer_blocks[0].attn.to_q.weight
        assert weight.grad is not None and weight.grad.abs().sum() > 0 and latents.grad is not None
        adapter.transformer.zero_grad(set_to_none=True)
    finally:
        handle.remove()
    with pytest.raises(ValueError, match=r"HunyuanVideo-1\.5 latent layout"):
        adapter.velocity(noise[:, :2], 500.0, cond, 1.0, H, W, FRAMES)
    with pytest.raises(ValueError, match="true_cfg_scale"):
        adapter.velocity(noise, 500.0, cond, 1.0, H, W, FRAMES, true_cfg_scale=4.0)


def test_sde_log_probs_are_the_step_math(adapter):
    """An SDE rollout's log-probs: the family-independent `sde.step` on the adapter's velocity at the
    stored latents, a Gaussian density computed here, and the trainer's `evaluate_step`; the
    validation sampler (ODE) is the pipeline's loop from the same keyed noise."""
    cfg = RolloutConfig(
        n=1,
        micro_batch_size=2,
        pipeline=PipelineConfig(
            height=H,
            width=W,
            num_frames=FRAMES,
            num_inference_steps=2,
            guidance_scale=6.0,
            max_sequence_length=SHORT,
        ),
        sde=SdeConfig(type="sde", noise_level=0.7, window_size=1, window_range=[0, 1]),
        val=ValidationConfig(n=1, seed=3),
    )
    sampler = TrajectorySampler(adapter, cfg, progress=False)
    rollout = sampler.sample(PROMPTS, seed=1, step=0)
    assert len(rollout) == 2 and rollout.window_size == 1
    sigma_1 = adapter.schedule(2, H, W, FRAMES).sigma_1
    cond = rollout.sample_cond()
    assert cond.has_negative
    x, x_next = rollout.samples.window_latents[:, 0], rollout.samples.window_latents[:, 1]
    with torch.no_grad():
        v = adapter.velocity(x, rollout.timesteps[0].expand(2), cond, 6.0, H, W, FRAMES)
    out = sde.step(
        "sde", x, v, rollout.sigmas[0], rollout.sigmas[1], 0.7, sigma_1=sigma_1, next_latents=x_next
    )
    assert torch.equal(out.log_prob_B, rollout.samples.log_probs_BW[:, 0])
    std = out.std_B.view(-1, 1, 1, 1, 1).expand_as(x)
    gaussian = torch.distributions.Normal(out.mean, std).log_prob(x_next).mean(dim=(1, 2, 3, 4))
    torch.testing.assert_close(gaussian, out.log_prob_B, rtol=0, atol=1e-5)
    with torch.no_grad():
        again = evaluate_step(adapter, rollout, 0)
    assert torch.equal(again.log_prob_B, rollout.samples.log_probs_BW[:, 0])
    assert rollout.samples.pixels.shape == (2, FRAMES, 3, H, W)


def test_builder_is_deterministic(tmp_path, tiny_dir):
    again = build_tiny(tmp_path / "again", seed=0)
    files = sorted(p.relative_to(tiny_dir) for p in tiny_dir.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (tiny_dir / rel).read_bytes() == (again / rel).read_bytes(), rel
