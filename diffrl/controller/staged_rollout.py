"""What the controller holds of a step's rollout: a `PendingRollout` while it is sampled, then a
`StagedRollout`.

Sampling runs while the controller does other work (a pipeline with batches in flight trains
meanwhile: diffrl.controller.pipeline) and `PendingRollout.result()` joins the pieces in prompt
order, so what a step trains on does not depend on which replica sampled which request: a
sample's noise is keyed by (seed, step, sample index) alone. The `StagedRollout` keeps the
summaries on the controller; the trajectories go to the trainer ranks as object references.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from diffrl.transition import Rollout, RolloutSummary, concat_rollouts, concat_summaries
from diffrl.workers.futures import WorkerFuture, gather
from diffrl.workers.staging import fetched


@dataclass
class StagedRollout:
    """A step's rollout as the controller holds it: the summary (uids, sample indices, sampled
    log-probs, reward handles and weight versions in its extras) and the pieces of the rollout
    itself, in prompt order, for the trainer ranks (`ActorWorker.stage`). Under Ray the pieces are
    object references: the latents and pixels go from the samplers to the trainer ranks without
    passing through the controller."""

    summary: RolloutSummary
    parts: list[Any]
    # per part, the passes without gradient the replicas ran on it (`RolloutWorker.evaluate`):
    # {policy: (log-probs [b, W], its SDE means handed over)}; `Separate.evaluate_later` adds more
    passes: list[dict[str, tuple[torch.Tensor, Any]]] = field(default_factory=list)
    # seconds the rollout pool spent on this batch, summed over the replicas' calls
    rollout_busy_s: float = 0.0
    # passes still running on the replicas: (the pump's future of their calls, one per part; the
    # weight version they must use)
    later: tuple[concurrent.futures.Future, int] | None = None
    timeout_s: float = 0.0

    def computed(self, policy: str) -> bool:
        """Whether every part comes with `policy`'s pass (sampled with it, or `later`)."""
        return bool(self.passes) and all(policy in piece for piece in self.passes)

    def pass_result(self, policy: str) -> tuple[torch.Tensor, list[Any]] | None:
        """(log-probs of all rows, the SDE means' pieces in row order) of `policy` as the replicas
        computed them, waiting (at most `timeout_s`) for passes still running; None when the
        replicas did not compute it (the trainer ranks do then)."""
        if self.later is not None:
            (queued, version), self.later = self.later, None
            futures = queued.result(self.timeout_s)  # the calls, once the pump reached them
            for piece, answer in zip(self.passes, gather(futures, timeout=self.timeout_s), strict=True):
                if answer["weight_version"] != version:  # the loop's order guarantees it
                    raise RuntimeError(
                        f"a replica computed passes with weight version {answer['weight_version']}, "
                        f"not {version}: the weights the update starts from"
                    )
                piece.update(answer["passes"])
                self.rollout_busy_s += answer["busy_s"]
        if not self.computed(policy):
            return None
        return (
            torch.cat([piece[policy][0] for piece in self.passes]),
            [piece[policy][1] for piece in self.passes],
        )

    def fetch(self) -> Rollout:
        """The whole rollout here, for a loop that builds its batches on the controller (the
        direct-preference loops); the summary's extras are its extras."""
        return replace(concat_rollouts(fetched(self.parts)), extras=self.summary.extras)


class PendingRollout:
    """A step's rollout being sampled; `result()` waits (at most `timeout_s`) and joins it."""

    def __init__(self, wait: concurrent.futures.Future | list[WorkerFuture], timeout_s: float):
        self._wait = wait
        self._timeout_s = timeout_s
        self._staged: StagedRollout | None = None

    def result(self) -> StagedRollout:
        if self._staged is None:
            if isinstance(self._wait, concurrent.futures.Future):
                try:
                    pieces = self._wait.result(self._timeout_s)
                except TimeoutError as err:
                    raise TimeoutError(
                        f"sampling did not finish within trainer.worker_timeout_s={self._timeout_s:g} s: {err}"
                    ) from None
            else:
                pieces = gather(self._wait, timeout=self._timeout_s)
            passes = [summary.extras.pop("passes", {}) for summary, _ in pieces]
            busy = sum(summary.extras.pop("busy_s", 0.0) for summary, _ in pieces)
            self._staged = StagedRollout(
                concat_summaries([summary for summary, _ in pieces]),
                [part for _, part in pieces],
                passes=passes,
                rollout_busy_s=busy,
                timeout_s=self._timeout_s,
            )
        return self._staged

    def done(self) -> bool:
        if self._staged is not None:
            return True
        if isinstance(self._wait, concurrent.futures.Future):
            return self._wait.done()
        return all(future.done() for future in self._wait)


__all__ = ["PendingRollout", "StagedRollout"]
