"""FLUX.2 [klein] end to end on CPU: `diffrl check` on the tiny models (the distilled one's CFG-free
sampling, the base one's CFG), the `tiny_flux2_klein` preset's LoRA training through the
policy-gradient loop on one worker, and its export loaded by
`Flux2KleinPipeline.load_lora_weights`: the adapter one to one, and the pipeline's own sampling
with it equal, pixel for pixel, to diffrl's sampler with the engine's adapter."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from trained_run import trained_adapter

from diffrl.cli import main
from diffrl.controller.check import check
from diffrl.controller.run import train
from diffrl.models import resolve_model_path
from diffrl.rollout.generate import generate
from diffrl.seeding import NOISE_STREAM, generator

PROMPTS = ["a red circle", "two blue squares"]
SAMPLE = dict(n=1, steps=4, guidance_scale=1.0, height=32, width=32, max_sequence_length=64, seed=3)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A two-step LoRA run of `tiny_flux2_klein` (its start-up check on), with a learning rate that
    moves the samples."""
    root = tmp_path_factory.mktemp("flux2_run")
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path_factory.getbasetemp() / "diffrl_cache"))
    overrides = [
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]",
        f"trainer.output_dir={root}",
        "trainer.run_name=run",
        "actor.optim.lr=5e-2",
    ]
    yield train("tiny_flux2_klein", overrides)
    monkeypatch.undo()


def _pixels(folder) -> np.ndarray:
    return np.stack([np.asarray(Image.open(f)).astype(np.int16) for f in sorted(folder.glob("*.png"))])


def test_the_check_passes_with_and_without_cfg(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path_factory.getbasetemp() / "diffrl_cache"))
    base = ["model.path=tiny:flux2_klein_base", "rollout.pipeline.guidance_scale=4.0"]
    for overrides, passes in (([], 1), ([*base, "rollout.pipeline.negative_prompt=blurry"], 2)):
        report = check("tiny_flux2_klein", overrides, quick=True)
        assert report.exit_code == 0, report.table()
        # the same kernels as the pipeline: 0 on most hosts, float rounding (2.8e-07) on some CPUs
        measured = report.row("sampler = pipeline").measured
        assert measured.startswith("rel. error ") and float(measured.split()[-1]) < 1e-6, measured
        assert f"passes/sample [{passes}] vs [{passes}]" in report.row("guidance / true CFG").measured


def test_the_preset_trains_and_its_lora_loads_into_the_pipeline(run, tmp_path):
    from diffusers import Flux2KleinPipeline

    cfg, adapter = trained_adapter(run)
    with torch.no_grad():
        generate(adapter, PROMPTS, tmp_path / "engine", progress=False, **SAMPLE)
    expected = _pixels(tmp_path / "engine")

    # plain diffusers: Flux2KleinPipeline's own from_pretrained and load_lora_weights
    assert main(["export", str(run), "--out", str(tmp_path / "lora")]) == 0
    # the pipeline takes its initial latents unpacked, [B, 128, H/16, W/16]
    noise = adapter.init_noise([generator("cpu", NOISE_STREAM, 3, 0, i) for i in range(2)], 32, 32)
    unpacked = noise.permute(0, 2, 1).reshape(2, 128, 2, 2)
    pipe = Flux2KleinPipeline.from_pretrained(resolve_model_path(cfg.model.path), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(tmp_path / "lora")
    trained = {n: p for n, p in adapter.transformer.named_parameters() if "lora_" in n}
    loaded = {
        n.replace(".default_0.", ".default."): p
        for n, p in pipe.transformer.named_parameters()
        if "lora_" in n
    }
    assert loaded.keys() == trained.keys() and loaded
    assert all(torch.equal(p, trained[n]) for n, p in loaded.items())
    # the pipeline samples with the LoRA what diffrl's sampler samples with the engine's adapter
    theirs = pipe(
        prompt=list(PROMPTS),
        latents=unpacked,
        guidance_scale=1.0,
        num_inference_steps=4,
        height=32,
        width=32,
        max_sequence_length=64,
        output_type="np",
    ).images
    assert any(p.abs().max() > 0 for n, p in loaded.items() if ".lora_B." in n)  # trained
    assert np.abs((theirs * 255).round().astype(np.int16) - expected).max() == 0
