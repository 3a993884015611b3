"""Z-Image end to end on CPU: `diffrl check` on the tiny model (Turbo's CFG-free sampling and
Z-Image's own CFG), the `tiny_zimage` preset's LoRA training through the policy-gradient loop on
one worker, and its export loaded by `ZImagePipeline.load_lora_weights`: the adapter one to one,
and the pipeline's own sampling with it equal, pixel for pixel, to diffrl's sampler with the
engine's adapter."""

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
SAMPLE = dict(n=1, steps=3, guidance_scale=0.0, height=32, width=32, max_sequence_length=64, seed=3)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A two-step LoRA run of `tiny_zimage` (its start-up check on), with a learning rate that
    moves the samples."""
    root = tmp_path_factory.mktemp("zimage_run")
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
    yield train("tiny_zimage", overrides)
    monkeypatch.undo()


def _pixels(folder) -> np.ndarray:
    return np.stack([np.asarray(Image.open(f)).astype(np.int16) for f in sorted(folder.glob("*.png"))])


def test_the_check_passes_with_and_without_cfg(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path_factory.getbasetemp() / "diffrl_cache"))
    for overrides, passes in (
        ([], 1),
        (["rollout.pipeline.guidance_scale=4.0", "rollout.pipeline.negative_prompt=blurry"], 2),
    ):
        report = check("tiny_zimage", overrides, quick=True)
        assert report.exit_code == 0, report.table()
        assert report.row("sampler = pipeline").measured == "rel. error 0"
        assert f"passes/sample [{passes}] vs [{passes}]" in report.row("guidance / true CFG").measured


def test_the_preset_trains_and_its_lora_loads_into_the_pipeline(run, tmp_path):
    from diffusers import ZImagePipeline

    cfg, adapter = trained_adapter(run)
    with torch.no_grad():
        generate(adapter, PROMPTS, tmp_path / "engine", progress=False, **SAMPLE)
    expected = _pixels(tmp_path / "engine")

    # plain diffusers: ZImagePipeline's own from_pretrained and load_lora_weights
    assert main(["export", str(run), "--out", str(tmp_path / "lora")]) == 0
    pipe = ZImagePipeline.from_pretrained(resolve_model_path(cfg.model.path), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    base = pipe(
        prompt=list(PROMPTS),
        latents=adapter.init_noise([generator("cpu", NOISE_STREAM, 3, 0, i) for i in range(2)], 32, 32),
        guidance_scale=0.0,
        num_inference_steps=3,
        height=32,
        width=32,
        max_sequence_length=64,
        output_type="np",
    ).images
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
    noise = adapter.init_noise([generator("cpu", NOISE_STREAM, 3, 0, i) for i in range(2)], 32, 32)
    theirs = pipe(
        prompt=list(PROMPTS),
        latents=noise,
        guidance_scale=0.0,
        num_inference_steps=3,
        height=32,
        width=32,
        max_sequence_length=64,
        output_type="np",
    ).images
    as_uint8 = lambda images: (images * 255).round().astype(np.int16)  # noqa: E731
    assert np.abs(as_uint8(base) - expected).max() > 0, "the LoRA must change the samples"
    assert np.abs(as_uint8(theirs) - expected).max() == 0
    # ... and so does `diffrl sample --lora` (the pipeline's loader under diffrl's sampler)
    args = [
        "sample",
        "--model",
        cfg.model.path,
        "--lora",
        str(tmp_path / "lora"),
        "--out",
        str(tmp_path / "cli"),
    ]
    args += ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--steps", "3", "--guidance-scale", "0"]
    args += [
        "--height",
        "32",
        "--width",
        "32",
        "--seed",
        "3",
        "--max-sequence-length",
        "64",
        "--device",
        "cpu",
    ]
    assert main(args) == 0
    assert np.abs(_pixels(tmp_path / "cli") - expected).max() == 0
