"""`diffrl export` of an image-edit run, checked against plain diffusers: the LoRA a one-step run of a
tiny edit preset trained, loaded by the edit pipeline's own `load_lora_weights`, is the engine's
adapter one to one, and `diffrl sample --lora --image` reproduces the engine's own samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from edit_images import condition_image
from PIL import Image

from diffrl.cli import main
from diffrl.config import load_config
from diffrl.controller.run import train
from diffrl.models import adapter_class, load_model, resolve_model_path
from diffrl.rollout.generate import generate
from diffrl.train.checkpoint import latest_checkpoint, load_checkpoint
from diffrl.train.engine import TrainEngine

SAMPLE = dict(n=1, steps=2, height=32, width=32, seed=3, guidance_scale=2.5, max_sequence_length=32)


@pytest.fixture(scope="module", params=["tiny_flux_kontext", "tiny_qwen_image_edit"])
def run(request, tmp_path_factory):
    """A one-step LoRA run of the tiny edit preset, with a learning rate that moves the samples."""
    root = tmp_path_factory.mktemp(request.param)
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path_factory.getbasetemp() / "diffrl_cache"))
    overrides = [
        "trainer.total_steps=1",
        "trainer.save_freq=1",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.check_at_start=false",
        "trainer.loggers=[jsonl]",
        f"trainer.output_dir={root}",
        "trainer.run_name=run",
        "actor.optim.lr=5e-2",
    ]
    yield train(request.param, overrides)
    monkeypatch.undo()


def _engine(run_dir):
    cfg = load_config(str(run_dir / "config.yaml"), job="eval")
    adapter = load_model(cfg.model.path, dtype="float32")
    engine = TrainEngine(adapter, cfg.model, cfg.actor, total_optim_steps=1, seed=cfg.trainer.seed)
    load_checkpoint(
        latest_checkpoint(run_dir / "checkpoints"),
        model=engine.transformer,
        optimizer=None,
        scheduler=None,
        trainable_only=True,
        restore_rng=False,
    )
    engine.transformer.eval()
    return cfg, adapter, engine


def _pixels(folder) -> np.ndarray:
    return np.stack([np.asarray(Image.open(f)).astype(np.int16) for f in sorted(folder.glob("*.png"))])


def test_the_exported_lora_loads_into_the_edit_pipeline_and_samples_as_the_engine(run, tmp_path):
    from diffusers import DiffusionPipeline

    assert main(["export", str(run), "--out", str(tmp_path / "lora")]) == 0
    cfg, adapter, engine = _engine(run)
    # plain diffusers: the pipeline class's own from_pretrained and load_lora_weights
    root = resolve_model_path(cfg.model.path)
    family = adapter_class(type(adapter.pipe).__name__)
    pipe = DiffusionPipeline.from_pretrained(root, dtype=torch.float32, **family.loaded_components(root))
    pipe.load_lora_weights(tmp_path / "lora")
    trained = {n: p for n, p in engine.transformer.named_parameters() if "lora_" in n}
    loaded = {
        n.replace(".default_0.", ".default."): p
        for n, p in pipe.transformer.named_parameters()
        if "lora_" in n
    }
    assert loaded.keys() == trained.keys() and loaded
    assert all(torch.equal(p, trained[n]) for n, p in loaded.items())
    assert any(p.abs().max() > 0 for n, p in loaded.items() if ".lora_B." in n)

    # diffrl sample --lora --image: the engine's own samples, pixel for pixel
    condition_image(1).save(tmp_path / "source.png")
    image = [tmp_path / "source.png"]
    with torch.no_grad():
        generate(adapter, ["make it red"], tmp_path / "engine", images=image, **SAMPLE)
    base_args = ["sample", "--model", cfg.model.path, "--prompt", "make it red", "--image", str(image[0])]
    size = ["--steps", "2", "--height", "32", "--width", "32", "--seed", "3", "--device", "cpu"]
    size += ["--guidance-scale", "2.5", "--max-sequence-length", "32"]
    assert (
        main([*base_args, *size, "--lora", str(tmp_path / "lora"), "--out", str(tmp_path / "lora_out")]) == 0
    )
    assert main([*base_args, *size, "--out", str(tmp_path / "base")]) == 0
    expected = _pixels(tmp_path / "engine")
    assert np.abs(_pixels(tmp_path / "base") - expected).max() > 0, "the LoRA must change the sample"
    assert np.abs(_pixels(tmp_path / "lora_out") - expected).max() == 0

    # --merge: a whole edit pipeline directory (its processor too), loaded as a model
    assert main(["export", str(run), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    merged = [*base_args, *size, "--out", str(tmp_path / "from_merged")]
    merged[merged.index("--model") + 1] = str(tmp_path / "merged")
    assert main(merged) == 0
    assert np.abs(_pixels(tmp_path / "from_merged") - expected).max() <= 1  # merging rounds differently
