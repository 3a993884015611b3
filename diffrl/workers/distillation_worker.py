"""The distillation role: a colocated worker whose one model holds the teacher, the student and
the fake score (`diffrl.train.distillation.Distiller`).

It is a `HybridWorker` (the student is its trained adapter, so sampling, validation, checkpoints
and export read the student as they read any trained adapter) with three calls of the
distillation step, which the controller (`diffrl.controller.distillation`) makes in this order:

    distill_stage(shard)        encode the prompts (with the teacher's CFG negatives), sample the
                                step's student inputs by backward simulation and keep them here
    fake_score_update(k)        k = 1..actor.loss.dmd_fake_updates: one fake-score optimizer step
    student_update()            one student optimizer step on the distribution-matching loss
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from diffrl.config.plan import RunPlan
from diffrl.config.schema import Config
from diffrl.models.base import ModelAdapter
from diffrl.telemetry.profiling import profiled_call
from diffrl.train.distillation import Distiller
from diffrl.workers.checkpointing import Checkpointing
from diffrl.workers.roles import HybridWorker, PromptShard

#: Where the fake score's checkpoints live, under the run's checkpoint folder: step_N there pairs
#: with the student's step_N (`DistillationCheckpointing`).
FAKE_SCORE_CHECKPOINTS = "fake_score"


class DistillationCheckpointing(Checkpointing):
    """Checkpoints of both trained parts: the student's (`TrainEngine.save`: both adapters' weights,
    the student's optimizer and scheduler, its counters, the RNG states, the controller's `extra`)
    and, in ROOT/fake_score/step_N, the fake score's AdamW, scheduler and update count
    (`Distiller.save`), so a resumed run continues both two time-scale updates exactly.

    The fake score's is written first and kept one longer, so every published student checkpoint
    has its partner, whatever a kill interrupts."""

    def __init__(self, engine, cfg: Config, distiller: Distiller):
        super().__init__(engine, cfg)
        self.distiller = distiller

    @profiled_call
    def save(self, root: str, step: int, extra: dict, keep_last: int) -> str:
        self.distiller.save(
            Path(root) / FAKE_SCORE_CHECKPOINTS, step, None if keep_last is None else keep_last + 1
        )
        return super().save(root, step, extra, keep_last)

    @profiled_call
    def load(self, path: str) -> dict:
        extra = super().load(path)
        partner = Path(path).parent / FAKE_SCORE_CHECKPOINTS / Path(path).name
        if partner.is_dir():
            self.distiller.load(partner)
        else:  # a checkpoint from before the fake score's were saved (or one copied alone)
            warnings.warn(
                f"{path} has no fake-score checkpoint ({partner}): the fake score's weights are restored "
                "but its AdamW starts afresh, so this run does not continue the saved one exactly",
                stacklevel=2,
            )
        return extra


class DistillationWorker(HybridWorker):
    """A `HybridWorker` with a `Distiller` on its engine (module docstring)."""

    def __init__(
        self,
        cfg: Config,
        adapter: ModelAdapter | None = None,
        *,
        plan: RunPlan | None = None,
        **_: Any,
    ):
        super().__init__(cfg, adapter, plan=plan)
        self.distiller = Distiller(self.engine, cfg, total_student_steps=cfg.trainer.total_steps)
        self.checkpoint = DistillationCheckpointing(self.engine, cfg, self.distiller)

    @profiled_call
    def distill_stage(self, shard: PromptShard, *, seed: int, step: int) -> dict[str, float]:
        """Encode `shard`'s prompts and stage rollout.n student samples of each (no gradient)."""
        cfg, adapter = self.cfg, self.engine.adapter
        pipe, n = cfg.rollout.pipeline, cfg.rollout.n
        with torch.no_grad():
            negatives = None
            if adapter.wants_negative(cfg.actor.loss.dmd_teacher_guidance):
                negatives = shard.negative_prompts or [pipe.negative_prompt] * len(shard.prompts)
            table = adapter.encode_prompts(
                list(shard.prompts), negatives, max_sequence_length=pipe.max_sequence_length
            )
        rows = torch.arange(len(shard.prompts)).repeat_interleave(n)
        samples = list(range(shard.sample_offset, shard.sample_offset + len(rows)))
        return self.distiller.stage(table[rows], samples, seed=seed, step=step)

    @profiled_call
    def fake_score_update(self, update: int) -> dict[str, float]:
        return self.distiller.fake_score_update(update)

    @profiled_call
    def student_update(self) -> dict[str, float]:
        return self.distiller.student_update()

    def distill_counts(self) -> dict[str, int]:
        """Optimizer steps so far: the student's and the fake score's."""
        return {"student_steps": self.engine.optim_steps, "fake_score_steps": self.distiller.fake_steps}


__all__ = ["FAKE_SCORE_CHECKPOINTS", "DistillationCheckpointing", "DistillationWorker"]
