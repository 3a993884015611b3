"""The single-controller policy-gradient loop (Flow-GRPO and its family).

The driver owns the loop and calls workers explicitly; one step reads top to bottom:

    prompts      B prompts from the data sampler, each with a uid
    gen          every worker samples n trajectories for its share of the prompts; each decoded
                 micro-batch goes to the reward workers at once (scoring overlaps sampling)
    reward       gather the scores
    advantages   grouped by uid, on the driver
    old_log_prob reuse the rollout's own log-probs when the sampler is the trained module
                 (recompute otherwise), reference means when KL is on
    update_actor mini-batches of whole prompt groups × epochs; each mini-batch is split across the
                 workers, one optimizer step per mini-batch
    weights      colocated workers share one module: nothing to copy
    validation   every `test_freq` steps: ODE samples with fixed seeds, rewards, an image grid
    checkpoint   every `save_freq` steps and at the end: weights, optimizer, data position
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from diffrl.algos import advantage_metrics, get_advantage_estimator
from diffrl.config.schema import Config
from diffrl.data import PromptRecord, PromptSampler
from diffrl.models.base import PromptEmbeds
from diffrl.rewards.workers import gather as gather_rewards
from diffrl.rollout.types import Rollout
from diffrl.seeding import SHUFFLE_STREAM, numpy_rng
from diffrl.telemetry import PhaseTimer, RunLogger, image_grid, mfu_metrics, peak_flops, save_png
from diffrl.train.engine import POLICY, REFERENCE
from diffrl.workers.group import WorkerGroup
from diffrl.workers.roles import PromptShard

VALIDATION_PROMPTS_FROM_TRAIN = 32  # validation prompts taken from the train set when no val_files


class PolicyGradientTrainer:
    """Runs `cfg` with `workers` (HybridWorkers, one per GPU or CPU worker) and `rewards`."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        *,
        workers: WorkerGroup,
        rewards: Any,
        train_records: Sequence[PromptRecord],
        val_records: Sequence[PromptRecord],
        logger: RunLogger,
        reuse_rollout_log_probs: bool,
    ):
        self.cfg = cfg
        self.run_dir = run_dir
        self.workers = workers
        self.rewards = rewards
        self.logger = logger
        self.sampler = PromptSampler(
            list(train_records), cfg.data.prompts_per_step, seed=cfg.data_seed, shuffle=cfg.data.shuffle
        )
        self.val_records = list(val_records)
        self.reuse_rollout_log_probs = reuse_rollout_log_probs
        self.estimator = get_advantage_estimator(cfg.algorithm.adv_estimator)
        self.step = 0
        self.last_validation_step: int | None = None
        self.timer = PhaseTimer()
        self.peak = peak_flops(torch.device("cuda")) if torch.cuda.is_available() else None

    # ------------------------------------------------------------------------------ run
    def resume(self, checkpoint: Path) -> None:
        extras = self.workers.call("load", str(checkpoint))
        extra = extras[0]
        self.step = int(extra["step"])
        self.sampler.load_state_dict(extra["data"])
        print(f"resumed from {checkpoint} at step {self.step}")

    def fit(self) -> dict[str, float]:
        cfg = self.cfg.trainer
        last_val: dict[str, float] = {}
        if self.step == 0 and cfg.val_before_train and cfg.test_freq > 0 and self.val_records:
            last_val = self.validate()
            self.logger.log(0, last_val)
        while self.step < cfg.total_steps:
            self.step += 1
            metrics = self.train_step()
            if cfg.test_freq and self.step % cfg.test_freq == 0 and self.val_records:
                with self.timer.phase("validation"):
                    last_val = self.validate()
                metrics.update(last_val)
                metrics.update(self.timer.metrics(0, 1, only=("validation",)))
            if self.step == cfg.total_steps or (cfg.save_freq and self.step % cfg.save_freq == 0):
                with self.timer.phase("checkpoint"):
                    self.save()
                metrics.update(self.timer.metrics(0, 1, only=("checkpoint",)))
            self.logger.log(self.step, metrics)
        return last_val

    def save(self) -> None:
        extra = {"step": self.step, "data": self.sampler.state_dict()}
        self.workers.call(
            "save", str(self.run_dir / "checkpoints"), self.step, extra, self.cfg.trainer.keep_checkpoints
        )

    # ------------------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, float]:
        cfg, world = self.cfg, self.workers.size
        self.timer.reset()
        batch = self.sampler.next_batch()
        records = [record for _, record in batch]
        uids = [f"{self.step}:{i}" for i in range(len(records))]

        with self.timer.phase("gen"):
            rollout = self._sample(records, uids)
        with self.timer.phase("reward"):
            scores = gather_rewards(rollout.extras.pop("reward_handles"))
        metrics = scores.metrics(rollout.sample_uids())
        advantages = self.estimator(scores.total_B, rollout.sample_uids(), cfg.algorithm)
        rollout.samples.advantages_B = advantages.float()
        metrics.update(advantage_metrics(advantages))

        if not self.reuse_rollout_log_probs:
            with self.timer.phase("old_log_prob"):
                rollout.samples.old_log_probs_BW = self._log_probs(rollout, POLICY)[0]
            gap = (rollout.samples.old_log_probs_BW - rollout.samples.log_probs_BW).abs()
            metrics["rollout_correction/abs_logp_diff_mean"] = float(gap.mean())
            metrics["rollout_correction/abs_logp_diff_max"] = float(gap.max())
        if cfg.actor.loss.kl_coef > 0:
            with self.timer.phase("ref"):
                rollout.samples.ref_means = self._log_probs(rollout, REFERENCE)[1]

        with self.timer.phase("update_actor"):
            metrics.update(self._update(rollout))

        images = len(rollout)
        metrics.update(self.timer.metrics(images, world))
        if self.peak is not None:
            flops = self._flops(rollout)
            metrics.update(
                mfu_metrics(
                    flops, self.timer.seconds(), world, self.peak, step_seconds=metrics["timing_s/step"]
                )
            )
        metrics.update(self.workers.call("memory")[0])
        metrics["train/epoch"] = float(self.sampler.state_dict()["epoch"])
        return metrics

    def _sample(self, records: Sequence[PromptRecord], uids: Sequence[str]) -> Rollout:
        """Each worker samples whole prompt groups; their micro-batches are scored as they decode."""
        world = self.workers.size
        per_worker = len(records) // world
        n = self.cfg.rollout.n
        shards = [
            _shard(
                records[rank * per_worker : (rank + 1) * per_worker],
                uids[rank * per_worker :],
                rank * per_worker * n,
                self.cfg.rollout.pipeline.negative_prompt,
            )
            for rank in range(world)
        ]
        rollouts = self.workers.scatter(
            "sample_and_score", shards, seed=self.cfg.rollout_seed, step=self.step, rewards=self.rewards
        )
        return concat_rollouts(rollouts)

    def _log_probs(self, rollout: Rollout, policy: str) -> tuple[torch.Tensor, torch.Tensor]:
        parts = self.workers.scatter("log_probs", split_even(rollout, self.workers.size), policy=policy)
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def _update(self, rollout: Rollout) -> dict[str, float]:
        """Mini-batches of whole prompt groups, shuffled per (seed, step, epoch); one optimizer step each."""
        cfg = self.cfg
        n, mini, micro = cfg.rollout.n, cfg.actor.mini_batch_size, cfg.actor.micro_batch_size
        groups = len(rollout) // n
        sums: dict[str, float] = defaultdict(float)
        count = 0
        for epoch in range(cfg.actor.epochs):
            order = (
                numpy_rng(SHUFFLE_STREAM, cfg.trainer.seed, self.step, epoch).permutation(groups)
                if cfg.actor.shuffle
                else range(groups)
            )
            samples = torch.tensor([g * n + j for g in order for j in range(n)])
            for start in range(0, len(samples), mini):
                mini_batch = rollout.select(samples[start : start + mini])
                shards = [
                    [shard.select(slice(s, s + micro)).compact() for s in range(0, len(shard), micro)]
                    for shard in split_even(mini_batch, self.workers.size)
                ]
                results = self.workers.scatter("forward_backward", shards)
                step_metrics = self.workers.call("optim_step")[0]
                for key, value in {**results[0], **step_metrics}.items():
                    sums[f"actor/{key}"] += value
                count += 1
        means = {key: value / count for key, value in sums.items()}
        means["actor/skipped_steps"] = step_metrics["skipped_steps"]  # a running count, not an average
        return means

    # ------------------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """ODE samples of the validation prompts with the fixed validation seed: rewards and a grid."""
        records, world, n = self.val_records, self.workers.size, self.cfg.rollout.val.n
        # Every worker must run the same number of forwards (FSDP gathers weights collectively), so
        # the prompt list is padded to a multiple of the workers by repeating it; the padding is
        # dropped from the result.
        per_worker = math.ceil(len(records) / world)
        padded = [records[i % len(records)] for i in range(per_worker * world)]
        negative = self.cfg.rollout.pipeline.negative_prompt
        payloads = [
            _shard(
                padded[rank * per_worker : (rank + 1) * per_worker],
                [f"val:{i}" for i in range(rank * per_worker, (rank + 1) * per_worker)],
                rank * per_worker * n,
                negative,
            )
            for rank in range(world)
        ]
        rollouts = self.workers.scatter("validate_and_score", payloads, rewards=self.rewards)
        rollout = concat_rollouts(rollouts)
        handles = rollout.extras.pop("reward_handles")
        keep = len(records) * n
        rollout = rollout.select(slice(0, keep))
        scores = gather_rewards(handles).select(slice(0, keep))
        metrics = {f"val/{key}": value for key, value in scores.metrics(rollout.sample_uids()).items()}
        sources = [m.get("data_source", "default") for m in rollout.sample_metadata()]
        for source in sorted(set(sources)):
            mask = torch.tensor([s == source for s in sources])
            metrics[f"val/{source}/reward_mean"] = float(scores.total_B[mask].mean())
        self.last_validation_step = self.step
        pixels = rollout.samples.pixels
        grid = image_grid(pixels[:64], nrow=min(8, len(pixels)))
        path = self.run_dir / "validation" / f"step_{self.step:06d}.png"
        save_png(path, grid)
        self.logger.log_images(self.step, "val/samples", grid)
        return metrics

    def _flops(self, rollout: Rollout) -> dict[str, float]:
        """Model FLOPs of this step's phases, from the adapter's analytic count (via a worker)."""
        return self.workers.call(
            "phase_flops", len(rollout), rollout.window_size, not self.reuse_rollout_log_probs
        )[0]


# ------------------------------------------------------------------------------ helpers
def _negatives(records: Sequence[PromptRecord], default: str) -> list[str] | None:
    """Per-prompt negatives when any row has one; None lets the sampler apply the configured default."""
    if not any(r.negative_prompt for r in records):
        return None
    return [r.negative_prompt or default for r in records]


def _shard(
    records: Sequence[PromptRecord], uids: Sequence[str], sample_offset: int, negative: str
) -> PromptShard:
    return PromptShard(
        prompts=[r.prompt for r in records],
        uids=list(uids[: len(records)]),
        metadata=[dict(r.metadata) for r in records],
        negative_prompts=_negatives(records, negative),
        sample_offset=sample_offset,
    )


def split_even(rollout: Rollout, parts: int) -> list[Rollout]:
    """`parts` consecutive, equal slices (the config guarantees divisibility)."""
    size = len(rollout) // parts
    return [rollout.select(slice(i * size, (i + 1) * size)).compact() for i in range(parts)]


def concat_rollouts(rollouts: Sequence[Rollout]) -> Rollout:
    """Join workers' rollouts of the same step: samples, prompt tables (re-indexed), reward handles."""
    if len(rollouts) == 1:
        return rollouts[0]
    first = rollouts[0]
    offsets, total = [], 0
    for r in rollouts:
        offsets.append(total)
        total += len(r.prompts)
    samples = []
    for r, offset in zip(rollouts, offsets, strict=True):
        s = r.samples.clone()
        s.prompt_index_B = s.prompt_index_B + offset
        samples.append(s)
    embeds = _cat_prompt_embeds([r.prompt_embeds for r in rollouts])
    return replace(
        first,
        samples=torch.cat(samples),
        prompt_embeds=embeds,
        prompts=[p for r in rollouts for p in r.prompts],
        uids=[u for r in rollouts for u in r.uids],
        metadata=[m for r in rollouts for m in r.metadata],
        extras={"reward_handles": [h for r in rollouts for h in r.extras.get("reward_handles", [])]},
    )


def _cat_prompt_embeds(parts: Sequence[PromptEmbeds]) -> PromptEmbeds:
    """Concatenate prompt tables whose text lengths may differ: each worker pads its own prompts to
    their longest (Qwen-Image), so right-pad with zeros to the longest overall and extend the masks
    with zeros (padded keys are masked out, so the model computes the same thing)."""
    lengths = {p.embeds.shape[1] for p in parts} | {
        p.negative_embeds.shape[1] for p in parts if p.negative_embeds is not None
    }
    if len(lengths) == 1:
        return torch.cat(list(parts))
    if any(p.mask is None for p in parts):
        raise ValueError(
            f"workers returned prompt embeddings of different text lengths {sorted(lengths)} without "
            "attention masks: this family must pad every prompt to rollout.pipeline.max_sequence_length"
        )
    length = max(lengths)
    padded = []
    for p in parts:
        negative = p.negative_embeds is not None
        padded.append(
            PromptEmbeds(
                embeds=_pad_tokens(p.embeds, length),
                mask=_pad_tokens(p.mask, length),
                pooled=p.pooled,
                negative_embeds=_pad_tokens(p.negative_embeds, length) if negative else None,
                negative_mask=_pad_tokens(p.negative_mask, length) if negative else None,
                negative_pooled=p.negative_pooled,
                batch_size=p.batch_size,
            )
        )
    return torch.cat(padded)


def _pad_tokens(values: torch.Tensor, length: int) -> torch.Tensor:
    """Right-pad dim 1 (tokens) with zeros to `length`."""
    pad = [0, 0] * (values.dim() - 2) + [0, length - values.shape[1]]
    return torch.nn.functional.pad(values, pad)


def write_json(path: Path, payload: dict) -> None:
    """Atomically: a crash never leaves half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(path)
