"""Worker roles: plain classes that a Ray actor (or a test, in-process) hosts, one per GPU.

    RolloutWorker    a sampler on its own copy of the model (weights arrive by `receive_weights`);
                     in diffrl.workers.rollout_worker, re-exported here
    ActorWorker      the training engine
    HybridWorker     actor and sampler sharing one module in one process: no weight copy at all

Colocation is the controller's placement decision: it picks HybridWorker, or (the separate
placement, diffrl.controller.placement) ActorWorker ranks plus RolloutWorker replicas in their
own processes, the actor's `weights.send` feeding the replicas' `receive_weights` over
diffrl.workers.weight_sync; the classes carry no flags about it. Each role builds its model
from the config inside its own process, so nothing large crosses the controller.

A training worker is a thin RPC surface over parts that each own one concern:

    staging      the step's rollout held here and the policy-gradient passes over it
                 (diffrl.workers.staging.StagedStep; reached through the worker's `stage`,
                 `staged_log_probs`, `stage_targets`, `staged_forward_backward`)
    weights      the weight source of a sync: address, join, specs, send, snapshot, digest
                 (diffrl.workers.weight_source)
    checkpoint   save, load, export (diffrl.workers.checkpointing)
    report       memory, phase FLOPs, optimizer steps (diffrl.workers.reporting)

The worker's own methods are the step's calls; the parts in `PARTS` are addressed by the
controller as `"part.method"` (diffrl.workers.group: `trainer.call("checkpoint.save", ...)`).
The math lives elsewhere: policy-gradient and flow-matching updates in `diffrl.train.engine`, the
forward-process losses in `diffrl.train.preference`, SFT's draws in `diffrl.algos.sft_batch`,
FLOPs accounting in `diffrl.telemetry.perf`, export in `diffrl.train.export`. Every role can run a
step under the profiler (`start_profile` / `stop_profile`, diffrl.telemetry.profiling); the methods
marked `@profiled_call` are the calls its summary reports.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from diffrl.config.plan import RunPlan
from diffrl.config.schema import Config
from diffrl.models.base import ModelAdapter
from diffrl.telemetry.profiling import ProfiledWorker, profiled_call
from diffrl.train.batch import TrainingTargets
from diffrl.train.engine import POLICY, REFERENCE, TrainEngine
from diffrl.transition import Rollout, RolloutSummary
from diffrl.workers.checkpointing import Checkpointing
from diffrl.workers.reporting import Reporting
from diffrl.workers.rollout_worker import PromptShard, RolloutWorker, build_adapter, worker_device
from diffrl.workers.staging import StagedStep
from diffrl.workers.weight_source import InPlaceWeights, WeightSource


@dataclass(frozen=True)
class ImageShard:
    """One worker's share of a supervised step: B images with their prompts. `sample_offset` is the
    step-wide index of its first image, keying the per-sample noise like `PromptShard`'s."""

    prompts: list[str]
    pixels: torch.Tensor  # uint8 [B, 3, H, W]
    sample_offset: int
    # image-edit models: each image's condition images (Pillow RGB), what its prompt edits
    conditions: list[list[Any]] | None = None


# Prompt embeddings kept per worker for supervised training; a dataset's prompts repeat every epoch.
_PROMPT_CACHE_SIZE = 4096


def join_process_group() -> None:
    """Form the workers' torch.distributed group from the env vars the WorkerGroup set."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
        from diffrl.train.distributed import init_distributed

        init_distributed()


class ActorWorker(ProfiledWorker):
    """The training engine in a worker process (the module docstring: its parts)."""

    # the parts the controller addresses as "part.method" (diffrl.workers.group)
    PARTS: ClassVar[Mapping[str, type]] = {
        "weights": WeightSource,
        "checkpoint": Checkpointing,
        "report": Reporting,
    }

    def __init__(
        self,
        cfg: Config,
        adapter: ModelAdapter | None = None,
        *,
        with_old: bool = False,
        with_reference: bool | None = None,
        plan: RunPlan | None = None,
    ):
        """`plan`: the run's plan (diffrl.config.plan), whose decisions the engine takes; None for
        a worker built alone (the engine then resolves actor.strategy for its process group)."""
        join_process_group()
        self.cfg = cfg
        adapter = adapter or build_adapter(cfg)
        mini_batches = cfg.images_per_step // cfg.actor.mini_batch_size
        self.engine = TrainEngine(
            adapter,
            cfg.model,
            cfg.actor,
            total_optim_steps=cfg.trainer.total_steps * mini_batches * cfg.actor.epochs,
            with_old=with_old,
            with_reference=with_reference,
            seed=cfg.trainer.seed,
            strategy=None if plan is None else plan.strategy,
        )
        if cfg.model.compile:  # after LoRA injection and sharding, so the compiled blocks include them
            adapter.compile_blocks()
        from diffrl.train.sequence_parallel import for_training

        # Ulysses SP (None at size 1): attached only while training, so the module samples without it
        self.staging = StagedStep(self.engine, for_training(adapter, cfg, self.engine.strategy))
        self.weights = WeightSource(self.engine, cfg)
        self.checkpoint = Checkpointing(self.engine, cfg)
        self.report = Reporting(self.engine, cfg, self.staging)
        # Supervised training only (`flow_matching_backward`): filled on first use.
        self._training_sigmas: torch.Tensor | None = None
        self._prompt_cache: dict[str, Any] = {}

    @profiled_call
    def flow_matching_backward(self, shard: ImageShard, *, seed: int, step: int) -> dict[str, float]:
        """Accumulate the supervised flow-matching gradient of a shard of images (`diffrl sft`);
        each image's prompt dropout, noise level and noise: `diffrl.algos.sft_batch`."""
        from diffrl.algos.sft_batch import supervised_draws, training_sigmas
        from diffrl.train.engine import FlowMatchingBatch

        if self.staging.sequence_parallel is not None:
            raise ValueError("diffrl sft does not run sequence-parallel: set actor.sequence_parallel_size=1")
        cfg, adapter = self.cfg, self.engine.adapter
        height, width = int(shard.pixels.shape[-2]), int(shard.pixels.shape[-1])
        if self._training_sigmas is None:
            self._training_sigmas = training_sigmas(adapter.scheduler_config)
        latents = adapter.encode(shard.pixels)
        draws = supervised_draws(
            len(shard.prompts),
            latents.shape[1:],
            self._training_sigmas,
            cfg.sft,
            seed=seed,
            step=step,
            sample_offset=shard.sample_offset,
        )
        sigmas_B, noise = draws.sigmas_B.to(adapter.device), draws.noise.to(adapter.device)
        prompts = ["" if drop else p for p, drop in zip(shard.prompts, draws.dropped, strict=True)]
        if adapter.condition_rule is None:
            cond = self._prompt_embeds(prompts)
        elif shard.conditions is None:
            raise ValueError(
                f"{adapter.pipeline_class_name} edits images: supervised training needs each image's "
                "condition image (the rows' data.image_key images, or sft.images=shapes_edit)"
            )
        else:  # each image its own condition (a fresh rendering, or a row's file): no cache
            cond = adapter.encode_conditioned(
                prompts, None, self.cfg.rollout.pipeline.max_sequence_length, shard.conditions
            )
        micro = cfg.actor.micro_batch_size
        batches = [
            FlowMatchingBatch(
                latents[s : s + micro],
                noise[s : s + micro],
                sigmas_B[s : s + micro],
                cond[s : s + micro],
                height,
                width,
            )
            for s in range(0, len(latents), micro)
        ]
        metrics = self.engine.flow_matching_backward(batches, cfg.sft.weighting_scheme)
        metrics["prompt_dropout_frac"] = sum(draws.dropped) / len(draws.dropped)
        return metrics

    def _prompt_embeds(self, prompts: Sequence[str]):
        """One conditioning row per prompt; each distinct prompt is encoded once and cached."""
        cache = self._prompt_cache
        missing = list(dict.fromkeys(p for p in prompts if p not in cache))
        if missing:
            if len(cache) + len(missing) > _PROMPT_CACHE_SIZE:
                cache.clear()
            encoded = self.engine.adapter.encode_prompts(
                missing, None, max_sequence_length=self.cfg.rollout.pipeline.max_sequence_length
            )
            for i, prompt in enumerate(missing):
                cache[prompt] = encoded[i : i + 1]
        return torch.cat([cache[p] for p in prompts])

    @profiled_call
    def optim_step(self) -> dict[str, float]:
        return self.engine.optim_step()

    # ------------------------------------------------------------ direct preference (NFT, AWM, DPO)
    def _velocity_call(self):
        from diffrl.train.preference import VelocityCall

        pipe = self.cfg.rollout.pipeline
        return VelocityCall(
            pipe.height, pipe.width, pipe.num_frames, pipe.guidance_scale, pipe.true_cfg_scale
        )

    @profiled_call
    def forward_process_backward(self, micro_batches: Sequence[Any], *, seed: int, step: int, epoch: int):
        """NFT/AWM: accumulate the gradient of this worker's clean samples (`CleanBatch`es), each at
        a random `algorithm.timestep_fraction` of the rollout schedule's noise levels (those of the
        steps in `algorithm.train_step_range`, or all)."""
        from diffrl.train.preference import forward_process_backward

        cfg, adapter = self.cfg, self.engine.adapter
        pipe = cfg.rollout.pipeline
        # σ_0..σ_{N-1} of the schedule the rollout sampled with (the final σ = 0 is no noise level)
        sigmas = adapter.schedule(pipe.num_inference_steps, pipe.height, pipe.width, pipe.num_frames).sigmas
        lo, hi = cfg.algorithm.train_step_range or (0, pipe.num_inference_steps)
        return forward_process_backward(
            self.engine,
            micro_batches,
            call=self._velocity_call(),
            sigma_table=sigmas[lo:hi],
            fraction=cfg.algorithm.timestep_fraction,
            adv_mode=cfg.algorithm.adv_mode,
            seed=seed,
            step=step,
            epoch=epoch,
        )

    @profiled_call
    def dpo_backward(self, micro_batches: Sequence[Any], *, seed: int, step: int, epoch: int):
        """DPO: accumulate the gradient of this worker's preference pairs (`PairBatch`es)."""
        from diffrl.train.preference import dpo_backward

        return dpo_backward(
            self.engine, micro_batches, call=self._velocity_call(), seed=seed, step=step, epoch=epoch
        )

    @torch.no_grad()
    @profiled_call
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 [B, 3, H, W] -> fp32 latents on the CPU (VAE posterior mode, or pixel space),
        `actor.micro_batch_size` images at a time."""
        micro = self.cfg.actor.micro_batch_size
        adapter = self.engine.adapter
        return torch.cat([adapter.encode(pixels[s : s + micro]).cpu() for s in range(0, len(pixels), micro)])

    @torch.no_grad()
    @profiled_call
    def encode_prompt_rows(self, prompts: Sequence[str]):
        """One conditioning row per prompt on the CPU, without negatives (DPO's conditional velocity)."""
        return self.engine.adapter.encode_prompts(
            list(prompts), None, max_sequence_length=self.cfg.rollout.pipeline.max_sequence_length
        ).to("cpu")

    # -------------------- the step's rollout, held here (policy gradient): the staging part's calls
    def stage(self, parts: Sequence[Any], first_row: int = 0) -> None:
        """`StagedStep.stage`: this rank's rows of the step's rollout, from row `first_row`."""
        self.staging.stage(parts, first_row)

    def staged_log_probs(
        self, rows: slice, policy: str = POLICY, keep: bool = False
    ) -> tuple[torch.Tensor, Any]:
        """`StagedStep.staged_log_probs`: (log-probs on the CPU, the SDE means) of staged rows."""
        return self.staging.staged_log_probs(rows, policy, keep)

    def stage_targets(self, targets: TrainingTargets, means: Mapping[str, Sequence[Any]]) -> None:
        """`StagedStep.stage_targets`: the step's training targets and the staged rows' SDE means."""
        self.staging.stage_targets(targets, means)

    def staged_forward_backward(self, micro_rows: Sequence[torch.Tensor]) -> dict[str, float]:
        """`StagedStep.staged_forward_backward`: one micro-batch of staged rows per entry."""
        return self.staging.staged_forward_backward(micro_rows)

    def ema_adapter(self, decay: float, src: str, dst: str) -> None:
        self.engine.ema_adapter(decay, src, dst)


class HybridWorker(ActorWorker):
    """Actor and sampler on one module: new weights reach the sampler without any copy."""

    # `weights.set_version`: the sampler's module is the trained one, only its version moves
    PARTS: ClassVar[Mapping[str, type]] = {**ActorWorker.PARTS, "weights": InPlaceWeights}

    def __init__(
        self,
        cfg: Config,
        adapter: ModelAdapter | None = None,
        *,
        with_old: bool = False,
        with_reference: bool | None = None,
        plan: RunPlan | None = None,
    ):
        super().__init__(cfg, adapter, with_old=with_old, with_reference=with_reference, plan=plan)
        self.rollout = RolloutWorker(cfg, self.engine.adapter, use_policy=self.engine.inference_policy)
        self.weights = InPlaceWeights(self.engine, cfg, self.rollout)

    @profiled_call
    def sample_and_score(
        self,
        shard: PromptShard,
        *,
        seed: int,
        step: int,
        rewards: Any,
        policy: str = POLICY,
        keep: bool = False,
    ) -> tuple[RolloutSummary, Any]:
        """`RolloutWorker.sample_and_score`; with `keep` the rollout stays here and a `Kept`
        marker stands for it (the controller stages it on this rank: diffrl.workers.staging)."""
        if not keep:
            return self.rollout.sample_and_score(shard, seed=seed, step=step, rewards=rewards, policy=policy)
        summary, rollout = self.rollout.sample_scored(
            shard, seed=seed, step=step, rewards=rewards, policy=policy
        )
        return summary, self.staging.kept.keep("rollout", rollout)

    @profiled_call
    def validate_and_score(self, shard: PromptShard, *, rewards: Any) -> Rollout:
        return self.rollout.validate_and_score(shard, rewards=rewards)


__all__ = [
    "REFERENCE",
    "ActorWorker",
    "HybridWorker",
    "PromptShard",
    "RolloutWorker",
    "worker_device",
]
