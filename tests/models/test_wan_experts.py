"""Wan2.2 A14B's two experts (`transformer` for high noise, `transformer_2` for low noise, switched
at boundary_ratio · 1000) against diffusers' own `WanPipeline`, on a tiny random model of that
layout; then LoRA over both experts, its export as diffusers loads it, and training runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import WanPipeline
from safetensors.torch import load_file

from diffrl import sde
from diffrl.models import load_model
from diffrl.models.experts import TimestepExperts
from diffrl.models.wan import TINY_BOUNDARY_RATIO, build_tiny_a14b

PROMPTS = ["a red circle left of a blue square", "two small green triangles"]
NEGATIVES = ["blurry", ""]
MAX_LEN, H, W, FRAMES, STEPS = 16, 32, 48, 5, 6


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_a14b(tmp_path_factory.mktemp("wan22") / "tiny", seed=0)


@pytest.fixture(scope="module")
def adapter(tiny_dir):
    return load_model(tiny_dir, dtype="float32")


@pytest.fixture(scope="module")
def pipe(tiny_dir) -> WanPipeline:
    """diffusers' own pipeline on the same directory: the independent reference."""
    pipe = WanPipeline.from_pretrained(str(tiny_dir), dtype=torch.float32, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _noise(adapter):
    return adapter.init_noise([torch.Generator().manual_seed(s) for s in (0, 1)], H, W, FRAMES)


def _ode(adapter, noise, cond, guidance_scale):
    schedule = adapter.schedule(STEPS, H, W, FRAMES)
    x = noise
    for k in range(STEPS):
        v = adapter.velocity(x, schedule.timesteps[k].expand(x.shape[0]), cond, guidance_scale, H, W, FRAMES)
        x = sde.step("ode", x, v, schedule.sigmas[k], schedule.sigmas[k + 1], 0.0).next_latents
    return x


def _timesteps_per_expert(pipe):
    """A forward hook on each expert: the timesteps it was called with, in order."""
    seen = {"transformer": [], "transformer_2": []}
    handles = [
        getattr(pipe, name).register_forward_pre_hook(
            lambda mod, args, kwargs, name=name: seen[name].append(float(kwargs["timestep"].flatten()[0])),
            with_kwargs=True,
        )
        for name in seen
    ]
    return seen, handles


def _pipe_latents(pipe, noise, guidance_scale):
    return pipe(
        prompt=PROMPTS,
        negative_prompt=NEGATIVES,
        latents=noise.clone(),
        num_inference_steps=STEPS,
        guidance_scale=guidance_scale,
        height=H,
        width=W,
        num_frames=FRAMES,
        max_sequence_length=MAX_LEN,
        output_type="latent",
    ).frames


def test_the_adapter_trains_both_experts_as_one_module(adapter, pipe):
    experts = adapter.transformer
    assert isinstance(experts, TimestepExperts) and experts.boundaries == [TINY_BOUNDARY_RATIO * 1000]
    assert (
        experts.transformer is adapter.pipe.transformer
        and experts.transformer_2 is adapter.pipe.transformer_2
    )
    keys = {k.split(".", 1)[0] for k in experts.state_dict()}
    assert keys == {"transformer", "transformer_2"}
    own = sum(p.numel() for p in pipe.transformer.parameters()) + sum(
        p.numel() for p in pipe.transformer_2.parameters()
    )
    assert sum(p.numel() for p in experts.parameters()) == own


@pytest.mark.parametrize("guidance_scale", [4.0, 1.0])
def test_ode_sampling_equals_the_pipeline_switching_experts_at_the_boundary(adapter, pipe, guidance_scale):
    """Our loop == WanPipeline's latents, and each step ran on the expert the pipeline chose."""
    noise = _noise(adapter)
    cond = adapter.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN)
    ours_seen, handles = _timesteps_per_expert(adapter.pipe)
    try:
        ours = _ode(adapter, noise, cond, guidance_scale)
    finally:
        for handle in handles:
            handle.remove()
    theirs_seen, handles = _timesteps_per_expert(pipe)
    try:
        theirs = _pipe_latents(pipe, noise, guidance_scale)
    finally:
        for handle in handles:
            handle.remove()
    assert ours_seen["transformer"] and ours_seen["transformer_2"], ours_seen  # both experts ran
    # the pipeline runs CFG as two forwards (cond, uncond), diffrl as one of 2B: each step once here
    per_step = 2 if guidance_scale > 1 else 1
    assert {k: v[::per_step] for k, v in theirs_seen.items()} == ours_seen
    assert all(t >= 875 for t in ours_seen["transformer"]) and all(
        t < 875 for t in ours_seen["transformer_2"]
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_mixed_batch_runs_each_sample_on_its_expert_and_trains_only_that_one(adapter):
    """A batch mixing noise levels (the forward-process losses draw t per sample): each sample's
    velocity is its own expert's, and a loss on a high-noise sample reaches only the high-noise expert."""
    cond = adapter.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN)
    x = _noise(adapter)
    t = torch.tensor([950.0, 300.0])
    mixed = adapter.velocity(x, t, cond, 4.0, H, W, FRAMES)
    for i in range(2):
        alone = adapter.velocity(x[i : i + 1], t[i : i + 1], cond[i : i + 1], 4.0, H, W, FRAMES)
        torch.testing.assert_close(mixed[i : i + 1], alone, rtol=1e-5, atol=1e-5)
    experts = adapter.transformer
    experts.zero_grad(set_to_none=True)
    adapter.velocity(x, t, cond, 4.0, H, W, FRAMES)[0].pow(2).mean().backward()
    high = [p.grad for p in experts.transformer.parameters()]
    low = [p.grad for p in experts.transformer_2.parameters()]
    assert any(g is not None and g.abs().sum() > 0 for g in high)
    assert all(g is None or g.abs().sum() == 0 for g in low)
    experts.zero_grad(set_to_none=True)


def test_lora_spans_both_experts_and_the_export_is_what_diffusers_loads(tiny_dir, tmp_path):
    """One adapter over both experts; the export is one diffusers file per expert, which plain
    diffusers loads (`load_lora_weights`, the second with `load_into_transformer_2=True`) into a
    pipeline that then samples what diffrl samples with the adapter. `diffrl sample --lora`'s
    loader binds both the same way."""
    from diffrl.config.sections.model import LoraConfig
    from diffrl.rollout.generate import load_lora
    from diffrl.train.export import export_lora
    from diffrl.train.lora import inject_lora

    trained = load_model(tiny_dir, dtype="float32")
    inject_lora(trained, LoraConfig(rank=2, alpha=4), ["default"], seed=0)
    names = [n for n, p in trained.transformer.named_parameters() if p.requires_grad]
    assert {n.split(".", 1)[0] for n in names} == {"transformer", "transformer_2"}
    with torch.no_grad():  # B = 0 would make an unbound module invisible
        for name, param in trained.transformer.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.3)
    out = export_lora(trained.transformer, tmp_path / "lora", pipeline_class=WanPipeline)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == ["pytorch_lora_weights.safetensors", "pytorch_lora_weights_transformer_2.safetensors"]
    for file in files:  # each file in diffusers' own key form, `transformer.` for either expert
        keys = load_file(out / file)
        assert keys and all(k.startswith("transformer.blocks.") for k in keys), sorted(keys)[:3]

    fresh = WanPipeline.from_pretrained(str(tiny_dir), dtype=torch.float32, local_files_only=True)
    fresh.set_progress_bar_config(disable=True)
    fresh.load_lora_weights(str(out), adapter_name="default")
    fresh.load_lora_weights(
        str(out),
        weight_name="pytorch_lora_weights_transformer_2.safetensors",
        adapter_name="default",
        load_into_transformer_2=True,
    )
    noise = _noise(trained)
    cond = trained.encode_prompts(PROMPTS, NEGATIVES, MAX_LEN)
    with torch.no_grad():
        ours = _ode(trained, noise, cond, 4.0)
        base = _ode(load_model(tiny_dir, dtype="float32"), noise, cond, 4.0)
    theirs = _pipe_latents(fresh, noise, 4.0)
    assert (ours - base).abs().max() > 1e-2  # the adapter changes the samples
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)

    sampled = load_model(tiny_dir, dtype="float32")
    load_lora(sampled, out)
    with torch.no_grad():
        torch.testing.assert_close(_ode(sampled, noise, cond, 4.0), ours, rtol=1e-5, atol=1e-5)
    (out / files[1]).unlink()
    with pytest.raises(ValueError, match=r"pytorch_lora_weights_transformer_2\.safetensors"):
        load_lora(load_model(tiny_dir, dtype="float32"), out)


def test_a_directory_with_one_half_of_the_two_experts_is_refused(tiny_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    index = json.loads((broken / "model_index.json").read_text())
    index["boundary_ratio"] = None
    (broken / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="needs both"):
        load_model(broken, dtype="float32")


def test_a_training_step_moves_both_experts_lora_and_exports_both(tmp_path, monkeypatch):
    """`diffrl train` (Flow-GRPO, tiny_wan_video's loop) on tiny:wan22_a14b with the SDE window over
    all 4 steps (t = 1000, 900 on the high-noise expert; 750, 500 on the low-noise one): after one
    step both experts' LoRA B (zero at the start) have moved, and the export has both files."""
    from diffrl.controller.run import train

    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    run = train(
        "tiny_wan_video",
        [
            "model.path=tiny:wan22_a14b",
            "rollout.sde.window_size=4",
            "rollout.sde.window_range=[0,4]",
            "trainer.total_steps=1",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.check_at_start=false",
            f"trainer.output_dir={tmp_path}",
            "trainer.run_name=a14b",
        ],
    )
    for file in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_transformer_2.safetensors"):
        tensors = load_file(run / "export" / file)
        moved = max(float(v.abs().max()) for k, v in tensors.items() if ".lora_B." in k)
        assert moved > 0, file
