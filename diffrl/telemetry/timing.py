"""Wall time per phase of a training step, and the throughput that follows from it.

    timer = PhaseTimer(device)            # device: CUDA work is synchronised at phase edges
    timer.reset()                         # start of a step: clears the phases, restarts the step clock
    with timer.phase("gen"): ...          # accumulates (a phase entered twice in a step adds up)
    timer.metrics(images, gpus)           # the step's timing metrics (below)

Metrics (seconds of wall time; `images` = trajectories of the step, all GPUs together):

    timing_s/<phase>                   wall seconds spent in <phase> this step
    timing_per_image_s/<phase>         timing_s/<phase> / images
    timing_s/step                      wall seconds since reset() (phases, and the work between them)
    throughput/images_per_s_per_gpu    images / (timing_s/step × gpus)

Phase names are lower_snake_case; the trainer's are `PHASES` (docs/algorithms.md). Phases may nest
(then their times overlap); the same phase may not be entered inside itself.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

PHASES = (
    "gen",
    "reward",
    "old_log_prob",
    "ref",
    "update_actor",
    "update_weights",
    "data",  # diffrl sft: waiting for the step's images
    "checkpoint",
    "validation",
)

_PHASE_NAME = re.compile(r"[a-z0-9_]+")


class PhaseTimer:
    """Accumulates wall time per phase; `reset()` at the start of each step."""

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.device = torch.device(device) if device is not None else None
        self._sync = self.device is not None and self.device.type == "cuda"
        self._clock = clock
        self._seconds: dict[str, float] = {}
        self._active: set[str] = set()
        self._start = clock()

    def reset(self) -> None:
        """Forget this step's phases and restart the step clock."""
        if self._active:
            raise RuntimeError(f"reset() inside the phase(s) {sorted(self._active)}")
        self._seconds = {}
        self._start = self._clock()

    def _synchronize(self) -> None:
        if self._sync:
            torch.cuda.synchronize(self.device)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as `name` (GPU work queued before and inside it is waited for)."""
        if not _PHASE_NAME.fullmatch(name):
            raise ValueError(f"phase name {name!r} must be lower_snake_case (a-z, 0-9, _), e.g. {PHASES}")
        if name in self._active:
            raise RuntimeError(f"phase {name!r} entered inside itself")
        self._synchronize()
        self._active.add(name)
        start = self._clock()
        try:
            yield
        finally:
            self._synchronize()
            self._seconds[name] = self._seconds.get(name, 0.0) + (self._clock() - start)
            self._active.discard(name)

    def seconds(self) -> dict[str, float]:
        """{phase: wall seconds} of the phases timed since reset(), in first-use order."""
        return dict(self._seconds)

    def step_seconds(self) -> float:
        """Wall seconds since reset() (or since construction)."""
        return self._clock() - self._start

    def metrics(self, images: int, gpus: int, *, only: Sequence[str] | None = None) -> dict[str, float]:
        """The step's timing metrics (module docstring); does not reset.

        images: trajectories of the step, all GPUs together (0: no per-image or throughput values).
        gpus: GPUs (workers) the step ran on, >= 1.
        only: just these phases' `timing_s/` (and per-image) values, no step time or throughput:
            for phases timed after the step's main metrics (e.g. checkpoint, validation).
        """
        if images < 0 or gpus < 1:
            raise ValueError(f"images must be >= 0 and gpus >= 1, got images={images}, gpus={gpus}")
        phases = list(self._seconds) if only is None else [p for p in only if p in self._seconds]
        out: dict[str, float] = {}
        for phase in phases:
            out[f"timing_s/{phase}"] = self._seconds[phase]
            if images > 0:
                out[f"timing_per_image_s/{phase}"] = self._seconds[phase] / images
        if only is None:
            step = self.step_seconds()
            out["timing_s/step"] = step
            if images > 0 and step > 0:
                out["throughput/images_per_s_per_gpu"] = images / (step * gpus)
        return out
