"""The single-controller policy-gradient loop (Flow-GRPO and its family).

The driver owns the loop and calls workers explicitly; one step reads top to bottom:

    prompts      B prompts from the data sampler, each with a uid
    gen          the placement samples n trajectories per prompt (colocated: every worker its
                 share; separate: the replicas, request by request); each decoded micro-batch goes
                 to the reward workers at once (scoring overlaps sampling). one_step_off: this
                 batch was sampled during the previous step, and the next one starts now
                 (TrainingLoop.rollout_for_step)
    reward       gather the scores
    advantages   grouped by uid, on the driver
    old_log_prob reuse the rollout's own log-probs (and SDE means) when the sampler is the trained
                 module, recompute otherwise: then rollout-correction weights and the
                 sampler/trainer mismatch metrics; reference means when KL is on
    step subset  with algorithm.timestep_fraction < 1 (DanceGRPO) each sample trains a random
                 subset of the window steps
    update_actor mini-batches of whole prompt groups × epochs; each mini-batch is split across the
                 workers, one optimizer step per mini-batch
    weights      colocated workers share one module: nothing to copy; separate replicas receive
                 the new weights before they sample again (Placement.sync_weights)
    validation   every `test_freq` steps: ODE samples with fixed seeds, rewards, an image grid
    checkpoint   every `save_freq` steps and at the end: weights, optimizer, data position
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from diffrl.algos import PolicyGradientSpec, advantage_metrics, algorithm, get_advantage_estimator
from diffrl.algos.nft import timestep_subset, timestep_subset_mask
from diffrl.algos.rollout_correction import rollout_correction_from_config
from diffrl.config.plan import RunPlan, resolve_plan
from diffrl.config.schema import Config
from diffrl.controller.loop import TrainingLoop
from diffrl.controller.minibatches import local_owners, mini_batches
from diffrl.controller.placement import Colocated, StagedRollout
from diffrl.seeding import TIMESTEP_SUBSET_STREAM, generator
from diffrl.telemetry import mfu_metrics, peak_flops, peak_over_workers
from diffrl.train.batch import TrainingTargets
from diffrl.train.engine import POLICY, REFERENCE
from diffrl.transition import RolloutSummary
from diffrl.workers.futures import gather
from diffrl.workers.reward_workers import gather as gather_rewards

VALIDATION_PROMPTS_FROM_TRAIN = 32  # validation prompts taken from the train set when no val_files


class PolicyGradientTrainer(TrainingLoop):
    """Runs `cfg` with `workers` (HybridWorkers, one per GPU or CPU worker) and `rewards`."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        *,
        reuse_rollout_log_probs: bool,
        plan: RunPlan | None = None,
        **loop_args: Any,
    ):
        super().__init__(cfg, run_dir, **loop_args)
        self.reuse_rollout_log_probs = reuse_rollout_log_probs
        self.estimator = get_advantage_estimator(cfg.algorithm.adv_estimator)
        spec = algorithm(cfg.actor.loss.mode)
        self.needs_old_mean = isinstance(spec, PolicyGradientSpec) and spec.needs_old_mean
        rc = cfg.algorithm.rollout_correction
        self.corrects_rollout = rc.is_level != "none" or rc.rejection != "none"
        self.peak = peak_flops(torch.device("cuda")) if torch.cuda.is_available() else None
        # Colocated, a schedule stratified by the worker that sampled each group lets every worker
        # train on its own trajectories: they stay where they were made (controller.minibatches)
        colocated = isinstance(self.placement, Colocated)
        self.owners = local_owners(cfg, cfg.data.prompts_per_step, self.workers.size) if colocated else 1
        self.keep_rollouts = self.owners > 1
        # separate placement: the passes without gradient the replicas run (the run plan's; docs/async.md)
        self.rollout_passes = (plan or resolve_plan(cfg)).rollout_passes

    # ------------------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        self.timer.reset()
        with self.timer.phase("gen"):
            _, staged, sampling_metrics = self.rollout_for_step()
            # the trajectories go from the samplers to the trainer ranks (or stay on the worker that
            # sampled them, `keep_rollouts`); this process keeps the summary
            if self.keep_rollouts:
                size = len(staged.summary) // self.workers.size
                self._on_each_worker(
                    "stage", [(([part],), {"first_row": r * size}) for r, part in enumerate(staged.parts)]
                )
            else:
                self.workers.call("stage", staged.parts)
        rollout = staged.summary
        with self.timer.phase("reward"):
            scores = gather_rewards(rollout.extras.pop("reward_handles"), self.cfg.trainer.worker_timeout_s)
        metrics = scores.metrics(rollout.sample_uids())
        metrics.update(sampling_metrics)
        advantages = self.estimator(scores.total_B, rollout.sample_uids(), cfg.algorithm)
        targets = TrainingTargets(advantages_B=advantages.float(), batch_size=[len(rollout)])
        metrics.update(advantage_metrics(advantages))
        means: dict[str, list] = {}  # the SDE means the trainer ranks computed, as they hand them over

        if not self.reuse_rollout_log_probs:
            with self.timer.phase("old_log_prob"):
                old_log_probs, old_means = self._log_probs(rollout, POLICY, staged)
            targets.old_log_probs_BW = old_log_probs
            if self.needs_old_mean:
                means["old_means"] = old_means
            # weights are all 1 unless algorithm.rollout_correction turns IS or rejection on; the
            # mismatch diagnostics are logged either way
            weights, rc_metrics = rollout_correction_from_config(
                old_log_probs, rollout.log_probs_BW, cfg.algorithm.rollout_correction
            )
            targets.weights_BW = weights if self.corrects_rollout else None
            metrics.update(rc_metrics)
        if cfg.algorithm.timestep_fraction < 1.0:
            targets.train_mask_BW = self._train_mask(rollout)
        if cfg.actor.loss.kl_coef > 0:
            with self.timer.phase("ref"):
                means["ref_means"] = self._log_probs(rollout, REFERENCE, staged)[1]

        with self.timer.phase("update_actor"):
            if self.keep_rollouts:  # each worker's SDE means are its own rows' (`_log_probs`)
                self._on_each_worker(
                    "stage_targets",
                    [
                        ((targets, {k: [v[r]] for k, v in means.items()}), {})
                        for r in range(self.workers.size)
                    ],
                )
            else:
                self.workers.call("stage_targets", targets, means)
            metrics.update(self._update(len(rollout)))

        images = len(rollout)
        metrics.update(self.timer.metrics(images, self.placement.gpus))
        metrics.update(self.pool_metrics(staged.rollout_busy_s, metrics["timing_s/step"]))
        if self.peak is not None:
            flops = self._flops(rollout)
            metrics.update(
                mfu_metrics(
                    flops,
                    self.timer.seconds(),
                    self.placement.gpus,
                    self.peak,
                    step_seconds=metrics["timing_s/step"],
                )
            )
        metrics.update(peak_over_workers(self.workers.call("report.memory")))
        metrics["train/epoch"] = float(self.sampler.state_dict()["epoch"])
        return metrics

    def _train_mask(self, rollout: RolloutSummary) -> torch.Tensor:
        """DanceGRPO: each sample trains a random `timestep_fraction` of the window steps, drawn
        from its own generator (TIMESTEP_SUBSET_STREAM, seed, step, sample)."""
        gens = [
            generator("cpu", TIMESTEP_SUBSET_STREAM, self.cfg.trainer.seed, self.step, int(i))
            for i in rollout.sample_index_B
        ]
        subset = timestep_subset(rollout.window_size, self.cfg.algorithm.timestep_fraction, gens)
        return timestep_subset_mask(subset, rollout.window_size)

    def _log_probs(
        self, rollout: RolloutSummary, policy: str, staged: StagedRollout
    ) -> tuple[torch.Tensor, list]:
        """Log-probs of the staged rollout under `policy`: the replicas' when they computed them
        (`rollout.log_prob_passes`; the wait counts as the trainer's), else each trainer worker
        an equal, consecutive share of the samples; the SDE means stay handed over (object
        references under Ray), in order."""
        waited = time.perf_counter()
        computed = staged.pass_result(policy)
        if computed is not None:
            self.wait_s += time.perf_counter() - waited
            return computed
        size = len(rollout) // self.workers.size
        shares = [slice(i * size, (i + 1) * size) for i in range(self.workers.size)]
        parts = self.workers.scatter("staged_log_probs", shares, policy=policy, keep=self.keep_rollouts)
        return torch.cat([log_probs for log_probs, _ in parts]), [means for _, means in parts]

    def _on_each_worker(self, method: str, calls: list[tuple[tuple, dict]]) -> list[Any]:
        """`method(*args, **kwargs)` with each worker's own arguments, in rank order."""
        futures = [self.workers.submit(rank, method, *args, **kw) for rank, (args, kw) in enumerate(calls)]
        return gather(futures, timeout=self.cfg.trainer.worker_timeout_s)

    def _update(self, images: int) -> dict[str, float]:
        """One optimizer step per mini-batch of whole prompt groups (`trainer.minibatches`), each
        split over the workers in micro-batches of staged rows; metrics averaged over the
        optimizer steps."""
        world, micro = self.workers.size, self.cfg.actor.micro_batch_size
        sp = self.cfg.actor.sequence_parallel_size
        sums: dict[str, float] = defaultdict(float)
        count = 0
        for mini in mini_batches(self.cfg, images // self.cfg.rollout.n, self.step, self.owners):
            # the sp consecutive ranks of one sequence-parallel group train the same rows
            shards = [shard for shard in mini.shards(world // sp, micro) for _ in range(sp)]
            results = self.workers.scatter("staged_forward_backward", shards)
            step_metrics = self.workers.call("optim_step")[0]
            for key, value in {**results[0], **step_metrics}.items():
                sums[f"actor/{key}"] += value
            count += 1
        means = {key: value / count for key, value in sums.items()}
        means["actor/skipped_steps"] = step_metrics["skipped_steps"]  # a running count, not an average
        return means

    def _flops(self, rollout: RolloutSummary) -> dict[str, float]:
        """Model FLOPs of this step's phases, from the adapter's analytic count (via a worker)."""
        return self.workers.call(
            "report.phase_flops", len(rollout), rollout.window_size, not self.reuse_rollout_log_probs
        )[0]
