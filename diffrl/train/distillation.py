"""DMD2 distillation on one training engine: the student, the fake score and the teacher in one model.

The engine's trained LoRA adapter (`default`) is the student; `Distiller` adds the fake score as a
second adapter (`diffrl.algos.dmd2.FAKE_SCORE`, zero-initialised like the student, so both start as
the base) with an AdamW of its own; the teacher is the base with every adapter off
(`TrainEngine.use_policy(REFERENCE)`). One model's weights, three roles. The math is
`diffrl.algos.dmd2`; this module runs it in the order the adapters allow:

    stage(prompts)         the step's B = prompts × rollout.n student samples by backward simulation:
                           per sample a step i, the student's own Euler steps (`diffrl.sde.step`,
                           kind ode, on `student_schedule`: rollout.pipeline.sigmas, else the
                           family's schedule for rollout.pipeline.num_inference_steps)
                           from its seeded noise to x_{σ_i}, and x̂₀ there; all without gradient
    fake_score_update(k)   the flow-matching loss of the fake adapter on the staged x̂₀ (detached),
                           fresh (t, ε) per sample and update k; one optimizer step of the fake score
    student_update()       teacher (CFG) and fake velocities at the re-noised x̂₀, without gradient,
                           then the student's forward at x_{σ_i} with gradient and the DM loss; one
                           optimizer step of the student (`TrainEngine.optim_step`)

Passes without gradient run first in each term: switching peft adapters changes which tensors
require grad, which must not happen while a trained graph is alive. The controller calls
`fake_score_update` `dmd_fake_updates` times per `student_update` (two time-scale updates) on the
same staged samples, each with its own re-noising draws.

Every draw comes from a generator keyed (DISTILL_STREAM, seed, step, phase, sample): phase 0 draws
the student step and the initial noise, phase 1 the student update's (t, ε'), phase 1 + k the k-th
fake update's (t, ε). A sample's draws do not depend on its micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from diffrl.algos.dmd2 import (
    FAKE_SCORE,
    DMD2Loss,
    DMDInputs,
    fake_score_loss,
    noise_levels,
    student_step_indices,
    x0_prediction,
)
from diffrl.algos.flow_matching import interpolate
from diffrl.config.schema import Config
from diffrl.models.base import PromptEmbeds
from diffrl.schedules import Schedule, fixed_schedule
from diffrl.sde import step as sde_step
from diffrl.seeding import DISTILL_STREAM, generator
from diffrl.train.engine import NUM_TRAIN_TIMESTEPS, POLICY, REFERENCE, GradientTerm, TrainEngine
from diffrl.train.lora import inject_lora, lora_policy
from diffrl.train.optim import adamw
from diffrl.train.preference import conditional

#: Seed offset of the fake score's LoRA initialisation (the student's uses the run seed itself).
FAKE_INIT_SEED_OFFSET = 1


@dataclass
class StudentBatch:
    """The step's staged student samples (B of them), on the engine's device.

    cond:         [B] conditioning rows with the teacher's CFG negatives when it uses CFG
    latents:      fp32 [B, ...] x_{σ_i}, the student's input at its trained step (no grad)
    sigmas_B:     fp32 (B,) σ_i of each sample's trained step
    x0:           fp32 [B, ...] the student's x̂₀ there (no grad)
    sample_index: the step-wide index of each sample (keys its draws)
    """

    cond: PromptEmbeds
    latents: torch.Tensor
    sigmas_B: torch.Tensor
    x0: torch.Tensor
    sample_index: list[int]

    def __len__(self) -> int:
        return self.latents.shape[0]


def student_schedule(adapter, pipe) -> Schedule:
    """The student's schedule: `rollout.pipeline.sigmas` when set (its own few-step sigmas, what
    validation and the export's sampling file use too), else the family's for num_inference_steps."""
    if pipe.sigmas is not None:
        return fixed_schedule(pipe.sigmas)
    return adapter.schedule(pipe.num_inference_steps, pipe.height, pipe.width, pipe.num_frames)


class Distiller:
    """DMD2 on `engine` (the module docstring); `cfg` is the run's `Config`."""

    def __init__(self, engine: TrainEngine, cfg: Config, *, total_student_steps: int):
        if not engine.lora:
            raise ValueError(
                "DMD2 distillation holds the student and the fake score as LoRA adapters of one base "
                "(the teacher): set model.lora.rank > 0"
            )
        self.engine, self.cfg = engine, cfg
        self.loss_cfg = cfg.actor.loss
        self.loss_fn = DMD2Loss()
        adapter = engine.adapter
        inject_lora(adapter, cfg.model.lora, [FAKE_SCORE], seed=cfg.trainer.seed + FAKE_INIT_SEED_OFFSET)
        adapter.transformer.set_adapter(POLICY)  # the student stays the active, trained adapter
        self.fake_params = [
            p for name, p in adapter.transformer.named_parameters() if f".{FAKE_SCORE}." in name
        ]
        if not self.fake_params:
            raise ValueError(f"no parameters of the {FAKE_SCORE!r} adapter: check model.lora.target_modules")
        fake_lr = self.loss_cfg.dmd_fake_lr
        optim = cfg.actor.optim if fake_lr is None else replace(cfg.actor.optim, lr=fake_lr)
        total_fake = total_student_steps * self.loss_cfg.dmd_fake_updates
        self.fake_optimizer, self.fake_scheduler = adamw(self.fake_params, optim, total_fake)
        self.fake_steps = 0
        self.staged: StudentBatch | None = None
        self._step = (0, 0)  # (seed, step) of the staged batch

    # ------------------------------------------------------------------------------ network
    def _velocity(self, latents, sigmas_B, cond, guidance: float) -> torch.Tensor:
        pipe = self.cfg.rollout.pipeline
        return self.engine.adapter.velocity(
            latents,
            sigmas_B.to(latents.device) * NUM_TRAIN_TIMESTEPS,
            cond,
            guidance,
            pipe.height,
            pipe.width,
            pipe.num_frames,
        )

    def _fake_velocity(self, latents, sigmas_B, cond) -> torch.Tensor:
        with lora_policy(self.engine.transformer, FAKE_SCORE, POLICY):
            return self._velocity(latents, sigmas_B, conditional(cond), 1.0)

    def _teacher_velocity(self, latents, sigmas_B, cond) -> torch.Tensor:
        with self.engine.use_policy(REFERENCE):
            return self._velocity(latents, sigmas_B, cond, self.loss_cfg.dmd_teacher_guidance)

    def _micro(self, count: int) -> list[slice]:
        micro = self.cfg.actor.micro_batch_size
        return [slice(s, min(s + micro, count)) for s in range(0, count, micro)]

    # ------------------------------------------------------------------------------ the step
    @torch.no_grad()
    def stage(
        self, cond: PromptEmbeds, sample_index: Sequence[int], *, seed: int, step: int
    ) -> dict[str, float]:
        """Sample the step's student inputs by backward simulation (module docstring); `cond` holds
        one row per sample (negatives included when the teacher uses CFG)."""
        adapter, pipe = self.engine.adapter, self.cfg.rollout.pipeline
        steps = pipe.num_inference_steps
        sigmas = student_schedule(adapter, pipe).sigmas.float()
        gens = [generator("cpu", DISTILL_STREAM, seed, step, 0, int(i)) for i in sample_index]
        index_B = student_step_indices(gens, steps)
        x = adapter.init_noise(gens, pipe.height, pipe.width, pipe.num_frames)
        sigmas_B = sigmas[index_B].to(x.device)
        latents = x.clone()
        student_cond = conditional(cond)
        for k in range(int(index_B.max())):  # Euler steps up to each sample's trained step
            with self.engine.inference_policy(POLICY):
                v = torch.cat(
                    [
                        self._velocity(x[s], sigmas[k].expand(s.stop - s.start), student_cond[s], 1.0)
                        for s in self._micro(len(x))
                    ]
                )
            x = sde_step("ode", x, v, float(sigmas[k]), float(sigmas[k + 1]), 0.0).next_latents
            reached = (index_B == k + 1).to(x.device)
            latents[reached] = x[reached]
        with self.engine.inference_policy(POLICY):
            v = torch.cat(
                [self._velocity(latents[s], sigmas_B[s], student_cond[s], 1.0) for s in self._micro(len(x))]
            )
        x0 = x0_prediction(latents, v, sigmas_B)
        self.staged = StudentBatch(cond, latents, sigmas_B, x0, [int(i) for i in sample_index])
        self._step = (seed, step)
        return {"student_step_mean": float(index_B.double().mean())}

    def _draws(self, phase: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(t_B, ε) of the staged samples for `phase` (1: the student update, 1 + k: fake update k)."""
        assert self.staged is not None and phase >= 1
        seed, step = self._step
        gens = [generator("cpu", DISTILL_STREAM, seed, step, phase, i) for i in self.staged.sample_index]
        t_B = noise_levels(gens, self.loss_cfg.dmd_sigma_min, self.loss_cfg.dmd_sigma_max)
        shape = self.staged.latents.shape[1:]
        noise = torch.cat([torch.randn((1, *shape), generator=g, dtype=torch.float32) for g in gens])
        device = self.staged.latents.device
        return t_B.to(device), noise.to(device)

    def fake_score_update(self, update: int) -> dict[str, float]:
        """Fake-score update `update` (1-based) on the staged samples: loss, backward, one AdamW step."""
        batch = self._require_staged()
        if update < 1:
            raise ValueError(f"fake-score updates count from 1, got {update}")
        t_B, noise = self._draws(1 + update)

        def term(s: slice) -> tuple[torch.Tensor, dict[str, float]]:
            x0 = batch.x0[s]
            x_t = interpolate(x0, noise[s], t_B[s])
            # the fake adapter is active (and requires grad) for the whole accumulation below
            v = self._velocity(x_t, t_B[s], conditional(batch.cond[s]), 1.0)
            return fake_score_loss(v, x0, noise[s])

        parts = self._micro(len(batch))
        with lora_policy(self.engine.transformer, FAKE_SCORE, POLICY), self._fake_trains():
            metrics = self.engine.accumulate(
                [GradientTerm(partial(term, s), (s.stop - s.start) / len(batch)) for s in parts],
                metrics_divisor=1.0,
            )
        metrics.pop("loss", None)
        metrics.update(self._fake_optim_step())
        return metrics

    @contextmanager
    def _fake_trains(self) -> Iterator[None]:
        """Inside: the fake score's tensors require grad and the student's do not (a policy switch
        leaves the flags as they were: `lora_policy`); afterwards the student trains again."""
        student = self.engine.params
        for p in student:
            p.requires_grad_(False)
        for p in self.fake_params:
            p.requires_grad_(True)
        try:
            yield
        finally:
            for p in self.fake_params:
                p.requires_grad_(False)
            for p in student:
                p.requires_grad_(True)

    def _fake_optim_step(self) -> dict[str, float]:
        clip = self.cfg.actor.optim.clip_grad
        norm = float(
            torch.nn.utils.clip_grad_norm_(self.fake_params, clip if clip is not None else float("inf"))
        )
        if math.isfinite(norm):
            self.fake_optimizer.step()
            self.fake_scheduler.step()
            self.fake_steps += 1
        self.fake_optimizer.zero_grad(set_to_none=True)
        return {"fake_score_grad_norm": norm}

    def student_update(self) -> dict[str, float]:
        """The student's DM loss on the staged samples, backward, one optimizer step of the student."""
        batch = self._require_staged()
        t_B, noise = self._draws(1)

        def term(s: slice) -> tuple[torch.Tensor, dict[str, float]]:
            x_t = interpolate(batch.x0[s], noise[s], t_B[s])
            with torch.no_grad():  # without gradient, before the student's graph exists
                v_real = self._teacher_velocity(x_t, t_B[s], batch.cond[s])
                v_fake = self._fake_velocity(x_t, t_B[s], batch.cond[s])
            v = self._velocity(batch.latents[s], batch.sigmas_B[s], conditional(batch.cond[s]), 1.0)
            x0 = x0_prediction(batch.latents[s], v, batch.sigmas_B[s])
            return self.loss_fn.compute(DMDInputs(x0, noise[s], t_B[s], v_real, v_fake), self.loss_cfg)

        parts = self._micro(len(batch))
        metrics = self.engine.accumulate(
            [
                GradientTerm(
                    partial(term, s), (s.stop - s.start) / len(batch), (s.stop - s.start) / len(batch)
                )
                for s in parts
            ]
        )
        metrics.pop("loss", None)
        step_metrics = self.engine.optim_step()
        self.staged = None
        return {**metrics, **step_metrics}

    # ------------------------------------------------------------------------------ checkpoints
    def save(self, root: str | Path, step: int, keep_last: int | None) -> Path:
        """The fake score's training state at `step` as a checkpoint of its own under `root`
        (`save_checkpoint`: its AdamW, its scheduler and `fake_steps`, with the adapters' weights).
        The student's checkpoint (`TrainEngine.save`) holds the rest; the worker saves this one
        first (`DistillationCheckpointing`), so a published student checkpoint always has it."""
        from diffrl.train.checkpoint import save_checkpoint

        return save_checkpoint(
            Path(root),
            step,
            model=self.engine.transformer,
            optimizer=self.fake_optimizer,
            scheduler=self.fake_scheduler,
            trainable_only=True,
            extra={"fake_steps": self.fake_steps},
            keep_last=keep_last,
        )

    def load(self, path: str | Path) -> None:
        """Restore what `save` wrote at `path` (the RNG states are the student checkpoint's)."""
        from diffrl.train.checkpoint import load_checkpoint

        # torch initialises a fresh optimizer's state (to fill) only for tensors that require grad
        with self._fake_trains():
            extra = load_checkpoint(
                Path(path),
                model=self.engine.transformer,
                optimizer=self.fake_optimizer,
                scheduler=self.fake_scheduler,
                trainable_only=True,
                restore_rng=False,
            )
        self.fake_steps = int(extra["fake_steps"])

    def _require_staged(self) -> StudentBatch:
        if self.staged is None:
            raise RuntimeError("no staged student samples: call stage() first in this step")
        return self.staged


__all__ = ["FAKE_INIT_SEED_OFFSET", "Distiller", "StudentBatch", "conditional", "student_schedule"]
