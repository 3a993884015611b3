"""The edit families through the sampler and the trainer: condition images from prompt rows
(`ConditionImage`, as a prompt file gives them) to the rollout's conditioning table, whose condition
latents the trainer's recomputation uses, so that on unchanged weights it reproduces the sampled
log-probs exactly (PPO's ratio is 1); the ODE sampler equals each family's diffusers pipeline."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from edit_images import condition_image

from diffrl.config.schema import (
    ActorConfig,
    LoraConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    PipelineConfig,
    RolloutConfig,
    SdeConfig,
    ValidationConfig,
)
from diffrl.data.images import read_condition_image
from diffrl.models import load_model
from diffrl.rollout import TrajectorySampler
from diffrl.seeding import NOISE_STREAM, generator
from diffrl.train.batch import PolicyGradientBatch, TrainingTargets
from diffrl.train.engine import POLICY, TrainEngine

HEIGHT, WIDTH = 32, 48
PROMPTS = ["make the circle red", "add a blue square"]
# (family, rollout.pipeline settings, images per prompt)
FAMILIES = [
    ("flux_kontext", dict(guidance_scale=2.5, true_cfg_scale=None), 1),
    ("qwen_image_edit", dict(guidance_scale=1.0, true_cfg_scale=4.0), 1),
    ("qwen_image_edit_plus", dict(guidance_scale=1.0, true_cfg_scale=None), 2),
]


@pytest.fixture(scope="module")
def image_files(tmp_path_factory):
    """Condition images as a prompt file holds them: files, read and checked by the data loader."""
    folder = tmp_path_factory.mktemp("edit_images")
    rows = []
    for seed in (1, 2):
        path = folder / f"source_{seed}.png"
        condition_image(seed).save(path)
        rows.append(read_condition_image(path.name, folder, f"row {seed}", "image"))
    return rows


def rollout_cfg(pipeline: dict, n: int = 2) -> RolloutConfig:
    return RolloutConfig(
        n=n,
        micro_batch_size=2,
        pipeline=PipelineConfig(
            height=HEIGHT, width=WIDTH, num_inference_steps=3, max_sequence_length=32, **pipeline
        ),
        sde=SdeConfig(type="sde", noise_level=0.8, window_size=1, window_range=[0, 2]),
        val=ValidationConfig(n=1, seed=3),
    )


def _rows(image_files, per_prompt: int, prompts: int):
    return [tuple(image_files[(i + j) % 2] for j in range(per_prompt)) for i in range(prompts)]


@pytest.mark.parametrize(("family", "pipeline", "per_prompt"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_validation_rollout_matches_the_diffusers_pipeline(
    tiny_model, image_files, family, pipeline, per_prompt
):
    adapter = load_model(tiny_model(family), dtype="float32")
    cfg = rollout_cfg(pipeline)
    rows = _rows(image_files, per_prompt, 1)
    rollout = TrajectorySampler(adapter, cfg, progress=False).sample_validation(PROMPTS[:1], images=rows)
    assert rollout.prompt_embeds.cond_latents is not None
    noise = adapter.init_noise([generator("cpu", NOISE_STREAM, cfg.val.seed, 0, 0)], HEIGHT, WIDTH)
    images = [image.load() for image in rows[0]]
    kwargs = dict(prompt=PROMPTS[:1], num_inference_steps=3, height=HEIGHT, width=WIDTH, output_type="latent")
    if family == "flux_kontext":
        kwargs.update(image=images[0], guidance_scale=2.5, max_area=HEIGHT * WIDTH, max_sequence_length=32)
    elif family == "qwen_image_edit":
        kwargs.update(image=images[0], true_cfg_scale=4.0, negative_prompt=[""])
    else:
        kwargs.update(image=images, true_cfg_scale=1.0)
    expected = adapter.pipe(latents=noise, **kwargs).images
    torch.testing.assert_close(rollout.samples.final_latents, expected, rtol=1e-4, atol=2e-5)
    assert rollout.samples.pixels.shape == (1, 3, HEIGHT, WIDTH)


@pytest.mark.parametrize(("family", "pipeline", "per_prompt"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_the_trainer_recomputes_the_sampled_log_probs_exactly(
    tiny_model, image_files, family, pipeline, per_prompt
):
    """Same weights, same condition latents: the recomputed log-probs are the sampled ones, bit for
    bit (PPO's ratio is exactly 1), and the policy-gradient step sees ratio 1 too."""
    adapter = load_model(tiny_model(family), dtype="float32")
    actor = ActorConfig(
        strategy="none",
        mini_batch_size=2,
        micro_batch_size=2,
        optim=OptimConfig(lr=1e-3, weight_decay=0.0),
        loss=LossConfig(clip_ratio=1e-4),
    )
    engine = TrainEngine(adapter, ModelConfig(lora=LoraConfig(rank=4, alpha=4)), actor, total_optim_steps=2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a non-trivial policy
        for name, p in engine.transformer.named_parameters():
            if f".{POLICY}." in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    sampler = TrajectorySampler(adapter, rollout_cfg(pipeline, n=1), progress=False)
    rows = _rows(image_files, per_prompt, 2)
    rollout = sampler.sample(PROMPTS, seed=0, step=0, images=rows)
    assert rollout.window_size == 1 and len(rollout) == 2
    assert rollout.prompt_embeds.cond_latents.shape[0] == 2  # one row per prompt
    log_probs, means = engine.log_probs(rollout)
    assert torch.equal(log_probs, rollout.samples.log_probs_BW)
    assert torch.equal(means, rollout.samples.means)
    targets = TrainingTargets(advantages_B=torch.tensor([1.0, -1.0]), batch_size=[2])
    metrics = engine.forward_backward([PolicyGradientBatch(rollout, targets)])
    assert metrics["ratio_mean"] == 1.0 and metrics["clipfrac"] == 0.0
    # the condition is part of what was sampled: other images, other log-probs for the same latents
    swapped = rollout.prompt_embeds.clone()
    swapped.cond_latents = swapped.cond_latents.flip(0)
    with torch.no_grad():
        other, _ = engine.log_probs(replace(rollout, prompt_embeds=swapped))
    assert not torch.equal(other, rollout.samples.log_probs_BW)


def test_each_prompt_and_images_pair_is_encoded_once(tiny_model, image_files, monkeypatch):
    adapter = load_model(tiny_model("flux_kontext"), dtype="float32")
    sampler = TrajectorySampler(adapter, rollout_cfg(dict(guidance_scale=2.5)), progress=False)
    seen = []
    encode = adapter.encode_conditioned
    monkeypatch.setattr(
        adapter, "encode_conditioned", lambda p, n, m, images: seen.extend(p) or encode(p, n, m, images)
    )
    a, b = image_files
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[0], PROMPTS[1]]
    table = sampler.encode(prompts, None, images=[(a,), (a,), (b,), (a,)])
    # (prompt 0, a) twice is encoded once; the same prompt with another image is another row
    assert sampler.encode_calls == 3 and seen == [PROMPTS[0], PROMPTS[0], PROMPTS[1]]
    assert torch.equal(table.cond_latents[0], table.cond_latents[1])
    assert not torch.equal(table.cond_latents[1], table.cond_latents[2])
    torch.testing.assert_close(table.cond_latents[3], table.cond_latents[0])
    with pytest.raises(ValueError, match="needs its condition image"):
        sampler.sample(PROMPTS, seed=0, step=0)
