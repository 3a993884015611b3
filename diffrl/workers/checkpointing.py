"""Checkpoints and exports of the trained weights: a part of the training workers (diffrl.workers.roles).

Every rank takes part (gathering FSDP shards is a collective); what is written and how lives in
diffrl.train.checkpoint and diffrl.train.export. The controller addresses these as
`checkpoint.<method>` (diffrl.workers.group).
"""

from __future__ import annotations

from pathlib import Path

from diffrl.config.schema import Config
from diffrl.telemetry.profiling import profiled_call
from diffrl.train.engine import TrainEngine


class Checkpointing:
    """Save and load the engine's training state; export its weights for diffusers."""

    def __init__(self, engine: TrainEngine, cfg: Config):
        self.engine = engine
        self.cfg = cfg

    @profiled_call
    def save(self, root: str, step: int, extra: dict, keep_last: int) -> str:
        """Checkpoint `step` under `root` (with the controller's `extra`), keeping the newest `keep_last`."""
        return str(self.engine.save(root, step, extra, keep_last))

    @profiled_call
    def load(self, path: str) -> dict:
        """Restore the checkpoint at `path`; returns the `extra` it was saved with."""
        return self.engine.load(path)

    def export_lora(self, out_dir: str) -> str:
        """The trained `default` adapter in the diffusers LoRA format."""
        return str(self.engine.export_lora(Path(out_dir)))

    def export_pipeline(self, out_dir: str) -> str:
        """The whole pipeline with the trained transformer (LoRA merged in) as a diffusers directory
        (`diffrl.train.export.export_pipeline`; every rank calls it, rank 0 writes)."""
        from diffrl.train.export import export_pipeline

        return str(
            export_pipeline(
                self.engine.adapter, out_dir, model_path=self.cfg.model.path, merge=self.engine.lora
            )
        )


__all__ = ["Checkpointing"]
