"""Qwen-Image 2.1 end to end on CPU: `diffrl check` on the tiny model (without guidance, as the
model card samples it, and with true CFG), the `tiny_qwen_image21` preset's LoRA training through
the policy-gradient loop on one worker, and its export loaded by
`QwenImage21Pipeline.load_lora_weights`: the adapter one to one, and the pipeline's own sampling
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
from diffrl.models.qwen_image21 import QwenImage21Adapter
from diffrl.rollout.generate import generate
from diffrl.seeding import NOISE_STREAM, generator

PROMPTS = ["a red circle", "two blue squares"]
SAMPLE = dict(n=1, steps=3, height=32, width=32, max_sequence_length=64, seed=3)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A two-step LoRA run of `tiny_qwen_image21` (its start-up check on), with a learning rate
    that moves the samples."""
    root = tmp_path_factory.mktemp("qwen_image21_run")
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
    yield train("tiny_qwen_image21", overrides)
    monkeypatch.undo()


def _pixels(folder) -> np.ndarray:
    return np.stack([np.asarray(Image.open(f)).astype(np.int16) for f in sorted(folder.glob("*.png"))])


def test_the_check_passes_with_and_without_true_cfg(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path_factory.getbasetemp() / "diffrl_cache"))
    for overrides, passes in (
        ([], 1),
        (["rollout.pipeline.true_cfg_scale=4.0", "rollout.pipeline.negative_prompt=blurry"], 2),
    ):
        report = check("tiny_qwen_image21", overrides, quick=True)
        assert report.exit_code == 0, report.table()
        assert f"passes/sample [{passes}] vs [{passes}]" in report.row("guidance / true CFG").measured


def _pipeline_pixels(pipe, noise) -> np.ndarray:
    """The pipeline's RGB pixels, one prompt per call (a batch would pad the shorter prompt, which
    moves its image: docs/models.md)."""
    rows = []
    for i, prompt in enumerate(PROMPTS):
        image = pipe(
            prompt=[prompt],
            latents=noise[i : i + 1],
            num_inference_steps=3,
            height=32,
            width=32,
            use_kv_cache=False,
            output_type="np",
        ).images
        rows.append(image[..., :3])
    return (np.concatenate(rows) * 255).round().astype(np.int16)


def test_the_preset_trains_and_its_lora_loads_into_the_pipeline(run, tmp_path):
    from diffusers import QwenImage21Pipeline

    cfg, adapter = trained_adapter(run)
    with torch.no_grad():
        generate(adapter, PROMPTS, tmp_path / "engine", progress=False, **SAMPLE)
    expected = _pixels(tmp_path / "engine")[..., :3]

    # plain diffusers: QwenImage21Pipeline's own from_pretrained and load_lora_weights (with the
    # family's `loaded_components`: the processor's text side where torchvision is missing)
    assert main(["export", str(run), "--out", str(tmp_path / "lora")]) == 0
    model_dir = resolve_model_path(cfg.model.path)
    extra = QwenImage21Adapter.loaded_components(model_dir)
    pipe = QwenImage21Pipeline.from_pretrained(model_dir, dtype=torch.float32, **extra)
    pipe.set_progress_bar_config(disable=True)
    noise = adapter.init_noise([generator("cpu", NOISE_STREAM, 3, 0, i) for i in range(2)], 32, 32)
    base = _pipeline_pixels(pipe, noise)
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
    theirs = _pipeline_pixels(pipe, noise)
    assert np.abs(base - expected).max() > 0, "the LoRA must change the samples"
    assert np.abs(theirs - expected).max() == 0
