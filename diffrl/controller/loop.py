"""What every single-controller loop shares: the step schedule, validation, checkpoints, resume.

A loop subclasses `TrainingLoop` and implements `train_step()` (one step's work, returning its
metrics). `fit()` then runs the schedule the config describes:

    validation at step 0 (trainer.val_before_train), then for each step: train_step,
    validation every trainer.test_freq steps and at the last step, the step's metrics record, then
    a checkpoint every trainer.save_freq steps and at the last step (its save time is a second
    record of the step, `timing_s/checkpoint`).

The record comes first so that a checkpoint never covers a step missing from metrics.jsonl.

Each step's metrics and each validation's also go to the run-health watchdog
(diffrl.telemetry.health), whose `health/...` values join the step's record. A signal in
trainer.health.stop_on ends the run after that step's record, with a checkpoint of the step
(`stopped` says why; `diffrl train` exits with status 3). With trainer.keep_best, a validation
that beats every earlier one on trainer.best_metric also saves its step as RUN/checkpoints/best
(diffrl.train.best_checkpoint). In the async modes a step that did not plan a checkpoint has
batches in flight: the data position of a best or a stop checkpoint there is past them, so a run
resumed from it skips their prompts (it is not the uninterrupted run's continuation).

Ctrl-C or SIGTERM under `diffrl train` / `diffrl sft` stops the same way (`stops_at_safe_points`,
diffrl.controller.stopping: exit status 130 or 143, with the command that resumes the run).

A checkpoint stores the step and the data sampler's position (`data_position()`), so a resumed
run continues exactly where the interrupted one would have been.

Sampling goes through the run's `Placement` (diffrl.controller.placement) and one
`RolloutPipeline` (diffrl.controller.pipeline) with the staleness bound K of trainer.async_mode
(sync 0, one_step_off 1, bounded trainer.max_staleness): `rollout_for_step` returns the step's
prompts and their rollout, with up to K batches sampling ahead while the trainer updates. A step
that ends with a checkpoint has none in flight after it (the pipeline drains), so a checkpoint
holds no in-flight work and a resumed run samples the next batch exactly as the uninterrupted
run did, with the checkpoint's weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from diffrl.config.schema import Config
from diffrl.controller.pipeline import RolloutPipeline, staleness_of
from diffrl.controller.placement import Colocated, PendingRollout, Placement, StagedRollout
from diffrl.controller.pool_sizing import SizingAdvisor, pool_metrics
from diffrl.controller.stopping import stop_message, stop_requested, stops_at_safe_points
from diffrl.controller.validation import run_validation
from diffrl.data import PromptRecord, PromptSampler
from diffrl.files import write_json
from diffrl.telemetry import PhaseTimer, RunLogger
from diffrl.telemetry.console import progress
from diffrl.telemetry.health import NONFINITE_WATCHED, Watchdog, staleness_bound, validation_score_key
from diffrl.telemetry.profiling import format_summary
from diffrl.telemetry.sinks import read_metrics
from diffrl.train.best_checkpoint import BestTracker, publish_best, staging_root
from diffrl.train.checkpoint_files import step_dir
from diffrl.train.engine import POLICY
from diffrl.workers.group import WorkerGroup

# What a step's update depends on, in the order data flows: the first non-finite one is named.
WATCHED_METRICS = NONFINITE_WATCHED


class NonFiniteError(ValueError):
    """Too many steps in a row had a non-finite loss or gradient (trainer.max_nonfinite_steps)."""


#: Seconds after which a training step prints a progress line, then again every as many seconds.
LONG_STEP_S = 30.0


class TrainingLoop:
    """The shared part of `diffrl train` and `diffrl sft` (module docstring)."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        *,
        rewards: Any,
        train_records: Sequence[PromptRecord],
        val_records: Sequence[PromptRecord],
        logger: RunLogger,
        workers: WorkerGroup | None = None,
        placement: Placement | None = None,
    ):
        if (workers is None) == (placement is None):
            raise TypeError("pass either workers (a colocated pool) or a placement")
        self.cfg = cfg
        self.run_dir = run_dir
        self.placement = placement if placement is not None else Colocated(cfg, workers)
        self.workers = self.placement.trainer  # what trains (and, colocated, also samples)
        # whether each worker keeps the trajectories it samples for its own training share (a loop
        # whose schedule deals every worker its own groups sets it: policy_gradient.py)
        self.keep_rollouts = False
        self.rewards = rewards
        self.logger = logger
        self.sampler = PromptSampler(
            list(train_records), cfg.data.prompts_per_step, seed=cfg.data_seed, shuffle=cfg.data.shuffle
        )
        self.val_records = list(val_records)
        self.step = 0
        self.last_validation_step: int | None = None
        self.timer = PhaseTimer()
        self.nonfinite_steps = 0  # consecutive steps whose update was skipped as non-finite
        # the batches sampling ahead of the trainer, at most K versions behind (module docstring)
        trainer = cfg.trainer
        self.pipeline = RolloutPipeline(
            self.placement,
            staleness_of(trainer.async_mode, trainer.max_staleness),
            draw=lambda: [record for _, record in self.sampler.next_batch()],
            horizon=self._next_checkpoint,
            # the metrics each mode logged before the modes shared this pipeline
            log_in_flight=trainer.async_mode == "bounded",
            sync_every_step=trainer.async_mode == "one_step_off",
        )
        self.resume_sync_metrics: dict[str, float] = {}
        # the passes without gradient the replicas run (policy gradient sets cfg.rollout_passes)
        self.rollout_passes: tuple[str, ...] = ()
        # seconds this step's trainer waited for the rollout pool (samples, and passes it ran)
        self.wait_s = 0.0
        self.sizing = (
            SizingAdvisor(
                self.workers.size,
                self.placement.samplers.size,
                whole_workers=cfg.trainer.gpus_per_worker >= 1 and cfg.rollout.gpus_per_replica >= 1,
            )
            if cfg.trainer.placement == "separate"
            else None
        )
        # this start's record for summary.json (`run_stats`)
        self.wall_s, self.steps_this_start, self.peaks = 0.0, 0, {}
        # the run-health watchdog (trainer.health) and, with trainer.keep_best, the best validation
        self.health = Watchdog(
            trainer.health,
            staleness_bound=staleness_bound(trainer.async_mode, trainer.max_staleness, trainer.health),
        )
        self.best = BestTracker(run_dir / "checkpoints") if trainer.keep_best else None
        # why the run stopped early: trainer.health.stop_on, or a stop signal (diffrl.controller.stopping)
        self.stopped: str | None = None

    def train_step(self) -> dict[str, float]:
        raise NotImplementedError

    def data_position(self) -> dict:
        """The sampler state a checkpoint of the current step stores."""
        return self.sampler.state_dict()

    # ------------------------------------------------------------------------------ run
    def resume(self, checkpoint: Path) -> None:
        extra = self.workers.call("checkpoint.load", str(checkpoint))[0]
        self.step = int(extra["step"])
        self.sampler.load_state_dict(extra["data"])
        # the replicas' first sync (every tensor), logged with the first step after the resume
        self.resume_sync_metrics = self.placement.sync_weights(self.step, full=True)
        if (self.run_dir / "metrics.jsonl").is_file():  # the watchdog's view of the steps before
            self.health.replay(read_metrics(self.run_dir / "metrics.jsonl"), up_to=self.step)
        print(f"resumed from {checkpoint} at step {self.step}")

    # ------------------------------------------------------------------------------ sampling
    def rollout_for_step(
        self, policy: str = POLICY
    ) -> tuple[list[PromptRecord], StagedRollout, dict[str, float]]:
        """This step's prompts, their rollout (reward handles in its summary's extras) and the
        sampling metrics (weight versions, staleness, weight-sync cost), from the pipeline
        (diffrl.controller.pipeline: what is sampled ahead, with which weights)."""
        metrics, self.resume_sync_metrics = self.resume_sync_metrics, {}
        records, rollout, more, self.wait_s = self.pipeline.take(
            self.step,
            lambda upcoming, step, version, passes: self._sample(
                upcoming, step, policy, passes, version=version
            ),
            self.rollout_passes,
        )
        metrics.update(more)
        return records, rollout, {**metrics, **self._version_metrics(rollout)}

    def _version_metrics(self, rollout: StagedRollout) -> dict[str, float]:
        """The weight versions the step's trajectories were sampled with, against the version the
        step starts from (step - 1): the oldest version and, per trajectory, the staleness."""
        versions = rollout.summary.extras.pop("weight_version_B")
        staleness = (self.step - 1 - versions).double()
        return {
            "rollout/weight_version": float(versions.min()),
            "rollout/staleness": float(staleness.max()),
            "async/staleness": float(staleness.mean()),
            "async/staleness_max": float(staleness.max()),
        }

    def pool_metrics(self, rollout_busy_s: float, step_s: float) -> dict[str, float]:
        """Separate placement: each pool's busy and idle time this step (diffrl.controller.pool_sizing);
        after the first measured steps, the balanced split is printed once. Empty when colocated."""
        if self.sizing is None:
            return {}
        metrics = pool_metrics(
            wait_s=self.wait_s,
            rollout_busy_s=rollout_busy_s,
            replicas=self.placement.samplers.size,
            step_s=step_s,
        )
        advice = self.sizing.observe({**metrics, "timing_s/step": step_s})
        if advice is not None:
            print(advice)
        return metrics

    def _sample(
        self,
        records: list[PromptRecord],
        step: int,
        policy: str,
        passes: tuple[str, ...] = (),
        *,
        version: int | None = None,
    ) -> PendingRollout:
        uids = [f"{step}:{i}" for i in range(len(records))]
        return self.placement.sample(
            records,
            uids,
            step=step,
            rewards=self.rewards,
            policy=policy,
            keep=self.keep_rollouts,
            passes=passes,
            version=version,
        )

    def _next_checkpoint(self, step: int) -> int:
        """The first step >= `step` that ends with a checkpoint (`_ends_with_checkpoint`)."""
        total, save_freq = self.cfg.trainer.total_steps, self.cfg.trainer.save_freq
        return min(total, -(-step // save_freq) * save_freq) if save_freq else total

    #: Metrics whose largest value over the run goes into summary.json (as peak_<name>_gb).
    PEAKS: ClassVar[dict[str, str]] = {
        "rss": "perf/max_rss_gb",
        "cuda_allocated": "perf/max_memory_allocated_gb",
    }

    @property
    def images_per_step(self) -> int:
        """Images a training step samples (prompts x samples per prompt)."""
        return self.cfg.images_per_step

    @stops_at_safe_points  # Ctrl-C / SIGTERM: stop after a step's record, with a checkpoint
    def fit(self) -> dict[str, float]:
        """Run the remaining steps; returns the last validation's metrics. Records, for
        summary.json, this start's wall time, steps and peak memory (`run_stats`)."""
        cfg = self.cfg.trainer
        last_val: dict[str, float] = {}
        started = time.perf_counter()
        if self.step == 0 and cfg.val_before_train and cfg.test_freq > 0 and self.val_records:
            last_val = self.validate()
            last_val.update(self.health.observe_validation(0, last_val))
            self.logger.log(0, last_val)
            self.keep_if_best(last_val)
        first_step = self.step + 1
        while self.step < cfg.total_steps:
            self.step += 1
            # torch.compile traces the training graph in a process's first step: minutes on a large model
            compiling = self.cfg.model.compile and self.step == first_step
            # a step that outlasts LONG_STEP_S gets a heartbeat line (a slow host, a large model)
            heartbeat = (
                progress(f"step {self.step} (torch.compile warm-up)")
                if compiling
                else progress(f"step {self.step}", delay=LONG_STEP_S, every=LONG_STEP_S)
            )
            profiling = self.step in cfg.profile_steps
            if profiling:
                self.start_profiles()
            with heartbeat:
                metrics = self.train_step()
            if profiling:
                self.stop_profiles()
            metrics.update(self.health.observe_step(self.step, metrics))
            if self.health.stop_reason is None:  # a watchdog stop ends the run cleanly below
                self.check_finite(metrics)
            last_step = self.step == cfg.total_steps
            validated = bool(
                cfg.test_freq and self.val_records and (self.step % cfg.test_freq == 0 or last_step)
            )
            if validated:
                with self.timer.phase("validation"):
                    last_val = self.validate()
                metrics.update(last_val)
                metrics.update(self.health.observe_validation(self.step, last_val))
            metrics.update(self.timer.metrics(0, 1, only=("validation",)))
            # The step's record is durable (fsync'ed) before its checkpoint is published: a run
            # killed between the two resumes from the previous checkpoint and logs this step again
            # (its new record replaces this one), so every step a checkpoint covers is logged.
            self.logger.log(self.step, metrics)
            # stops with a checkpoint of this step (a stop signal at the last step: the run is done)
            signalled = stop_requested() is not None and not last_step
            stopping = self.health.stop_reason is not None or signalled
            saving = last_step or stopping or bool(cfg.save_freq and self.step % cfg.save_freq == 0)
            if saving:
                with self.timer.phase("checkpoint"), progress(f"checkpoint of step {self.step}"):
                    self.save()
            if (validated and self.keep_if_best(last_val)) or saving:
                self.logger.log_more(self.step, self.timer.metrics(0, 1, only=("checkpoint",)))
            self.steps_this_start += 1
            for name, key in self.PEAKS.items():
                if math.isfinite(metrics.get(key, math.nan)):
                    self.peaks[name] = max(self.peaks.get(name, 0.0), metrics[key])
            if stopping:
                checkpoint = step_dir(self.run_dir / "checkpoints", self.step)
                self.stopped = stop_message(checkpoint, self.run_dir) or (
                    f"{self.health.stop_reason}. The run stopped with its checkpoint {checkpoint}"
                )
                break
        self.wall_s = time.perf_counter() - started
        return last_val

    def _pools(self) -> dict[str, WorkerGroup]:
        """The worker pools by role: the trainer ranks, and separate placement's replicas."""
        pools = {"trainer": self.workers}
        if self.placement.samplers is not self.workers:
            pools["rollout"] = self.placement.samplers
        return pools

    def start_profiles(self) -> None:
        for pool in self._pools().values():
            pool.call("start_profile")

    def stop_profiles(self) -> None:
        """Each worker writes its trace of this step to <run>/profile/step_<N>/; their summaries
        (diffrl.telemetry.profiling) go to summary.json there, rank 0's of each pool to the console."""
        out = self.run_dir / "profile" / f"step_{self.step}"
        summaries: dict[str, Any] = {}
        for role, pool in self._pools().items():
            names = [f"{role}_rank{rank}" for rank in range(pool.size)]
            summaries.update(zip(names, pool.scatter("stop_profile", names, out_dir=str(out)), strict=True))
        write_json(out / "summary.json", {"step": self.step, "workers": summaries})
        print(f"profile of step {self.step}: {out} (traces open in https://ui.perfetto.dev)")
        for role in self._pools():
            summary = summaries[f"{role}_rank0"]
            print(f"{role} rank 0 ({summary['device']}), by worker call:")
            print("\n".join(format_summary(summary)))

    def run_stats(self) -> dict[str, Any]:
        """This start's wall time (validations and checkpoints included), images trained on, images/s
        over that wall time, and the peak memory the workers reported (GB; CUDA only on a GPU)."""
        wall = self.wall_s
        images = self.images_per_step * self.steps_this_start
        stats: dict[str, Any] = {
            "wall_s": round(wall, 3),
            "images": images,
            "images_per_s": round(images / wall, 4) if wall > 0 else None,
        }
        for name, value in sorted(self.peaks.items()):
            stats[f"peak_{name}_gb"] = round(value, 3)
        return stats

    def check_finite(self, metrics: dict[str, float]) -> None:
        """Count steps in a row whose loss or gradient norm is inf/nan (the engine skips their
        optimizer step, so the weights stay as they were); stop at trainer.max_nonfinite_steps,
        naming the step and the first non-finite value, before anything of it is logged or saved."""
        bad = [
            (key, metrics[key])
            for key in WATCHED_METRICS
            if key in metrics and not math.isfinite(metrics[key])
        ]
        if not bad:
            self.nonfinite_steps = 0
            return
        self.nonfinite_steps += 1
        limit = self.cfg.trainer.max_nonfinite_steps
        key, value = bad[0]  # the watchdog warned at the first such step (nonfinite_grad)
        if self.nonfinite_steps >= limit:
            raise NonFiniteError(
                f"step {self.step}: {key}={value} (and {[k for k, _ in bad[1:]] or 'nothing else'} non-finite); "
                f"{self.nonfinite_steps} steps in a row had no finite update (trainer.max_nonfinite_steps="
                f"{limit}), so the run stops. Lower actor.optim.lr, set actor.optim.clip_grad, or check the "
                f"rewards; resume from the last checkpoint in {self.run_dir / 'checkpoints'}"
            )

    def save(self) -> None:
        extra = {"step": self.step, "data": self.data_position()}
        self.workers.call(
            "checkpoint.save",
            str(self.run_dir / "checkpoints"),
            self.step,
            extra,
            self.cfg.trainer.keep_checkpoints,
        )

    def keep_if_best(self, validation: dict[str, float]) -> bool:
        """trainer.keep_best: when `validation` is the best so far on trainer.best_metric, save this
        step's checkpoint as RUN/checkpoints/best (diffrl.train.best_checkpoint); whether it did."""
        if self.best is None:
            return False
        metric = self.cfg.trainer.best_metric
        metric = validation_score_key(validation) if metric == "auto" else metric
        score = self.best.beaten_by(validation, metric)
        if score is None:
            return False
        root = self.run_dir / "checkpoints"
        extra = {
            "step": self.step,
            "data": self.data_position(),
            "best": {"metric": metric, "score": score, "step": self.step},
        }
        with self.timer.phase("checkpoint"), progress(f"best checkpoint of step {self.step}"):
            staged = self.workers.call("checkpoint.save", str(staging_root(root)), self.step, extra, 1)[0]
            publish_best(root, staged)
        self.best.kept(metric, score, self.step)
        return True

    def validate(self) -> dict[str, float]:
        """ODE samples of the validation prompts with the fixed validation seed: rewards and a grid.

        The samplers validate the trainer's current weights: every batch still sampling ahead (and
        the weight deliveries queued between them) finishes first, with the weights it started
        with, then the samplers receive this step's (`RolloutPipeline.sync_for_validation`)."""
        self.pipeline.sync_for_validation(self.step)
        metrics = run_validation(
            self.cfg,
            self.placement.samplers,
            self.rewards,
            self.val_records,
            self.run_dir,
            self.step,
            self.logger,
        )
        self.last_validation_step = self.step
        return metrics

    def summary(self, final_validation: dict[str, float]) -> dict[str, Any]:
        """What summary.json records at the end of the run."""
        summary = {
            "steps": self.step,
            **self.run_stats(),
            "validation_step": self.last_validation_step,
            "validation": final_validation,
            "health": self.health.first_onsets(),  # {signal: the step it started}
        }
        if self.best is not None and self.best.record is not None:
            record = self.best.record
            summary["best"] = {"metric": record.metric, "score": record.score, "step": record.step}
        if self.stopped is not None:
            summary["stopped"] = self.stopped
        return summary


__all__ = ["NonFiniteError", "TrainingLoop"]
