"""FLUX.2 [dev] adapter against diffusers' own Flux2Pipeline, on a tiny random FLUX.2 [dev]
(Mistral-3 text encoder behind a Pixtral processor, a transformer with the guidance embedding)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from diffrl import sde
from diffrl.models import load_model
from diffrl.models.flux2_dev import Flux2DevAdapter, build_tiny

PROMPTS = ["a red circle left of a blue square", "two small green triangles on a white background"]
H, W = 32, 64  # non-square: catches h/w swaps in the ids and the unpacking
MAX_LEN = 48
GUIDANCE = 2.5  # not the pipeline's default 4.0, so the guidance value must reach the embedding


@pytest.fixture(scope="module")
def dev(tiny_model) -> Flux2DevAdapter:
    return load_model(tiny_model("flux2_dev"), dtype="float32")


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


def _call(adapter, guidance_scale, steps):
    return adapter.pipeline_call(
        PROMPTS,
        None,
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        true_cfg_scale=None,
        height=H,
        width=W,
        num_frames=1,
        max_sequence_length=MAX_LEN,
    )


def test_loads_through_registry(tiny_model, dev):
    assert type(dev) is Flux2DevAdapter
    index = json.loads((tiny_model("flux2_dev") / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2Pipeline"
    assert index["tokenizer"] == ["transformers", "PixtralProcessor"]
    assert index["text_encoder"] == ["transformers", "Mistral3ForConditionalGeneration"]
    processor = json.loads((tiny_model("flux2_dev") / "tokenizer" / "processor_config.json").read_text())
    assert processor["processor_class"] == "PixtralProcessor"
    assert dev.transformer.config.guidance_embeds
    text = dev.pipe.tokenizer.apply_chat_template(
        [
            [
                {"role": "system", "content": [{"type": "text", "text": "S"}]},
                {"role": "user", "content": "a cat"},
            ]
        ],
        tokenize=False,
    )
    assert text == ["<s>[SYSTEM_PROMPT]S[/SYSTEM_PROMPT][INST]a cat[/INST]"]
    classes = {type(m).__name__ for m in dev.transformer.modules()}
    assert set(dev.block_class_names) <= classes
    names = [n for n, m in dev.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in dev.default_lora_target_modules:  # peft's suffix match
        assert any(n.endswith("." + target) for n in names), target
    assert sum(f.stat().st_size for f in tiny_model("flux2_dev").rglob("*") if f.is_file()) < 3e6
    assert dev.latent_shape(H, W) == (8, 128) and dev.image_seq_len(H, W) == 8
    with pytest.raises(ValueError, match=r"FLUX\.2 \[dev\] needs height and width.*multiples of 16"):
        dev.latent_shape(40, 32)
    # guidance-distilled: never a CFG pass, whatever the scale
    assert not dev.wants_negative(4.0) and not dev.wants_negative(1.0)
    with pytest.raises(ValueError, match="true_cfg_scale"):
        dev.velocity(
            _noise(dev), 500.0, dev.encode_prompts(PROMPTS, None, MAX_LEN), 4.0, H, W, true_cfg_scale=2.0
        )


def test_a_klein_transformer_is_refused(tiny_model):
    from diffusers import Flux2Transformer2DModel

    dev = load_model(tiny_model("flux2_dev"), dtype="float32")
    klein = Flux2Transformer2DModel.from_pretrained(tiny_model("flux2_klein") / "transformer")
    dev.pipe.register_modules(transformer=klein)
    with pytest.raises(ValueError, match="guidance_embeds=False"):
        Flux2DevAdapter(dev.pipe, dev.device, dev.dtype)


def test_encode_prompts_equals_pipeline(dev):
    cond = dev.encode_prompts(PROMPTS, None, MAX_LEN)
    with torch.no_grad():
        pos, _ = dev.pipe.encode_prompt(list(PROMPTS), max_sequence_length=MAX_LEN)
    assert cond.embeds.shape == (2, MAX_LEN, 48) and cond.mask is None  # 3 Mistral layers of 16
    assert torch.equal(cond.embeds, pos) and not cond.has_negative
    # the layers are (10, 20, 30), not [klein]'s (9, 18, 27)
    with torch.no_grad():
        other, _ = dev.pipe.encode_prompt(
            list(PROMPTS), max_sequence_length=MAX_LEN, text_encoder_out_layers=(9, 18, 27)
        )
    assert not torch.equal(other, pos)
    # the system message comes first and truncation keeps the start: no room for the prompt refused
    prefix = dev.template_tokens()
    assert 10 < prefix < MAX_LEN
    with pytest.raises(ValueError, match="leaves no room for the prompt"):
        dev.encode_prompts(PROMPTS, None, prefix)
    with pytest.raises(ValueError, match="max_sequence_length"):
        dev.encode_prompts(PROMPTS, None, 1024)


def test_schedule_is_the_pipelines(dev):
    for steps in (4, 9):
        ours = dev.schedule(steps, H, W)
        dev.pipe(**_call(dev, GUIDANCE, steps), latents=None, output_type="latent")
        assert torch.equal(ours.timesteps, dev.pipe.scheduler.timesteps.float())
        assert torch.equal(ours.sigmas, dev.pipe.scheduler.sigmas.float())


def test_ode_matches_pipeline(dev):
    """Our ODE loop over adapter.schedule == Flux2Pipeline's latents after its last step, at a
    non-default guidance scale; the scale changes the samples, so the match can tell."""
    steps = 3
    noise = _noise(dev)
    cond = dev.encode_prompts(PROMPTS, None, MAX_LEN)
    ours = _ode(dev, noise, cond, GUIDANCE, steps)
    ref = dev.pipeline_latents(noise.clone(), _call(dev, GUIDANCE, steps))
    assert ours.dtype == torch.float32 and ours.shape == ref.shape == (2, 8, 128)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # output_type="latent" of Flux2Pipeline returns the packed latents themselves: the same
    unpacked = noise.permute(0, 2, 1).reshape(2, 128, H // 16, W // 16)
    direct = dev.pipe(latents=unpacked, output_type="latent", **_call(dev, GUIDANCE, steps)).images
    assert torch.equal(direct, ref)
    assert (ours - noise).abs().max() > 0.1
    assert (_ode(dev, noise, cond, 4.0, steps) - ours).abs().max() > 1e-3
    gens = [torch.Generator().manual_seed(s) for s in (0, 1)]
    drawn, _ = dev.pipe.prepare_latents(2, 32, H, W, torch.float32, "cpu", gens)
    assert torch.equal(drawn, noise)


def test_decode_equals_pipeline(dev):
    noise = _noise(dev, seeds=(3, 4))
    latents = dev.pipeline_latents(noise.clone(), _call(dev, GUIDANCE, 2))
    unpacked = noise.permute(0, 2, 1).reshape(2, 128, H // 16, W // 16)
    images = dev.pipe(latents=unpacked, output_type="pt", **_call(dev, GUIDANCE, 2)).images
    pixels = dev.decode(latents, H, W)
    assert pixels.dtype == torch.uint8 and pixels.shape == (2, 3, H, W)
    assert torch.equal(pixels, (images * 255).round().to(torch.uint8))
    assert pixels.float().std() > 1


def test_flops_match_flop_counter(dev):
    cond = dev.encode_prompts(PROMPTS, None, MAX_LEN)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        dev.velocity(_noise(dev), torch.full((2,), 700.0), cond, GUIDANCE, H, W)
    assert dev.flops_per_forward(2, H, W, MAX_LEN) == pytest.approx(counter.get_total_flops(), rel=1e-9)


def test_velocity_one_forward_with_guidance_and_differentiable(dev):
    cond = dev.encode_prompts(PROMPTS, None, MAX_LEN)
    calls: list[tuple[int, torch.Tensor]] = []
    handle = dev.transformer.register_forward_hook(
        lambda module, args, kwargs, out: calls.append(
            (kwargs["hidden_states"].shape[0], kwargs["guidance"])
        ),
        with_kwargs=True,
    )
    try:
        noise = _noise(dev)
        latents = noise.clone().requires_grad_(True)
        v = dev.velocity(latents, torch.tensor([900.0, 400.0]), cond, GUIDANCE, H, W)
        ((rows, guidance),) = calls
        assert rows == 2 and guidance.dtype == torch.float32 and guidance.tolist() == [GUIDANCE] * 2
        assert v.dtype == torch.float32 and v.shape == noise.shape
        v.square().mean().backward()
        weight = dev.transformer.single_transformer_blocks[0].attn.to_qkv_mlp_proj.weight
        assert weight.grad is not None and weight.grad.abs().sum() > 0 and latents.grad is not None
        assert dev.transformer.time_guidance_embed.guidance_embedder.linear_1.weight.grad.abs().sum() > 0
        dev.transformer.zero_grad(set_to_none=True)
    finally:
        handle.remove()
    with pytest.raises(ValueError, match=r"packed FLUX\.2 layout"):
        dev.velocity(noise[:, :2], 500.0, cond, GUIDANCE, H, W)


def test_builder_is_deterministic(tmp_path, tiny_model):
    tiny_dir = tiny_model("flux2_dev")
    again = build_tiny(tmp_path / "again", seed=0)
    other = build_tiny(tmp_path / "other", seed=1)
    files = sorted(p.relative_to(tiny_dir) for p in tiny_dir.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (tiny_dir / rel).read_bytes() == (again / rel).read_bytes(), rel
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert (tiny_dir / weights).read_bytes() != (other / weights).read_bytes()


def test_sde_log_probs_are_the_step_math(dev):
    """An SDE rollout's log-probs: `sde.step` on the adapter's velocity (guidance embedding on) at
    the stored latents, a Gaussian density computed here, and the trainer's `evaluate_step`, bit
    for bit."""
    from diffrl.config.schema import PipelineConfig, RolloutConfig, SdeConfig, ValidationConfig
    from diffrl.rollout import TrajectorySampler
    from diffrl.transition import evaluate_step

    cfg = RolloutConfig(
        n=2,
        micro_batch_size=4,
        pipeline=PipelineConfig(
            height=H, width=W, num_inference_steps=4, guidance_scale=GUIDANCE, max_sequence_length=MAX_LEN
        ),
        sde=SdeConfig(type="sde", noise_level=0.7, window_size=2, window_range=[0, 3]),
        val=ValidationConfig(n=1, seed=3),
    )
    rollout = TrajectorySampler(dev, cfg, progress=False).sample(PROMPTS, seed=1, step=0)
    sigma_1 = dev.schedule(4, H, W).sigma_1
    cond = rollout.sample_cond()
    assert not cond.has_negative and rollout.window_size == 2
    for j in range(2):
        x, x_next = rollout.samples.window_latents[:, j], rollout.samples.window_latents[:, j + 1]
        with torch.no_grad():
            v = dev.velocity(x, rollout.timesteps[j].expand(4), cond, GUIDANCE, H, W)
        out = sde.step(
            "sde", x, v, rollout.sigmas[j], rollout.sigmas[j + 1], 0.7, sigma_1=sigma_1, next_latents=x_next
        )
        assert torch.equal(out.log_prob_B, rollout.samples.log_probs_BW[:, j])
        std = out.std_B.view(-1, 1, 1).expand_as(x)
        gaussian = torch.distributions.Normal(out.mean, std).log_prob(x_next).mean(dim=(1, 2))
        torch.testing.assert_close(gaussian, out.log_prob_B, rtol=0, atol=1e-5)
        with torch.no_grad():
            again = evaluate_step(dev, rollout, j)
        assert torch.equal(again.log_prob_B, rollout.samples.log_probs_BW[:, j])
