"""Worker roles: plain classes that a Ray actor (or a test, in-process) hosts, one per GPU.

    RolloutWorker    a sampler on its own copy of the model (weights arrive by `receive_weights`);
                     in diffrl.workers.rollout_worker, re-exported here
    ActorWorker      the training engine
    HybridWorker     actor and sampler sharing one module in one process: no weight copy at all

Colocation is the controller's placement decision: it picks HybridWorker, or (the separate
placement, diffrl.controller.placement) ActorWorker ranks plus RolloutWorker replicas in their
own processes, the actor's `send_weights` feeding the replicas' `receive_weights` over
diffrl.workers.weight_sync; the classes carry no flags about it. Each role builds its model
from the config inside its own process, so nothing large crosses the controller. The math lives
elsewhere: policy-gradient and flow-matching updates in `diffrl.train.engine`, the forward-process
losses in `diffrl.train.preference`, SFT's draws in `diffrl.algos.sft_batch`, FLOPs accounting in
`diffrl.telemetry.perf`, export in `diffrl.train.export`. Every role can run a step under the
profiler (`start_profile` / `stop_profile`, diffrl.telemetry.profiling); the methods marked
`@profiled_call` are the calls its summary reports.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from diffrl.config.plan import RunPlan
from diffrl.config.schema import Config
from diffrl.models.base import ModelAdapter
from diffrl.telemetry.profiling import ProfiledWorker, profiled_call
from diffrl.train.batch import PolicyGradientBatch, TrainingTargets
from diffrl.train.engine import POLICY, REFERENCE, TrainEngine
from diffrl.transition import Rollout, RolloutSummary, concat_rollouts
from diffrl.workers.rollout_worker import (
    PromptShard,
    RolloutWorker,
    build_adapter,
    weight_digests,
    worker_device,
)
from diffrl.workers.staging import LocalStore, StagedRows, handed_over


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
    """The training engine in a worker process."""

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
        self._sequence_parallel = for_training(adapter, cfg, self.engine.strategy)
        self._text_len = 0
        self._cond_tokens = 0
        self._weight_sync: Any = None  # rank 0's WeightSyncGroup with the replicas (separate placement)
        # rank 0, bounded staleness: weight versions copied for the replicas, not yet sent to them
        self._snapshots: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self._staged: StagedRows | None = None  # this rank's rows of the step's rollout (`stage`)
        self._kept = LocalStore()  # what this worker sampled or computed for its own rows
        # Supervised training only (`flow_matching_backward`): filled on first use.
        self._training_sigmas: torch.Tensor | None = None
        self._prompt_cache: dict[str, Any] = {}

    @profiled_call
    def forward_backward(
        self, micro_batches: Sequence[PolicyGradientBatch], window_steps: Sequence[int] | None = None
    ):
        if micro_batches:  # the prompt length (and condition tokens) this step trains with, for `phase_flops`
            self._text_len = micro_batches[0].rollout.prompt_embeds.embeds.shape[1]
            self._cond_tokens = micro_batches[0].rollout.prompt_embeds.cond_tokens
        sp = self._sequence_parallel
        with sp.active() if sp is not None else nullcontext():
            return self.engine.forward_backward(
                _to_device(micro_batches, self.engine.adapter.device), window_steps
            )

    @profiled_call
    def flow_matching_backward(self, shard: ImageShard, *, seed: int, step: int) -> dict[str, float]:
        """Accumulate the supervised flow-matching gradient of a shard of images (`diffrl sft`);
        each image's prompt dropout, noise level and noise: `diffrl.algos.sft_batch`."""
        from diffrl.algos.sft_batch import supervised_draws, training_sigmas
        from diffrl.train.engine import FlowMatchingBatch

        if self._sequence_parallel is not None:
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

    def export_pipeline(self, out_dir: str) -> str:
        """The whole pipeline with the trained transformer (LoRA merged in) as a diffusers directory
        (`diffrl.train.export.export_pipeline`; every rank calls it, rank 0 writes)."""
        from diffrl.train.export import export_pipeline

        return str(
            export_pipeline(
                self.engine.adapter, out_dir, model_path=self.cfg.model.path, merge=self.engine.lora
            )
        )

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

    def optimizer_steps(self) -> int:
        """Optimizer steps taken so far (skipped non-finite steps excluded; restored on resume)."""
        return self.engine.optim_steps

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

    @profiled_call
    def log_probs(
        self, rollout: Rollout, policy: str = POLICY, as_trained: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, SDE means) on the CPU of the rollout's window steps under `policy`.

        `as_trained` None: the trained policy's through the update's own graph when the blocks
        are compiled (the old log-probs PPO's ratio divides by are then the update's first
        forward bit for bit: compiled, no-grad is another graph), no grad otherwise."""
        if as_trained is None:
            as_trained = policy == POLICY and self.engine.adapter.trains_through_compiled_graph
        rollout = rollout.to(self.engine.adapter.device)
        log_probs, means = self.engine.log_probs(rollout, policy, as_trained=as_trained)
        return log_probs.cpu(), means.cpu()

    # ------------------------------------------------- the step's rollout, held here (policy gradient)
    @profiled_call
    def stage(self, parts: Sequence[Any], first_row: int = 0) -> None:
        """Take this rank's rows of the step's rollout: the samplers' pieces in order, starting at
        row `first_row` (object references fetched here, `Kept` markers resolved from this
        worker's own store: diffrl.workers.staging). Later calls name samples by the step's row
        numbers; the tensors never pass through the controller."""
        self._staged = StagedRows(concat_rollouts(self._kept.resolve(parts)), first_row)

    @profiled_call
    def staged_log_probs(
        self, rows: slice, policy: str = POLICY, keep: bool = False
    ) -> tuple[torch.Tensor, Any]:
        """(log-probs [R, W] on the CPU, the SDE means) of the staged rows under `policy`. The means
        are latent-sized: handed over (an object reference in a Ray worker) for `stage_targets` on
        whichever ranks train those rows, or with `keep` kept here for this rank's own."""
        staged = self._staged.rollout.select(self._staged.local(rows)).compact()
        log_probs, means = self.log_probs(staged, policy)
        return log_probs, self._kept.keep(f"means/{policy}", means) if keep else handed_over(means)

    @profiled_call
    def stage_targets(self, targets: TrainingTargets, means: Mapping[str, Sequence[Any]]) -> None:
        """The step's per-sample training targets: the controller's (advantages, old log-probs,
        weights, step mask; all rows) plus the SDE means `staged_log_probs` computed, by field name
        (`old_means`, `ref_means`), each the pieces that cover this rank's rows, in row order."""
        self._staged.set_targets(targets, {name: self._kept.resolve(p) for name, p in means.items()})

    @profiled_call
    def staged_forward_backward(self, micro_rows: Sequence[torch.Tensor]) -> dict[str, float]:
        """`forward_backward` of the staged rows, one micro-batch per entry of `micro_rows`."""
        return self.forward_backward([self._staged.batch(rows) for rows in micro_rows])

    def copy_adapter(self, src: str, dst: str) -> None:
        self.engine.copy_adapter(src, dst)

    def ema_adapter(self, decay: float, src: str, dst: str) -> None:
        self.engine.ema_adapter(decay, src, dst)

    @profiled_call
    def save(self, root: str, step: int, extra: dict, keep_last: int) -> str:
        return str(self.engine.save(root, step, extra, keep_last))

    @profiled_call
    def load(self, path: str) -> dict:
        return self.engine.load(path)

    def export_lora(self, out_dir: str) -> str:
        return str(self.engine.export_lora(Path(out_dir)))

    def memory(self) -> dict[str, float]:
        """Peak memory since the last call (GPU allocated/reserved, host RSS)."""
        from diffrl.telemetry import memory_metrics

        return memory_metrics(self.engine.adapter.device)

    def phase_flops(self, images: int, window: int, recompute_old: bool) -> dict[str, float]:
        """Model FLOPs of one step's phases (`diffrl.telemetry.perf.phase_flops`), with the prompt
        length and condition-image tokens of this worker's last training micro-batch."""
        from diffrl.telemetry.perf import phase_flops

        return phase_flops(
            self.engine.adapter,
            self.cfg,
            images=images,
            window=window,
            text_len=self._text_len,
            cond_tokens=self._cond_tokens,
            recompute_old=recompute_old,
            trains_base_weights=not self.engine.lora,
        )

    # ------------------------------------------------------------------ weights (separate placement)
    def weight_sync_address(self) -> tuple[str, int]:
        """Where rank 0 hosts the weight-sync group's store: a free port on loopback for a local Ray
        cluster (nothing listens beyond this host), on this node's address in a multi-node one."""
        from diffrl.workers.weight_sync import free_address

        return free_address(local=self.cfg.trainer.ray_address is None)

    def join_weight_sync(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        """Rank 0 joins the weight-sync group as its source (rank 0 of it); the other ranks take part
        in sends only through FSDP's all-gathers, so they join nothing."""
        from diffrl.train.distributed import rank as process_rank
        from diffrl.workers.weight_sync import WeightSyncGroup

        if process_rank() == 0:
            self._weight_sync = WeightSyncGroup.join(
                host, port, 0, world_size, backend=backend, timeout_s=timeout_s
            )

    def weight_specs(self, full: bool) -> list[Any]:
        """Name, global shape and dtype of what `send_weights(full)` streams (no gathering needed)."""
        from diffrl.workers.weight_sync import tensor_specs

        keep = self._sync_filter(full)
        return tensor_specs((k, t) for k, t in self.engine.transformer.state_dict().items() if keep(k))

    @torch.no_grad()
    @profiled_call
    def send_weights(self, full: bool, bucket_bytes: int) -> dict[str, float]:
        """Stream the weights to the replicas: every tensor (`full`) or the LoRA adapters only.

        Every rank walks the same tensors (under FSDP2 each is all-gathered, collectively, just
        before it is sent); rank 0 broadcasts them to the replicas bucket by bucket."""
        from diffrl.train.distributed import rank as process_rank
        from diffrl.train.export import iter_weights

        named = iter_weights(self.engine.transformer, adapter_only=self.engine.lora and not full)
        if process_rank() != 0:
            for _ in named:  # the all-gathers rank 0 needs
                pass
            return {}
        if self._weight_sync is None:
            raise RuntimeError("send_weights before join_weight_sync: the controller must join first")
        return self._weight_sync.send(named, bucket_bytes=bucket_bytes).metrics()

    @torch.no_grad()
    @profiled_call
    def snapshot_weights(self, version: int, full: bool) -> list[Any]:
        """Copy what `send_weights(full)` would stream, as weight version `version`, for a later
        `send_snapshot` (bounded staleness: the replicas take it once they have sampled the batches
        queued before it, while this worker trains on). Collective under FSDP2 like `send_weights`;
        rank 0 keeps the copies in host memory and returns their specs, the other ranks []."""
        from diffrl.train.distributed import rank as process_rank
        from diffrl.train.export import iter_weights
        from diffrl.workers.weight_sync import tensor_specs

        named = iter_weights(self.engine.transformer, adapter_only=self.engine.lora and not full)
        if process_rank() != 0:
            for _ in named:  # the all-gathers rank 0 needs
                pass
            return []
        copies = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in named]
        self._snapshots[version] = copies
        return tensor_specs(copies)

    @profiled_call
    def send_snapshot(self, version: int, bucket_bytes: int) -> dict[str, float]:
        """Stream the copies `snapshot_weights(version)` kept to the replicas and drop them; rank 0."""
        if self._weight_sync is None:
            raise RuntimeError("send_snapshot before join_weight_sync: the controller must join first")
        if version not in self._snapshots:
            raise RuntimeError(f"no snapshot of weight version {version} (held: {sorted(self._snapshots)})")
        copies = self._snapshots.pop(version)
        return self._weight_sync.send(iter(copies), bucket_bytes=bucket_bytes).metrics()

    def weight_digest(self) -> dict[str, str]:
        """sha256 of every state-dict tensor's bytes (tests compare replicas with the trainer)."""
        return weight_digests(self.engine.transformer.state_dict())

    def close_weight_sync(self) -> None:
        if self._weight_sync is not None:
            self._weight_sync.close()
            self._weight_sync = None

    def _sync_filter(self, full: bool) -> Callable[[str], bool]:
        if full or not self.engine.lora:
            return lambda name: True
        from diffrl.train.export import adapter_key_predicate

        return adapter_key_predicate(self.engine.transformer, None)


class HybridWorker(ActorWorker):
    """Actor and sampler on one module: new weights reach the sampler without any copy."""

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

    @profiled_call
    def sample(self, prompts: Sequence[str], **kwargs) -> Rollout:
        return self.rollout.sample(prompts, **kwargs)

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
        return summary, self._kept.keep("rollout", rollout)

    def set_weight_version(self, version: int) -> None:
        """Colocated weights change in place; only the version the rollouts record moves."""
        self.rollout.weight_version = version

    @profiled_call
    def validate_and_score(self, shard: PromptShard, *, rewards: Any) -> Rollout:
        return self.rollout.validate_and_score(shard, rewards=rewards)


def _to_device(
    micro_batches: Sequence[PolicyGradientBatch], device: torch.device
) -> list[PolicyGradientBatch]:
    """Move micro-batches to `device`, copying a prompt table they share only once."""
    tables: dict[int, Any] = {}
    moved = []
    for mb in micro_batches:
        key = id(mb.rollout.prompt_embeds)
        if key not in tables:
            tables[key] = mb.rollout.prompt_embeds.to(device)
        rollout = replace(mb.rollout.to_samples_device(device), prompt_embeds=tables[key])
        moved.append(PolicyGradientBatch(rollout, mb.targets.to(device)))
    return moved


__all__ = [
    "REFERENCE",
    "ActorWorker",
    "HybridWorker",
    "PromptShard",
    "RolloutWorker",
    "worker_device",
]
