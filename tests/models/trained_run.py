"""What the family train tests share: a 2-step preset run's checks, and its trained adapter built as
the trainer builds it (the run's config, the model in float32, the checkpoint's LoRA loaded), so
each test can compare diffrl's sampling with the adapter against the family's plain pipeline."""

from __future__ import annotations

import math
from pathlib import Path

from diffrl.config import load_config
from diffrl.models import load_model
from diffrl.telemetry import read_metrics
from diffrl.train.checkpoint import latest_checkpoint, load_checkpoint
from diffrl.train.engine import TrainEngine


def trained_adapter(run: Path):
    """(config, adapter) of `run` after its steps 1 and 2 logged a finite loss and a gradient and
    it exported its LoRA: the adapter holds the latest checkpoint's trained weights, in eval mode."""
    metrics = read_metrics(run / "metrics.jsonl")
    for step in (1, 2):
        assert math.isfinite(metrics[step]["actor/loss"]) and metrics[step]["actor/grad_norm"] > 0
    assert (run / "export" / "pytorch_lora_weights.safetensors").is_file()

    cfg = load_config(str(run / "config.yaml"), job="eval")
    adapter = load_model(cfg.model.path, dtype="float32")
    engine = TrainEngine(adapter, cfg.model, cfg.actor, total_optim_steps=1, seed=cfg.trainer.seed)
    load_checkpoint(
        latest_checkpoint(run / "checkpoints"),
        model=engine.transformer,
        optimizer=None,
        scheduler=None,
        trainable_only=True,
        restore_rng=False,
    )
    engine.transformer.eval()
    return cfg, adapter
