"""Bounded staleness (trainer.async_mode=bounded): the rollout replicas keep up to
K = trainer.max_staleness batches in flight ahead of the trainer.

Versions. Version v is the weights after v training steps; step k starts from version k − 1 and
trains on batch k. Batch j is sampled with the version

    v(j) = max(c, j − 1 − K)        c: the last checkpoint step before j (0 at the start of a run)

so when step j trains on it, its staleness (j − 1) − v(j) = min(j − 1 − c, K) is never more than K.
With K = 1 this is one_step_off's schedule.

How the replicas get there without waiting for the trainer, and the trainer without waiting for
the replicas (other than for the batch it trains on):

- Step k waits for batch k, then *publishes* version k − 1 (`Placement.publish_weights`): the
  trainer ranks copy what a sync moves and go on training; the delivery of that copy is queued on
  the placement's request pump after the batches already queued (k + 1 … k + K − 1, sampled with
  older versions), then batch k + K is queued, to be sampled with version k − 1. The replicas
  sample the queue in order, so each batch is sampled with its scheduled version whatever the
  timing: the schedule is a function of the step and the checkpoints, which keeps a run
  deterministic. Each request names its version and a replica holding another one refuses it.
- A batch whose staleness would exceed K is never sampled, so never trained on: the replicas
  *wait* for the version it needs (they are K batches ahead), they do not sample it early with
  older weights and drop it later. Dropping and resampling would make which batches are trained
  depend on how fast each side ran, so two runs with the same seed would differ. The check in
  `take` (every trajectory of batch k carries its scheduled version) only guards this invariant.
- A step that ends with a checkpoint (trainer.save_freq, the last step) has no batch after it in
  flight: the pipeline stops at the next checkpoint step and drains there, as one_step_off does,
  so a checkpoint holds no in-flight work and a resumed run samples the batches after it with the
  checkpoint's weights, as the uninterrupted run did (the `c` above). The cost: the step after
  a checkpoint waits for its own batch to be sampled (nothing was sampled ahead of it), and the
  K steps before a checkpoint have fewer batches queued ahead.
- Validation (TrainingLoop.validate) lets every in-flight batch finish sampling with its own
  version first, then gives the replicas the step's weights (`sync_for_validation`); the batches
  still to be queued need no older version, so the schedule is unchanged.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from diffrl.controller.placement import PendingRollout, Placement, StagedRollout
from diffrl.data import PromptRecord


@dataclass
class InFlight:
    """A batch sampling ahead of the trainer: the step that trains on it, its prompts, its
    rollout being sampled and the weight version it is sampled with."""

    step: int
    records: list[PromptRecord]
    pending: PendingRollout
    version: int


# (prompts, the step that trains on them, the weight version to sample with) -> their rollout
Sample = Callable[[list[PromptRecord], int, int], PendingRollout]


class BoundedPipeline:
    """The in-flight batches of a bounded-staleness run and their version schedule (module docstring).

    `draw()` gives the next batch's prompts (the data sampler, so batches are drawn in step order);
    `horizon(step)` is the first step >= `step` that ends with a checkpoint, beyond which nothing is
    sampled before that checkpoint is written."""

    def __init__(
        self,
        placement: Placement,
        max_staleness: int,
        *,
        draw: Callable[[], list[PromptRecord]],
        horizon: Callable[[int], int],
    ):
        if max_staleness < 1:
            raise ValueError(f"max_staleness={max_staleness}: must be >= 1")
        self.placement = placement
        self.max_staleness = max_staleness
        self._draw = draw
        self._horizon = horizon
        self.batches: deque[InFlight] = deque()
        self.next_step = 1  # the step of the next batch to queue
        self.version: int | None = None  # what the replicas hold once everything queued is through

    def take(
        self, step: int, sample: Sample
    ) -> tuple[list[PromptRecord], StagedRollout, dict[str, float], float]:
        """Step `step`'s prompts, their rollout, the sampling metrics and the seconds the trainer
        waited for the rollout; publishes the weights the step starts from and queues the batches
        up to min(step + K, the next checkpoint step)."""
        metrics: dict[str, float] = {}
        if not self.batches:  # the start, a resume, or the step after a checkpoint
            self.placement.drain()  # nothing may stream to the replicas beside this sync
            metrics.update(self.placement.sync_weights(step - 1))
            self.version, self.next_step = step - 1, step
            self._top_up(step, sample)
        batch = self.batches.popleft()
        if batch.step != step:
            raise RuntimeError(f"step {step} found the batch of step {batch.step} first in the pipeline")
        waited = time.perf_counter()
        rollout = batch.pending.result()
        wait_s = time.perf_counter() - waited
        self._check(rollout, batch, step)
        # the weights this step starts from, for the batches queued next (none at a checkpoint step)
        if self.version != step - 1 and self.next_step <= self._last(step):
            metrics.update(self.placement.publish_weights(step - 1))
            self.version = step - 1
        self._top_up(step, sample)
        metrics["async/in_flight"] = float(len(self.batches))
        return batch.records, rollout, metrics, wait_s

    def sync_for_validation(self, step: int) -> dict[str, float]:
        """Give the replicas the weights the trainer holds after `step`, for validation: every
        in-flight batch finishes sampling with its own version first (the batches stay in the
        pipeline), and so does every queued delivery. The batches queued after this need no
        older version than `step`, so the schedule does not change."""
        for batch in self.batches:
            batch.pending.result()
        self.placement.drain()
        metrics = self.placement.sync_weights(step)
        self.version = step
        return metrics

    def _last(self, step: int) -> int:
        """The last batch to have queued while step `step` trains: K ahead, or the checkpoint's."""
        return min(step + self.max_staleness, self._horizon(step))

    def _top_up(self, step: int, sample: Sample) -> None:
        last = self._last(step)
        while self.next_step <= last:
            records = self._draw()
            assert self.version is not None
            pending = sample(records, self.next_step, self.version)
            self.batches.append(InFlight(self.next_step, records, pending, self.version))
            self.next_step += 1

    def _check(self, rollout: StagedRollout, batch: InFlight, step: int) -> None:
        """Every trajectory was sampled with the batch's scheduled version, at most K behind."""
        versions = {int(v) for v in rollout.summary.extras["weight_version_B"].tolist()}
        if versions != {batch.version} or step - 1 - batch.version > self.max_staleness:
            raise RuntimeError(
                f"step {step}'s batch was sampled with weight versions {sorted(versions)}, scheduled for "
                f"{batch.version}, with trainer.max_staleness={self.max_staleness}: it is not trained on"
            )


__all__ = ["BoundedPipeline", "InFlight"]
