"""Qwen-Image 2.1 adapter against diffusers' own QwenImage21Pipeline, on the tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen3VLProcessor

from diffrl import sde
from diffrl.config.schema import PipelineConfig, RolloutConfig, SdeConfig, ValidationConfig
from diffrl.models import load_model
from diffrl.models.qwen_image21 import Qwen3VLTextProcessor, QwenImage21Adapter
from diffrl.models.qwen_image21_tiny import build_tiny
from diffrl.rollout import TrajectorySampler
from diffrl.transition import evaluate_step

# Different lengths on purpose: each row runs at its own text length.
PROMPTS = ["a red circle", "two small green triangles on a white background and a star"]
NEGATIVES = ["blurry", ""]
H = W = 32
MAX_LEN = 128


@pytest.fixture(scope="module")
def tiny_dir(tiny_model) -> Path:
    return tiny_model("qwen_image21")  # built once per session (tests/conftest.py)


@pytest.fixture(scope="module")
def adapter(tiny_dir) -> QwenImage21Adapter:
    return load_model(tiny_dir, dtype="float32")


def _noise(adapter, seeds=(0, 1), height=H, width=W):
    return adapter.init_noise([torch.Generator().manual_seed(s) for s in seeds], height, width)


def _ode(adapter, noise, cond, true_cfg_scale, num_steps):
    schedule = adapter.schedule(num_steps, H, W)
    x = noise
    for k in range(num_steps):
        with torch.no_grad():
            v = adapter.velocity(
                x, schedule.timesteps[k].expand(x.shape[0]), cond, 0.0, H, W, true_cfg_scale=true_cfg_scale
            )
        x = sde.step("ode", x, v, schedule.sigmas[k], schedule.sigmas[k + 1], 0.0).next_latents
    return x


def _call(adapter, negatives, true_cfg_scale, steps):
    return adapter.pipeline_call(
        PROMPTS,
        negatives,
        num_inference_steps=steps,
        guidance_scale=0.0,
        true_cfg_scale=true_cfg_scale,
        height=H,
        width=W,
        num_frames=1,
        max_sequence_length=MAX_LEN,
    )


def test_loads_through_registry(tiny_dir, adapter):
    assert type(adapter) is QwenImage21Adapter
    index = json.loads((tiny_dir / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImage21Pipeline"
    assert index["processor"] == ["transformers", "Qwen3VLProcessor"]  # the real processor's files
    assert {"processor_config.json", "chat_template.jinja", "tokenizer.json"} <= {
        p.name for p in (tiny_dir / "processor").iterdir()
    }
    assert type(adapter.pipe.text_encoder).__name__ == "Qwen3VLForConditionalGeneration"
    from transformers.utils import is_torchvision_available

    # the processor's text side where torchvision is missing, transformers' own class otherwise
    processor_class = "Qwen3VLProcessor" if is_torchvision_available() else "Qwen3VLTextProcessor"
    assert type(adapter.pipe.processor).__name__ == processor_class
    assert isinstance(adapter.pipe.processor, Qwen3VLProcessor)
    # the pipeline measured its system prefix with the processor's own chat template
    system = "<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n"
    assert adapter.pipe._drop_idx == len(adapter.pipe.processor.tokenizer(system).input_ids)
    blocks = [m for m in adapter.transformer.modules() if type(m).__name__ in adapter.block_class_names]
    assert len(blocks) == 2
    names = [n for n, m in adapter.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in adapter.default_lora_target_modules:  # peft's suffix match, in every block
        assert sum(n.endswith("." + target) for n in names) == 2, target
    assert sum(f.stat().st_size for f in tiny_dir.rglob("*") if f.is_file()) < 3e6
    # latents [(H/16)·(W/16), 64], unpatched
    assert adapter.latent_shape(64, 32) == (8, 64) and adapter.image_seq_len(64, 32) == 8
    with pytest.raises(ValueError, match="multiples of 32"):
        adapter.latent_shape(48, 32)
    with pytest.raises(ValueError, match="num_frames"):
        adapter.latent_shape(32, 32, num_frames=2)
    assert not adapter.wants_negative(4.0) and not adapter.wants_negative(0.0, 1.0)
    assert adapter.wants_negative(0.0, 4.0)


def test_encode_prompts_equals_pipeline(adapter):
    cond = adapter.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN)
    refs = []
    with torch.no_grad():
        for text in PROMPTS + NEGATIVES:
            embeds, mask, image_pad = adapter.pipe.encode_prompt(prompt=[text])
            assert mask is None and not image_pad.any()
            refs.append(embeds[0])
    length = max(len(r) for r in refs)
    assert len({len(r) for r in refs}) == 3  # "blurry" and "a red circle" happen to share one
    assert cond.embeds.shape == cond.negative_embeds.shape == (2, length, 32)
    rows = [
        *zip(cond.embeds, cond.mask, strict=True),
        *zip(cond.negative_embeds, cond.negative_mask, strict=True),
    ]
    for (embeds, mask), ref in zip(rows, refs, strict=True):
        assert torch.equal(embeds[: len(ref)], ref) and mask[: len(ref)].all()
        assert not embeds[len(ref) :].any() and not mask[len(ref) :].any()
    # one prompt's encoding does not depend on the others of its call
    alone = adapter.encode_prompts(PROMPTS[:1], None, MAX_LEN)
    assert torch.equal(alone.embeds[0], cond.embeds[0, : alone.embeds.shape[1]])
    with pytest.raises(ValueError, match="does not truncate"):
        adapter.encode_prompts(PROMPTS, None, 16)
    with pytest.raises(ValueError, match="max_sequence_length"):
        adapter.encode_prompts(PROMPTS, None, 4096)
    with pytest.raises(ValueError, match="one per prompt"):
        adapter.encode_prompts(PROMPTS, NEGATIVES[:1], MAX_LEN)


@pytest.mark.parametrize("true_cfg_scale", [None, 4.0], ids=["no_cfg", "true_cfg"])
def test_ode_matches_pipeline(adapter, true_cfg_scale):
    """Our ODE loop over adapter.schedule == QwenImage21Pipeline(output_type="latent") from the same
    noise, each prompt its own pipeline call (unpadded): bitwise where each of our forwards holds
    one row, as the pipeline's; with CFG two rows share a length, and a batch of two rounds
    differently on this CPU (2e-7)."""
    steps, cfg_on = 3, true_cfg_scale is not None
    negatives = NEGATIVES if cfg_on else None
    noise = _noise(adapter)
    cond = adapter.encode_prompts(PROMPTS, negatives, MAX_LEN)
    ours = _ode(adapter, noise, cond, true_cfg_scale, steps)
    ref = adapter.pipeline_latents(noise.clone(), _call(adapter, negatives, true_cfg_scale, steps))
    assert ours.dtype == torch.float32 and ours.shape == ref.shape == (2, 4, 64)
    if cfg_on:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        # CFG matters, so the match above can tell a wrong combination from a right one
        assert (_ode(adapter, noise, cond, None, steps) - ours).abs().max() > 1e-2
    else:
        assert torch.equal(ours, ref)
    assert (ours - noise).abs().max() > 0.1
    # init_noise draws what the pipeline draws from the same generator
    call = _call(adapter, negatives, true_cfg_scale, steps)
    call.update(prompt=PROMPTS[:1], negative_prompt=negatives[:1] if cfg_on else None)
    gens = [torch.Generator().manual_seed(0)]
    theirs = adapter.pipe(**call, generator=gens, output_type="latent").images
    assert torch.equal(theirs, ref[:1])


def test_a_row_runs_at_its_own_length(adapter):
    """A row's velocity does not depend on the table's padding or the other rows' lengths (the
    transformer's RoPE places the image after all text tokens, so padding would move it), and the
    rows of a length share one forward."""
    calls: list[tuple[int, int]] = []
    handle = adapter.transformer.register_forward_pre_hook(
        lambda m, a, kw: calls.append(tuple(kw["encoder_hidden_states"].shape[:2])), with_kwargs=True
    )
    try:
        both = adapter.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN)
        alone = adapter.encode_prompts(PROMPTS[:1], NEGATIVES[:1], MAX_LEN)
        noise = _noise(adapter)
        latents = noise.clone().requires_grad_(True)
        v = adapter.velocity(latents, torch.tensor([900.0, 400.0]), both, 0.0, H, W, true_cfg_scale=4.0)
        lengths = both.mask.sum(1).tolist() + both.negative_mask.sum(1).tolist()
        assert sorted(calls) == sorted((lengths.count(n), n) for n in set(lengths))
        v.square().mean().backward()
        weight = adapter.transformer.transformer_blocks[0].attn.to_q.weight
        assert weight.grad is not None and weight.grad.abs().sum() > 0 and latents.grad is not None
        adapter.transformer.zero_grad(set_to_none=True)
        with torch.no_grad():
            # the second row alone (no other row of its length), from a table padded for others
            v1 = adapter.velocity(noise[1:], torch.tensor([400.0]), both[1:], 0.0, H, W)
            short = adapter.velocity(noise[:1], torch.tensor([900.0]), alone, 0.0, H, W)
            padded = adapter.velocity(noise[:1], torch.tensor([900.0]), both[:1], 0.0, H, W)
        assert torch.equal(short, padded) and both.embeds.shape[1] > alone.embeds.shape[1]
        assert v1.shape == (1, 4, 64)
        # why: the transformer itself, given the padded row with its mask, computes another velocity
        real, padded_len = int(both.mask[0].sum()), both.embeds.shape[1]

        def forward(length, mask):
            img_mask = torch.zeros(1, length + 1, dtype=torch.bool)
            img_mask[:, length:] = True  # one slot: the 2x2 latent tokens of a 32x32 image
            with torch.no_grad():
                return adapter.transformer(
                    hidden_states=noise[:1],
                    timestep=torch.tensor([0.9]),
                    encoder_hidden_states=both.embeds[:1, :length],
                    encoder_hidden_states_mask=mask,
                    img_shapes=[[(1, 2, 2)]],
                    img_mask=img_mask,
                    return_dict=False,
                )[0][:, -4:]

        assert torch.equal(forward(real, None), short)
        assert (forward(padded_len, both.mask[:1].bool()) - short).abs().max() > 1e-3
    finally:
        handle.remove()
    with pytest.raises(ValueError, match=r"Qwen-Image 2\.1 latent layout"):
        adapter.velocity(noise[:, :2], 500.0, both, 0.0, H, W)


def test_schedule_equals_pipeline(adapter):
    """The pipeline's timesteps for the linspace fallback and for a checkpoint's `sample_sigmas`
    (the Turbo checkpoint's shipped grid) of the step count's length."""
    timesteps: list[float] = []
    handle = adapter.transformer.register_forward_pre_hook(
        lambda m, a, kw: timesteps.append(float(kw["timestep"][0]) * 1000), with_kwargs=True
    )
    noise = _noise(adapter, seeds=(0,))
    try:
        for grid in (None, [1.0, 0.8, 0.45, 0.2]):
            adapter.pipe.register_to_config(sample_sigmas=grid)
            timesteps.clear()
            adapter.pipe(
                prompt=PROMPTS[:1],
                latents=noise,
                height=H,
                width=W,
                num_inference_steps=4,
                output_type="latent",
                use_kv_cache=False,
            )
            ours = adapter.schedule(4, H, W)
            torch.testing.assert_close(torch.tensor(timesteps), ours.timesteps, rtol=1e-6, atol=1e-4)
            assert ours.sigmas[-1] == 0 and len(ours.sigmas) == 5
        assert adapter.schedule(3, H, W).num_steps == 3  # another step count: linspace
    finally:
        adapter.pipe.register_to_config(sample_sigmas=None)
        handle.remove()


def test_decode_equals_pipeline(adapter):
    noise = _noise(adapter, seeds=(3, 4))
    call = dict(_call(adapter, None, None, 2), prompt=PROMPTS[:1])
    latents = adapter.pipe(latents=noise[:1].clone(), output_type="latent", **call).images
    images = adapter.pipe(latents=noise[:1].clone(), output_type="np", **call).images
    pixels = adapter.decode(latents, H, W)
    assert pixels.dtype == torch.uint8 and pixels.shape == (1, 3, H, W) and images.shape == (1, H, W, 4)
    rgb = torch.from_numpy((images[..., :3] * 255).round().astype(np.uint8)).permute(0, 3, 1, 2)
    assert torch.equal(pixels, rgb)
    assert pixels.float().std() > 1  # not a constant image


@pytest.mark.parametrize(("height", "width", "cfg"), [(32, 32, False), (64, 32, True)])
def test_flops_match_flop_counter(adapter, height, width, cfg):
    """The analytic count equals torch's FlopCounterMode on the real forward (SDPA's math backend,
    whose matmuls the counter sees): one forward per text length among the rows."""
    cond = adapter.encode_prompts(PROMPTS, NEGATIVES if cfg else None, MAX_LEN)
    lengths = cond.mask.sum(1).tolist() + (cond.negative_mask.sum(1).tolist() if cfg else [])
    noise = _noise(adapter, height=height, width=width)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        adapter.velocity(
            noise, torch.full((2,), 700.0), cond, 0.0, height, width, true_cfg_scale=4.0 if cfg else None
        )
    expected = sum(adapter.flops_per_forward(lengths.count(n), height, width, n) for n in set(lengths))
    assert len(set(lengths)) > 1
    assert expected == pytest.approx(counter.get_total_flops(), rel=1e-9)


def test_sde_log_probs_are_the_step_math(adapter):
    """An SDE rollout's log-probs: the family-independent `sde.step` on the adapter's velocity at the
    stored latents, a Gaussian density computed here, and the trainer's `evaluate_step`."""
    cfg = RolloutConfig(
        n=2,
        micro_batch_size=4,
        pipeline=PipelineConfig(
            height=H,
            width=W,
            num_inference_steps=4,
            guidance_scale=0.0,
            true_cfg_scale=4.0,
            max_sequence_length=MAX_LEN,
        ),
        sde=SdeConfig(type="sde", noise_level=0.7, window_size=2, window_range=[0, 3]),
        val=ValidationConfig(n=1, seed=3),
    )
    rollout = TrajectorySampler(adapter, cfg, progress=False).sample(PROMPTS, seed=1, step=0)
    assert len(rollout) == 4 and rollout.window_size == 2
    sigma_1 = adapter.schedule(4, H, W).sigma_1
    cond = rollout.sample_cond()
    assert cond.has_negative  # true CFG on: both halves train
    for j in range(2):
        x, x_next = rollout.samples.window_latents[:, j], rollout.samples.window_latents[:, j + 1]
        with torch.no_grad():
            v = adapter.velocity(x, rollout.timesteps[j].expand(4), cond, 0.0, H, W, true_cfg_scale=4.0)
        out = sde.step(
            "sde", x, v, rollout.sigmas[j], rollout.sigmas[j + 1], 0.7, sigma_1=sigma_1, next_latents=x_next
        )
        assert torch.equal(out.log_prob_B, rollout.samples.log_probs_BW[:, j])
        std = out.std_B.view(-1, 1, 1).expand_as(x)
        gaussian = torch.distributions.Normal(out.mean, std).log_prob(x_next).mean(dim=(1, 2))
        torch.testing.assert_close(gaussian, out.log_prob_B, rtol=0, atol=1e-5)
        with torch.no_grad():
            again = evaluate_step(adapter, rollout, j)
        assert torch.equal(again.log_prob_B, rollout.samples.log_probs_BW[:, j])


def test_the_text_processor_saves_the_folder_it_loaded(tiny_dir, tmp_path):
    """A full fine-tuning run exports the whole pipeline: the text-only processor writes the files
    it was loaded from (image and video processor configs included) and loads back the same."""
    processor = Qwen3VLTextProcessor.from_folder(tiny_dir / "processor")
    processor.save_pretrained(tmp_path / "processor")
    names = {p.name for p in (tmp_path / "processor").iterdir()}
    assert names == {p.name for p in (tiny_dir / "processor").iterdir()}
    again = Qwen3VLTextProcessor.from_folder(tmp_path / "processor")
    text = ["<|im_start|>user\na red circle<|im_end|>\n", "a cat"]
    kwargs = dict(padding=True, padding_side="left", return_tensors="pt")
    assert all(
        torch.equal(v, again(text=text, **kwargs)[k]) for k, v in processor(text=text, **kwargs).items()
    )
    assert again.chat_template == processor.chat_template


def test_builder_is_deterministic(tmp_path, tiny_dir):
    again = build_tiny(tmp_path / "again", seed=0)
    files = sorted(p.relative_to(tiny_dir) for p in tiny_dir.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (tiny_dir / rel).read_bytes() == (again / rel).read_bytes(), rel
