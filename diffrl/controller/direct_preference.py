"""The single-controller direct-preference loop: DiffusionNFT, AWM and Diffusion-DPO.

These methods train on clean samples at fresh noise levels (the forward process), not on SDE
transitions, so no log-probabilities are recomputed. One step reads top to bottom:

    prompts      B prompts (online) or B preference rows (offline) from the data sampler
    gen          online: every worker samples n images per prompt, DiffusionNFT with the `old`
                 adapter, AWM and DPO with the trained one; each decoded micro-batch goes to the
                 reward workers at once
    reward       gather the scores; NFT/AWM: grouped advantages; DPO: each group's best and worst
                 sample become a pair (a group whose rewards all tie gives none)
    update_actor mini-batches of whole prompt groups (or pairs) × epochs, each split over the
                 workers in micro-batches, one optimizer step per mini-batch:
                   NFT/AWM  each sample at a random `timestep_fraction` of the rollout schedule's
                            noise levels, fresh noise (diffrl.train.preference)
                   DPO      one logit-normal noise level and noise per pair, shared by its samples
    old policy   every `algorithm.old_policy.update_interval` optimizer steps the `old` adapter
                 moves toward the trained one: old ← d·old + (1 − d)·θ (NFT; AWM's EMA KL)
    validation   every `test_freq` steps: ODE samples with fixed seeds, rewards, an image grid
    checkpoint   every `save_freq` steps and at the end: weights (the `old` adapter too), optimizer,
                 data position

Offline DPO (`algorithm.sample_source=offline`) reads pairs from the train files (a prompt and two
image files per row, diffrl.data.preference); the images and prompts are encoded once before the
first step and cached in the run directory, so a resumed run does not encode them again.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from diffrl.algos import (
    DIRECT_PREFERENCE,
    PAIRS,
    DirectPreferenceSpec,
    advantage_metrics,
    algorithm,
    algorithms,
    get_advantage_estimator,
    uses_old_adapter,
)
from diffrl.algos.dpo import preference_pairs
from diffrl.algos.nft import old_policy_decay
from diffrl.config.schema import Config
from diffrl.controller.loop import TrainingLoop
from diffrl.controller.minibatches import mini_batches
from diffrl.data.images import load_image_rows
from diffrl.data.preference import (
    CACHE_DIR,
    CACHE_FILE,
    encodings_fingerprint,
    load_encodings,
    pair_paths,
    save_encodings,
)
from diffrl.models.base import PromptEmbeds
from diffrl.telemetry import peak_over_workers
from diffrl.train.engine import OLD, POLICY
from diffrl.train.preference import CleanBatch, PairBatch, conditional, join_worker_metrics
from diffrl.transition import Rollout
from diffrl.workers.reward_workers import gather as gather_rewards

_ENCODE_CHUNK = 256  # images read and sent to the workers at a time while building the cache


class DirectPreferenceTrainer(TrainingLoop):
    """Runs `cfg` (algorithm.trainer_type=direct_preference) on `workers` (see the module docstring)."""

    def __init__(self, cfg: Config, run_dir: Path, **loop_args: Any):
        super().__init__(cfg, run_dir, **loop_args)
        self.spec = algorithm(cfg.actor.loss.mode)
        if not isinstance(self.spec, DirectPreferenceSpec):
            raise ValueError(
                f"actor.loss.mode={self.spec.name!r} is not a direct-preference loss: choose one of "
                f"{[s.name for s in algorithms(DIRECT_PREFERENCE)]}, or algorithm.trainer_type=policy_gradient"
            )
        self.offline = cfg.algorithm.sample_source == "offline"
        self.estimator = get_advantage_estimator(cfg.algorithm.adv_estimator)
        self.with_old = uses_old_adapter(cfg.actor.loss)
        self.sampling_policy = OLD if self.spec.samples_with_old else POLICY
        self.optim_steps: int | None = None  # the engine's count, read from the workers on first use
        self.last_decay: float | None = None
        self.skipped_steps = 0.0
        self.encodings: dict[str, torch.Tensor] | None = None  # offline: the cached encodings
        self.prompt_table: PromptEmbeds | None = None  # offline: the prompts' conditioning rows
        self.train_records = list(loop_args["train_records"])

    # ------------------------------------------------------------------------------ run
    def fit(self) -> dict[str, float]:
        if self.offline and self.encodings is None:
            self.encodings = self._offline_encodings()
            self.prompt_table = _prompt_embeds_from(self.encodings)
        return super().fit()

    def train_step(self) -> dict[str, float]:
        self.timer.reset()
        if self.offline:
            batch = self.sampler.next_batch()
            metrics = self._offline_step([index for index, _ in batch])
            images = 2 * len(batch)
        else:
            metrics, images = self._online_step()
        metrics.update(self.timer.metrics(images, self.placement.gpus))
        metrics.update(peak_over_workers(self.workers.call("report.memory")))
        metrics["train/epoch"] = float(self.sampler.state_dict()["epoch"])
        return metrics

    # ------------------------------------------------------------------------------ online
    def _online_step(self) -> tuple[dict[str, float], int]:
        cfg = self.cfg
        with self.timer.phase("gen"):
            _, staged, sampling_metrics = self.rollout_for_step(self.sampling_policy)
            rollout = staged.fetch()  # these losses build their batches here, from clean latents
        with self.timer.phase("reward"):
            scores = gather_rewards(rollout.extras.pop("reward_handles"), self.cfg.trainer.worker_timeout_s)
        sample_uids = rollout.sample_uids()
        metrics = scores.metrics(sample_uids)
        metrics.update(sampling_metrics)
        with self.timer.phase("update_actor"):
            if self.spec.trains_on == PAIRS:
                chosen_P, rejected_P = preference_pairs(scores.total_B, sample_uids)
                metrics["dpo/pairs"] = float(len(chosen_P))
                metrics.update(self._update_pairs(self._rollout_pairs(rollout, chosen_P, rejected_P)))
            else:
                advantages = self.estimator(scores.total_B, sample_uids, cfg.algorithm).float()
                metrics.update(advantage_metrics(advantages))
                metrics.update(self._update_samples(rollout, advantages))
        return metrics, len(rollout)

    def _update_samples(self, rollout: Rollout, advantages_B: torch.Tensor) -> dict[str, float]:
        """NFT/AWM: mini-batches of whole prompt groups, shuffled per (seed, step, epoch), split
        evenly over the workers in micro-batches; one optimizer step each."""
        cfg, world = self.cfg, self.workers.size
        samples, table = rollout.samples, rollout.prompt_embeds
        sums: dict[str, float] = defaultdict(float)
        count = 0
        for mini in mini_batches(cfg, len(rollout) // cfg.rollout.n, self.step):
            shards = [
                [
                    CleanBatch(
                        latents=samples.final_latents[part].clone(),
                        cond=table[samples.prompt_index_B[part]],
                        advantages_B=advantages_B[part].clone(),
                        sample_index_B=samples.sample_index_B[part].clone(),
                    )
                    for part in worker
                ]
                for worker in mini.shards(world, cfg.actor.micro_batch_size)
            ]
            results = self.workers.scatter(
                "forward_process_backward", shards, seed=cfg.trainer.seed, step=self.step, epoch=mini.epoch
            )
            self._accumulate(sums, results)
            count += 1
        return self._means(sums, count)

    def _rollout_pairs(
        self, rollout: Rollout, chosen_P: torch.Tensor, rejected_P: torch.Tensor
    ) -> list[tuple[int, torch.Tensor, torch.Tensor, PromptEmbeds, int]]:
        """(group, chosen latents, rejected latents, conditioning row, key) of each pair; the key
        is the chosen sample's index, unique within the step."""
        samples, table, n = rollout.samples, rollout.prompt_embeds, self.cfg.rollout.n
        return [
            (
                int(c) // n,
                samples.final_latents[int(c)],
                samples.final_latents[int(r)],
                table[int(samples.prompt_index_B[int(c)])],
                int(samples.sample_index_B[int(c)]),
            )
            for c, r in zip(chosen_P.tolist(), rejected_P.tolist(), strict=True)
        ]

    # ------------------------------------------------------------------------------ offline
    def _offline_step(self, rows: Sequence[int]) -> dict[str, float]:
        """DPO on B dataset rows: each row is a pair, its own group (rollout.n = 2 images)."""
        enc, cond = self.encodings, self.prompt_table
        assert enc is not None and cond is not None  # fit() loads them before the first step
        pairs = [
            (i, enc["chosen"][row], enc["rejected"][row], cond[int(enc["prompt_index"][row])], i)
            for i, row in enumerate(rows)
        ]
        with self.timer.phase("update_actor"):
            metrics = self._update_pairs(pairs)
        metrics["dpo/pairs"] = float(len(pairs))
        return metrics

    def _offline_encodings(self) -> dict[str, torch.Tensor]:
        """Every row's chosen/rejected latents and every prompt's conditioning, from the run's cache
        when it was computed from the same data and model, else encoded by the workers and cached."""
        cfg, pipe = self.cfg, self.cfg.rollout.pipeline
        records = self.train_records
        # preflight checked every file (check_pairs); here only the paths are needed
        pairs = [pair_paths(r, cfg.data.chosen_key, cfg.data.rejected_key) for r in records]
        prompts = list(dict.fromkeys(r.prompt for r in records))
        fingerprint = encodings_fingerprint(
            pairs,
            prompts,
            model=cfg.model.path,
            dtype=cfg.model.dtype,
            size=[pipe.height, pipe.width],
            max_sequence_length=pipe.max_sequence_length,
        )
        path = self.run_dir / CACHE_DIR / CACHE_FILE
        cached = load_encodings(path, fingerprint)
        if cached is not None:
            print(f"reusing the cached preference encodings in {path}")
            return cached
        with self.timer.phase("encode"):
            tensors: dict[str, torch.Tensor] = {}
            for column, side in (("chosen", 0), ("rejected", 1)):
                tensors[column] = self._encode_images([str(pair[side]) for pair in pairs])
            index = {p: i for i, p in enumerate(prompts)}
            tensors["prompt_index"] = torch.tensor([index[r.prompt] for r in records], dtype=torch.long)
            embeds = self.workers.call("encode_prompt_rows", prompts)[0]
            for f in fields(PromptEmbeds):
                value = getattr(embeds, f.name)
                if isinstance(value, torch.Tensor):
                    tensors[f"prompt.{f.name}"] = value
        save_encodings(path, tensors, fingerprint)
        print(f"encoded {len(pairs)} preference pairs and {len(prompts)} prompts into {path}")
        return tensors

    def _encode_images(self, paths: Sequence[str]) -> torch.Tensor:
        """fp32 latents of the image files, read here and encoded by the workers in even shares (every
        worker runs the same number of VAE calls, so sharded models stay in step)."""
        pipe, world = self.cfg.rollout.pipeline, self.workers.size
        parts = []
        for start in range(0, len(paths), _ENCODE_CHUNK):
            chunk = list(paths[start : start + _ENCODE_CHUNK])
            pixels = torch.from_numpy(
                load_image_rows("files", chunk, pipe.height, pipe.width, [0] * len(chunk))
            ).permute(0, 3, 1, 2)
            per_worker = -(-len(chunk) // world)
            padded = torch.cat([pixels, pixels[:1].expand(per_worker * world - len(chunk), -1, -1, -1)])
            shards = [padded[r * per_worker : (r + 1) * per_worker].contiguous() for r in range(world)]
            parts.append(torch.cat(self.workers.scatter("encode_images", shards))[: len(chunk)])
        return torch.cat(parts)

    # ------------------------------------------------------------------------------ DPO update
    def _update_pairs(
        self, pairs: Sequence[tuple[int, torch.Tensor, torch.Tensor, PromptEmbeds, int]]
    ) -> dict[str, float]:
        """DPO: mini-batches of whole groups (online: prompt groups, offline: rows); each one's pairs
        are dealt to the workers, actor.micro_batch_size / 2 pairs per micro-batch; one optimizer
        step per mini-batch with at least one pair.

        The loss is the mean over the mini-batch's pairs: a micro-batch's weight is its share of
        them times the workers (FSDP averages gradients over workers); workers with fewer
        micro-batches run weight-0 copies, so all make the same number of forward calls.
        """
        cfg, world = self.cfg, self.workers.size
        pairs_per_micro = max(1, cfg.actor.micro_batch_size // 2)
        by_group: dict[int, list] = defaultdict(list)
        for pair in pairs:
            by_group[pair[0]].append(pair)
        groups = cfg.data.prompts_per_step  # prompt groups (online) or rows (offline, one pair each)
        sums: dict[str, float] = defaultdict(float)
        count = 0
        skipped = 0
        for mini in mini_batches(cfg, groups, self.step):
            chosen = [p for g in mini.groups for p in by_group.get(g, [])]
            if not chosen:
                skipped += 1  # every group tied: nothing to prefer, no optimizer step
                continue
            results = self.workers.scatter(
                "dpo_backward",
                _deal_pairs(chosen, world, pairs_per_micro),
                seed=cfg.trainer.seed,
                step=self.step,
                epoch=mini.epoch,
            )
            self._accumulate(sums, results)
            count += 1
        metrics = self._means(sums, count)
        metrics["actor/skipped_mini_batches"] = float(skipped)
        return metrics

    # ------------------------------------------------------------------------------ shared
    def _accumulate(self, sums: dict[str, float], results: Sequence[dict[str, float]]) -> None:
        """Step the optimizer after a mini-batch's backward, then the old policy when it is due."""
        step_metrics = self.workers.call("optim_step")[0]
        self.skipped_steps = step_metrics.pop("skipped_steps")
        for key, value in {**join_worker_metrics(results), **step_metrics}.items():
            sums[f"actor/{key}"] += value
        self._update_old_policy()

    def _means(self, sums: dict[str, float], count: int) -> dict[str, float]:
        means = {key: value / count for key, value in sums.items()} if count else {}
        if count:
            means["actor/skipped_steps"] = self.skipped_steps  # a running count, not an average
        if self.last_decay is not None:
            means["actor/old_policy_decay"] = self.last_decay
        return means

    def _update_old_policy(self) -> None:
        """After every `old_policy.update_interval` optimizer steps: old ← d·old + (1 − d)·θ, with d
        the fixed `old_policy.decay` or the named schedule at the optimizer-step count."""
        if not self.with_old:
            return
        steps = self.workers.call("report.optimizer_steps")[0]
        if steps == self.optim_steps:  # a skipped (non-finite) step
            return
        self.optim_steps = steps
        policy = self.cfg.algorithm.old_policy
        if steps % policy.update_interval:
            return
        decay = old_policy_decay(policy.decay if policy.decay is not None else policy.schedule, steps)
        self.workers.call("ema_adapter", decay, POLICY, OLD)
        self.last_decay = decay


def _deal_pairs(
    pairs: Sequence[tuple[int, torch.Tensor, torch.Tensor, PromptEmbeds, int]], world: int, per_micro: int
) -> list[list[PairBatch]]:
    """Contiguous, nearly equal shares of `pairs` per worker, cut into micro-batches of `per_micro`
    pairs; shorter workers get weight-0 micro-batches (a copy of the first pair) so that every
    worker runs the same number of them."""
    total = len(pairs)
    base, extra = divmod(total, world)
    shares, start = [], 0
    for rank in range(world):
        size = base + (rank < extra)
        shares.append(pairs[start : start + size])
        start += size
    micro_counts = [-(-len(share) // per_micro) for share in shares]
    rounds = max(micro_counts)
    out = []
    for share in shares:
        batches = [
            _pair_batch(share[s : s + per_micro], world, total) for s in range(0, len(share), per_micro)
        ]
        while len(batches) < rounds:
            batches.append(_pair_batch(pairs[:1], world, total, weight=0.0))
        out.append(batches)
    return out


def _pair_batch(
    pairs: Sequence[tuple[int, torch.Tensor, torch.Tensor, PromptEmbeds, int]],
    world: int,
    total: int,
    weight: float | None = None,
) -> PairBatch:
    return PairBatch(
        chosen_latents=torch.stack([p[1] for p in pairs]),
        rejected_latents=torch.stack([p[2] for p in pairs]),
        # dpo_backward uses the conditional rows only: drop the negatives before shipping to workers
        cond=conditional(torch.stack([p[3] for p in pairs])),
        pair_index_P=torch.tensor([p[4] for p in pairs], dtype=torch.long),
        weight=len(pairs) * world / total if weight is None else weight,
    )


def _prompt_embeds_from(tensors: dict[str, torch.Tensor]) -> PromptEmbeds:
    """The prompt table stored in the encodings cache (`prompt.<field>` keys)."""
    values = {
        f.name: tensors[f"prompt.{f.name}"] for f in fields(PromptEmbeds) if f"prompt.{f.name}" in tensors
    }
    return PromptEmbeds(**values, batch_size=[values["embeds"].shape[0]])


__all__ = ["DirectPreferenceTrainer"]
