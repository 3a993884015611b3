"""FLUX.2 [dev] end to end on CPU: `diffrl check` on the tiny model (one pass per step, the guidance
embedding at the preset's scale), the `tiny_flux2_dev` preset's LoRA training through the
policy-gradient loop on one worker, and its export loaded by `Flux2Pipeline.load_lora_weights`: the
adapter one to one, and the pipeline's own sampling with it equal, pixel for pixel, to diffrl's
sampler with the engine's adapter."""

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
from diffrl.models.flux2_dev import Flux2DevAdapter, with_text_processor
from diffrl.rollout.generate import generate
from diffrl.seeding import NOISE_STREAM, generator

PROMPTS = ["a red circle", "two blue squares"]
GUIDANCE = 3.0
SAMPLE = dict(n=1, steps=4, guidance_scale=GUIDANCE, height=32, width=32, max_sequence_length=64, seed=3)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A two-step LoRA run of `tiny_flux2_dev` (its start-up check on), with a learning rate that
    moves the samples."""
    root = tmp_path_factory.mktemp("flux2_dev_run")
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
    yield train("tiny_flux2_dev", overrides)
    monkeypatch.undo()


def _pixels(folder) -> np.ndarray:
    return np.stack([np.asarray(Image.open(f)).astype(np.int16) for f in sorted(folder.glob("*.png"))])


def test_the_check_passes(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path_factory.getbasetemp() / "diffrl_cache"))
    report = check("tiny_flux2_dev", [f"rollout.pipeline.guidance_scale={GUIDANCE}"], quick=True)
    assert report.exit_code == 0, report.table()
    measured = report.row("sampler = pipeline").measured
    assert measured.startswith("rel. error ") and float(measured.split()[-1]) < 1e-6, measured
    assert "passes/sample [1] vs [1]" in report.row("guidance / true CFG").measured


def test_the_preset_trains_and_its_lora_loads_into_the_pipeline(run, tmp_path):
    from diffusers import Flux2Pipeline

    cfg, adapter = trained_adapter(run)
    with torch.no_grad():
        generate(adapter, PROMPTS, tmp_path / "engine", progress=False, **SAMPLE)
    expected = _pixels(tmp_path / "engine")

    # plain diffusers: Flux2Pipeline's own from_pretrained and load_lora_weights (the processor's
    # text side attached where torchvision is missing, `Flux2DevAdapter.loaded_components`)
    assert main(["export", str(run), "--out", str(tmp_path / "lora")]) == 0
    noise = adapter.init_noise([generator("cpu", NOISE_STREAM, 3, 0, i) for i in range(2)], 32, 32)
    unpacked = noise.permute(0, 2, 1).reshape(2, 128, 2, 2)
    path = resolve_model_path(cfg.model.path)
    extra = Flux2DevAdapter.loaded_components(path)
    pipe = with_text_processor(Flux2Pipeline.from_pretrained(path, dtype=torch.float32, **extra), path)
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
    theirs = pipe(
        prompt=list(PROMPTS),
        latents=unpacked,
        guidance_scale=GUIDANCE,
        num_inference_steps=4,
        height=32,
        width=32,
        max_sequence_length=64,
        output_type="np",
    ).images
    assert any(p.abs().max() > 0 for n, p in loaded.items() if ".lora_B." in n)  # trained
    assert np.abs((theirs * 255).round().astype(np.int16) - expected).max() == 0
