"""HunyuanVideo-1.5 end to end on CPU: `diffrl check` on the tiny model,
the `tiny_hunyuan_video15` preset's LoRA training through the policy-gradient loop on one worker,
and its export loaded into plain diffusers: the adapter one to one, and `HunyuanVideo15Pipeline`'s
own sampling with it equal, pixel for pixel, to diffrl's sampler with the engine's adapter.

`HunyuanVideo15Pipeline` has no `load_lora_weights` in diffusers 0.42, so the export is loaded
with the transformer's own loader (`load_lora_adapter(DIR, prefix="transformer")`), the call a
pipeline's `load_lora_weights` makes for its transformer."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from trained_run import trained_adapter

from diffrl.cli import main
from diffrl.controller.check import check
from diffrl.controller.run import train
from diffrl.models import load_model, resolve_model_path
from diffrl.rollout import TrajectorySampler
from diffrl.rollout.generate import load_lora
from diffrl.train.export_run import ExportResult

PROMPTS = ["a red circle", 'a sign that says "hi"']


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A two-step LoRA run of `tiny_hunyuan_video15`, with a learning rate that moves the samples
    (its start-up check off: `test_the_check_passes` runs it, and the suite's time is a budget)."""
    root = tmp_path_factory.mktemp("hunyuan_video15_run")
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path_factory.getbasetemp() / "diffrl_cache"))
    overrides = [
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]",
        f"trainer.output_dir={root}",
        "trainer.run_name=run",
        "actor.optim.lr=5e-2",
        "trainer.check_at_start=false",
    ]
    yield train("tiny_hunyuan_video15", overrides)
    monkeypatch.undo()


def test_the_check_passes(tmp_path_factory, monkeypatch):
    """The preset as it is (no CFG: tests/models/test_hunyuan_video15.py matches the guider's CFG
    against the pipeline)."""
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path_factory.getbasetemp() / "diffrl_cache"))
    report = check("tiny_hunyuan_video15", [], quick=True)
    assert report.exit_code == 0, report.table()
    assert "passes/sample [1] vs [1]" in report.row("guidance / true CFG").measured
    assert report.row("text length").measured == "[1000] tokens/row vs [1000]"
    assert float(report.row("sampler = pipeline").measured.removeprefix("rel. error ")) <= 1e-5


def test_the_preset_trains_and_its_lora_loads_into_the_pipeline(run, tmp_path):
    from diffusers import HunyuanVideo15Pipeline

    cfg, adapter = trained_adapter(run)
    steps = cfg.rollout.pipeline.num_inference_steps
    rollout_cfg = replace(
        cfg.rollout, val=replace(cfg.rollout.val, n=1, num_inference_steps=steps, noise_level=0.0)
    )
    with torch.no_grad():
        ours = TrajectorySampler(adapter, rollout_cfg, progress=False).sample_validation(PROMPTS)
    expected = ours.samples.pixels.numpy().astype(np.int16)  # [B, T, 3, H, W]
    noise = ours.samples.window_latents[:, 0]

    # plain diffusers: the pipeline's own from_pretrained, the transformer's own LoRA loader
    assert main(["export", str(run), "--out", str(tmp_path / "lora")]) == 0
    pipe = HunyuanVideo15Pipeline.from_pretrained(resolve_model_path(cfg.model.path), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.enable_slicing()  # the diffusers VAE decodes one video at a time only
    settings = cfg.rollout.pipeline
    # the pipeline's CFG scale is its guider's (the tiny model's guider/config.json says 6)
    pipe.register_modules(guider=pipe.guider.new(guidance_scale=settings.guidance_scale))
    call = dict(
        prompt=list(PROMPTS),
        height=settings.height,
        width=settings.width,
        num_frames=settings.num_frames,
        num_inference_steps=settings.num_inference_steps,
        output_type="pt",
    )
    as_uint8 = lambda video: (video * 255).round().to(torch.int16).numpy()  # noqa: E731
    base = as_uint8(pipe(latents=noise.clone(), **call).frames)
    pipe.transformer.load_lora_adapter(
        str(tmp_path / "lora"),
        weight_name="pytorch_lora_weights.safetensors",
        prefix="transformer",
        adapter_name="default",
    )
    trained = {n: p for n, p in adapter.transformer.named_parameters() if "lora_" in n}
    loaded = {n: p for n, p in pipe.transformer.named_parameters() if "lora_" in n}
    assert loaded.keys() == trained.keys() and loaded
    assert all(torch.equal(p, trained[n]) for n, p in loaded.items())
    layer = next(m for m in pipe.transformer.modules() if getattr(m, "scaling", None))
    assert layer.scaling["default"] == cfg.model.lora.alpha / cfg.model.lora.rank  # the file's metadata
    theirs = as_uint8(pipe(latents=noise.clone(), **call).frames)
    assert theirs.shape == expected.shape
    assert np.abs(base - expected).max() > 0, "the LoRA must change the samples"
    assert np.abs(theirs - expected).max() == 0

    # diffrl sample --lora takes the same route (the pipeline has no load_lora_weights), and the
    # export prints that route, not load_lora_weights
    fresh = load_model(cfg.model.path, dtype="float32")
    load_lora(fresh, tmp_path / "lora")
    bound = {n: p for n, p in fresh.transformer.named_parameters() if "lora_" in n}
    assert bound.keys() == trained.keys() and all(torch.equal(p, trained[n]) for n, p in bound.items())
    hint = ExportResult(tmp_path / "lora", "lora", str(run), cfg.model.path).describe()
    assert "load_lora_adapter(" in hint and "load_lora_weights(" not in hint
