"""How busy each pool of a separate run is, and which trainer/rollout split would balance it.

Per step (`pool_metrics`): the trainer ranks work in parallel and wait for the rollout pool
(the samples, and the passes the replicas run for them); the replicas report the seconds each of
their calls took. So

    trainer/wait_fraction = seconds the trainer waited / step seconds
    rollout/idle_fraction = 1 - replica busy seconds / (replicas × step seconds)

`SizingAdvisor` averages the busy times of the first measured steps (after a warm-up step:
compilation, and in one-step-off mode nothing overlaps step 1) into work in worker-seconds per
step, trainer (busy seconds × ranks) and rollout (the replicas' busy seconds summed), and picks
the split of the same number of workers that minimises the slower pool's time, assuming each
pool's work divides evenly over its workers (`balanced_split`). It prints that once.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Steps of each start skipped before measuring (compilation; one-step-off has no overlap in step 1).
WARMUP_STEPS = 1
#: Measured steps averaged before the split is recommended.
MEASURED_STEPS = 2


def pool_metrics(*, wait_s: float, rollout_busy_s: float, replicas: int, step_s: float) -> dict[str, float]:
    """The step's pool metrics (module docstring)."""
    step_s = max(step_s, 1e-9)
    return {
        "trainer/wait_seconds": wait_s,
        "trainer/wait_fraction": min(1.0, wait_s / step_s),
        "rollout/busy_seconds": rollout_busy_s,
        "rollout/idle_fraction": max(0.0, 1.0 - rollout_busy_s / (replicas * step_s)),
    }


@dataclass(frozen=True)
class Split:
    trainer: int  # trainer ranks
    rollout: int  # rollout replicas
    step_s: float  # the estimated step time: the slower pool's work over its workers


def balanced_split(trainer_work_s: float, rollout_work_s: float, workers: int) -> Split:
    """The split of `workers` (each pool at least one) that minimises max(trainer work / ranks,
    rollout work / replicas); ties go to more trainer ranks."""
    if workers < 2:
        raise ValueError(f"a split needs at least 2 workers, got {workers}")
    candidates = [
        Split(t, workers - t, max(trainer_work_s / t, rollout_work_s / (workers - t)))
        for t in range(1, workers)
    ]
    return min(candidates, key=lambda split: (split.step_s, -split.trainer))


class SizingAdvisor:
    """Collects the measured steps of a separate run and prints the balanced split once."""

    def __init__(self, trainer_ranks: int, replicas: int, *, whole_workers: bool):
        self.trainer_ranks, self.replicas = trainer_ranks, replicas
        # a pool sharing GPUs (gpus_per_worker or gpus_per_replica below 1) has no split to move
        self.whole_workers = whole_workers
        self.steps: list[tuple[float, float, float]] = []  # (step s, trainer busy s, rollout busy s)
        self.done = False

    def observe(self, metrics: dict[str, float]) -> str | None:
        """Record a step's pool metrics; the recommendation once enough steps are measured."""
        if self.done:
            return None
        step_s = metrics["timing_s/step"]
        self.steps.append((step_s, step_s - metrics["trainer/wait_seconds"], metrics["rollout/busy_seconds"]))
        if len(self.steps) < WARMUP_STEPS + MEASURED_STEPS:
            return None
        self.done = True
        return self.recommendation()

    def recommendation(self) -> str:
        measured = self.steps[WARMUP_STEPS:]
        step_s = sum(s for s, _, _ in measured) / len(measured)
        trainer_busy = sum(t for _, t, _ in measured) / len(measured)
        rollout_work = sum(r for _, _, r in measured) / len(measured)
        trainer_work = trainer_busy * self.trainer_ranks
        workers = self.trainer_ranks + self.replicas
        head = (
            f"pool sizing ({len(measured)} measured steps, {step_s:.2f} s each): the trainer's "
            f"{self.trainer_ranks} rank(s) were busy {trainer_busy:.2f} s a step, the {self.replicas} "
            f"replica(s) {rollout_work:.2f} s together"
        )
        if not self.whole_workers or workers < 2:
            return head + " (pools share GPUs here: no split to recommend)"
        best = balanced_split(trainer_work, rollout_work, workers)
        now = max(trainer_work / self.trainer_ranks, rollout_work / self.replicas)
        if (best.trainer, best.rollout) == (self.trainer_ranks, self.replicas):
            return head + f"; this {best.trainer}+{best.rollout} split is the balanced one of {workers} GPUs"
        return (
            head + f"; of these {workers} GPUs a {best.trainer}+{best.rollout} split would balance the "
            f"pools (trainer.n_gpus_per_node × trainer.nnodes = {best.trainer}, rollout.replicas="
            f"{best.rollout}): about {best.step_s:.2f} s of work per step on the busier pool, against "
            f"{now:.2f} s now (docs/async.md, 'Sizing the pools')"
        )


__all__ = ["MEASURED_STEPS", "WARMUP_STEPS", "SizingAdvisor", "Split", "balanced_split", "pool_metrics"]
