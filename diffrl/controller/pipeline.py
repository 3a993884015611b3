"""The rollout pipeline: one schedule for every async mode, with a staleness bound K.

    trainer.async_mode=sync           K = 0   each batch sampled with the weights its step starts from
    trainer.async_mode=one_step_off   K = 1   sampled while the trainer updates on the batch before
    trainer.async_mode=bounded        K = trainer.max_staleness batches in flight ahead of the trainer

Versions. Version v is the weights after v training steps; step k starts from version k − 1 and
trains on batch k. Batch j is sampled with the version

    v(j) = max(c, j − 1 − K)        c: the last checkpoint step before j (0 at the start of a run)

so when step j trains on it, its staleness (j − 1) − v(j) = min(j − 1 − c, K) is never more than K.
K = 0 gives v(j) = j − 1: every batch is on-policy and nothing is in flight between steps.

Step k (`take`):

1. Nothing in flight (the start, a resume, the step after a checkpoint, and every step when K = 0):
   the samplers receive version k − 1 (`Placement.sync_weights`) and batches k … L are queued,
   L = min(k + K, the next checkpoint step), all with that version.
2. Wait for batch k; check that every trajectory carries its scheduled version, at most K behind.
3. If anything queued after this needs version k − 1 (a batch k + K, or a later pass of batch k,
   below), the samplers get it: a plain `sync_weights` when nothing is in flight (they are idle:
   always so when K = 1), else `publish_weights`: the trainer ranks copy what a sync moves and its
   delivery is queued behind the batches in flight, which the replicas finish with their older
   versions, while the trainer trains. The schedule is a function of the step and the checkpoints,
   never of the timing, so a run is deterministic; each request names its version and a replica
   holding another one refuses it.
4. Queue batches up to L, with version k − 1.

Passes (separate placement: the passes without gradient the replicas run, Config.rollout_passes).
A batch sampled with the version its step starts from (v(j) = j − 1) gets every pass with its
sample. A batch sampled behind gets the passes with fixed weights (the reference) with its sample,
and the ones that need the step's weights (the old log-probs) later: `Placement.evaluate_later`,
queued right after the delivery of version j − 1 in step j's point 3. With K ≥ 2 that delivery comes
after the batches in flight, so such a pass would stall the update; the config keeps the old
log-probs on the trainer there.

A batch whose staleness would exceed K is never sampled: the replicas wait for the version it
needs, they do not sample it early with older weights and drop it (that would make which batches
are trained depend on how fast each side ran).

A step that ends with a checkpoint (trainer.save_freq, the last step) has no batch after it in
flight: the pipeline stops at the next checkpoint step and drains there, so a checkpoint holds no
in-flight work and a resumed run samples the batches after it with the checkpoint's weights, as
the uninterrupted run did (the `c` above). The cost: the step after a checkpoint waits for its own
batch (nothing was sampled ahead of it), and the K steps before one have fewer batches ahead.

Validation (`sync_for_validation`) lets every in-flight batch finish sampling with its own version,
then gives the samplers the step's weights; the batches still to be queued need no older version,
so the schedule is unchanged.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from diffrl.controller.placement import PendingRollout, Placement, StagedRollout
from diffrl.data import PromptRecord
from diffrl.train.engine import POLICY


@dataclass
class InFlight:
    """A batch sampling ahead of the trainer: the step that trains on it, its prompts, its
    rollout being sampled and the weight version it is sampled with."""

    step: int
    records: list[PromptRecord]
    pending: PendingRollout
    version: int


# (prompts, the step that trains on them, the weight version to sample with, the passes to run
# with the sample) -> their rollout
Sample = Callable[[list[PromptRecord], int, int, tuple[str, ...]], PendingRollout]


class RolloutPipeline:
    """The in-flight batches of a run and their version schedule (module docstring).

    `draw()` gives the next batch's prompts (the data sampler, so batches are drawn in step order);
    `horizon(step)` is the first step >= `step` that ends with a checkpoint, beyond which nothing is
    sampled before that checkpoint is written. `log_in_flight`: add `async/in_flight` (the batches
    queued ahead) to each step's metrics. `sync_every_step`: give the samplers the weights each step
    starts from even when nothing queued needs them (one_step_off's record of weight_sync/* at a
    checkpoint step)."""

    def __init__(
        self,
        placement: Placement,
        max_staleness: int,
        *,
        draw: Callable[[], list[PromptRecord]],
        horizon: Callable[[int], int],
        log_in_flight: bool = True,
        sync_every_step: bool = False,
    ):
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}: must be >= 0")
        self.placement = placement
        self.max_staleness = max_staleness
        self._draw = draw
        self._horizon = horizon
        self.log_in_flight = log_in_flight
        self.sync_every_step = sync_every_step
        self.batches: deque[InFlight] = deque()
        self.next_step = 1  # the step of the next batch to queue
        self.version: int | None = None  # what the samplers hold once everything queued is through

    def take(
        self, step: int, sample: Sample, passes: Sequence[str] = ()
    ) -> tuple[list[PromptRecord], StagedRollout, dict[str, float], float]:
        """Step `step`'s prompts, their rollout, the sampling metrics and the seconds the trainer
        waited for the rollout (module docstring, points 1-4). `passes`: what the samplers compute
        on each batch besides sampling it (Config.rollout_passes)."""
        metrics: dict[str, float] = {}
        if not self.batches:
            self.placement.drain()  # nothing may stream to the replicas beside this sync
            metrics.update(self.placement.sync_weights(step - 1))
            self.version, self.next_step = step - 1, step
            self._top_up(step, sample, passes)
        batch = self.batches.popleft()
        if batch.step != step:
            raise RuntimeError(f"step {step} found the batch of step {batch.step} first in the pipeline")
        waited = time.perf_counter()
        rollout = batch.pending.result()
        wait_s = time.perf_counter() - waited
        self._check(rollout, batch, step)
        later = [name for name in passes if not rollout.computed(name)]
        needed = bool(later) or self.next_step <= self._last(step) or self.sync_every_step
        if self.version != step - 1 and needed:
            metrics.update(self._deliver(step - 1))
        if later:
            self.placement.evaluate_later(rollout, later, step - 1)
        self._top_up(step, sample, passes)
        if self.log_in_flight:
            metrics["async/in_flight"] = float(len(self.batches))
        return batch.records, rollout, metrics, wait_s

    def sync_for_validation(self, step: int) -> dict[str, float]:
        """Give the samplers the weights the trainer holds after `step`, for validation: every
        in-flight batch finishes sampling with its own version first (the batches stay in the
        pipeline), and so does every queued delivery. The batches queued after this need no
        older version than `step`, so the schedule does not change."""
        for batch in self.batches:
            batch.pending.result()
        self.placement.drain()
        metrics = self.placement.sync_weights(step)
        self.version = step
        return metrics

    def _deliver(self, version: int) -> dict[str, float]:
        """The samplers get `version` after what is queued: directly when nothing is in flight."""
        self.version = version
        if not self.batches:
            self.placement.drain()
            return self.placement.sync_weights(version)
        return self.placement.publish_weights(version)

    def _last(self, step: int) -> int:
        """The last batch to have queued while step `step` trains: K ahead, or the checkpoint's."""
        return min(step + self.max_staleness, self._horizon(step))

    def _top_up(self, step: int, sample: Sample, passes: Sequence[str]) -> None:
        last = self._last(step)
        assert self.version is not None
        while self.next_step <= last:
            records = self._draw()
            # sampled behind the weights its step starts from: only the fixed-weight passes now
            on_policy = self.version == self.next_step - 1
            now = tuple(passes) if on_policy else tuple(name for name in passes if name != POLICY)
            pending = sample(records, self.next_step, self.version, now)
            self.batches.append(InFlight(self.next_step, records, pending, self.version))
            self.next_step += 1

    def _check(self, rollout: StagedRollout, batch: InFlight, step: int) -> None:
        """Every trajectory was sampled with the batch's scheduled version, at most K behind."""
        versions = {int(v) for v in rollout.summary.extras["weight_version_B"].tolist()}
        if versions != {batch.version} or step - 1 - batch.version > self.max_staleness:
            raise RuntimeError(
                f"step {step}'s batch was sampled with weight versions {sorted(versions)}, scheduled for "
                f"{batch.version}, with a staleness bound of {self.max_staleness}: it is not trained on"
            )


def staleness_of(async_mode: str, max_staleness: int) -> int:
    """K of `trainer.async_mode`: sync 0, one_step_off 1, bounded trainer.max_staleness."""
    return {"sync": 0, "one_step_off": 1}.get(async_mode, max_staleness)


__all__ = ["InFlight", "RolloutPipeline", "staleness_of"]
