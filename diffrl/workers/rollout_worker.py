"""The rollout role: a sampler that scores its trajectories as they decode.

`RolloutWorker` is both the sampling half of a colocated `HybridWorker` (wrapping the actor's own
module) and, in the separate placement, a replica with its own copy of the model: no optimizer,
no gradients, weights arriving by `receive_weights` (diffrl.workers.weight_sync). A replica can
also run the passes that need no gradient on the trajectories it samples (`evaluate`, the
trainer's own log-prob function): the reference pass, and the old log-probs when its weights are
the ones the update starts from.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from diffrl.config.schema import Config
from diffrl.data.images import ConditionImage
from diffrl.models import load_model
from diffrl.models.base import ModelAdapter
from diffrl.rollout.sampler import TrajectorySampler
from diffrl.telemetry.profiling import ProfiledWorker, profiled_call
from diffrl.train import fp8
from diffrl.train.lora import inject_lora, lora_policy, merged_adapter
from diffrl.train.policies import OLD, POLICY, window_log_probs
from diffrl.transition import Rollout, RolloutSummary, concat_rollouts
from diffrl.workers.staging import fetched, handed_over


@dataclass(frozen=True)
class PromptShard:
    """One worker's share of a step's prompts. `sample_offset` is the step-wide index of its first
    sample: sample indices key the noise, so they stay global however the prompts are split."""

    prompts: list[str]
    uids: list[str]
    metadata: list[dict[str, Any]]
    negative_prompts: list[str] | None
    sample_offset: int
    #: Each prompt's condition images (image-edit families); None for text-only prompts.
    images: list[tuple[ConditionImage, ...]] | None = None


def worker_device() -> torch.device:
    """This process's device: its GPU (cuda:0 under Ray, cuda:LOCAL_RANK under torchrun) or the CPU."""
    from diffrl.train.distributed import device_for_rank

    return device_for_rank()


def build_adapter(cfg: Config) -> ModelAdapter:
    """The configured model on this process's device: dtype, attention backend, compilation."""
    adapter = load_model(cfg.model.path, cfg.model.dtype, worker_device())
    backend = attention_backend(cfg.model.attn_backend, adapter)
    if backend != "native":
        adapter.transformer.set_attention_backend(backend)
    return adapter


def attention_backend(setting: str, adapter: ModelAdapter) -> str:
    """`model.attn_backend` for this adapter: `auto` is the family's GPU training backend on a GPU
    (`gpu_training_attn_backend`: FLUX's flash attention, since torch's default picks cuDNN on
    H100/H200, whose backward failed FLUX's training) and torch's default (`native`) elsewhere."""
    if setting != "auto":
        return setting
    if adapter.device.type == "cuda" and adapter.gpu_training_attn_backend is not None:
        return adapter.gpu_training_attn_backend
    return "native"


class RolloutWorker(ProfiledWorker):
    """Samples trajectories and scores them as they decode.

    Colocated, it wraps the actor's own module (`HybridWorker`); as a replica of the separate
    placement it builds its own copy of the model with the actor's LoRA layout (no optimizer;
    compiled, the trained adapter requires grad so that its graph is the trainer's:
    `computes_as_trained`) and receives the trainer's weights through `receive_weights`.
    `weight_version` counts the trainer steps behind the weights it samples with; every rollout
    records it.
    """

    def __init__(
        self,
        cfg: Config,
        adapter: ModelAdapter | None = None,
        *,
        with_old: bool = False,
        use_policy: Callable[[str], AbstractContextManager] | None = None,
    ):
        self.cfg = cfg
        self.weight_version = 0
        self._weight_sync: Any = None  # the WeightSyncGroup of a replica, once joined
        if adapter is None:  # a replica: the actor's LoRA layout and dtypes, so its weights stream in 1:1
            adapter = build_adapter(cfg)
            if cfg.model.lora.rank > 0:
                inject_lora(
                    adapter, cfg.model.lora, [POLICY, OLD] if with_old else [POLICY], seed=cfg.trainer.seed
                )
            adapter.transformer.requires_grad_(False)
            if computes_as_trained(cfg):
                as_trained_replica(adapter, cfg.actor.micro_batch_size)
            # the trainer's conversion (TrainEngine), before compile
            fp8.prepare(adapter, cfg.model.fp8, scaling=cfg.model.fp8_scaling)
            if cfg.model.compile:
                adapter.compile_blocks()
        self.adapter = adapter
        # model.fp8=sampling: float8 GEMMs for the passes that sample (rollouts, validation) only
        self._use_policy = fp8.for_sampling(
            use_policy or self._set_adapter, adapter.transformer, cfg.model.fp8
        )
        self.sampler = TrajectorySampler(
            self.adapter, cfg.rollout, progress=False, log_probs_reused=reuses_log_probs(cfg)
        )

    @contextmanager
    def _set_adapter(self, policy: str) -> Iterator[None]:
        """A replica samples as policy `policy` (`old` for DiffusionNFT) by switching peft's adapter,
        or with model.lora.merge_inference by merging it into the weights."""
        if self.cfg.model.lora.rank > 0 and self.cfg.model.lora.merge_inference:
            with merged_adapter(self.adapter, policy):
                yield
            return
        if policy == POLICY:
            yield
            return
        with lora_policy(self.adapter.transformer, policy, POLICY):
            yield

    @profiled_call
    def sample(
        self,
        prompts: Sequence[str],
        *,
        seed: int,
        step: int,
        uids: Sequence[str] | None = None,
        metadata: Sequence[dict[str, Any]] | None = None,
        images: Sequence[tuple[ConditionImage, ...]] | None = None,
    ) -> Rollout:
        with torch.no_grad(), self._use_policy(POLICY):
            return self.sampler.sample(
                prompts, seed=seed, step=step, uids=uids, metadata=metadata, images=images
            )

    @profiled_call
    def sample_and_score(
        self,
        shard: PromptShard,
        *,
        seed: int,
        step: int,
        rewards: Any,
        policy: str = POLICY,
        passes: Sequence[str] = (),
        version: int | None = None,
    ) -> tuple[RolloutSummary, Any]:
        """Sample a shard of prompts as `policy`; each decoded micro-batch goes to `rewards.submit`
        at once. `version`: the weight version the controller scheduled this request for (bounded
        staleness); a replica holding another one raises instead of sampling.

        Returns the rollout's summary for the controller (the reward handles, in sample order, the
        weight version and the seconds this call took, `busy_s`, in its extras) and the rollout
        itself on the CPU for the trainer ranks: in a Ray worker as an object reference, which the
        controller passes on without fetching the tensors (`ActorWorker.stage`). `passes`: the
        policies whose log-probs and SDE means to compute on the fresh rollout with the weights
        that sampled it (`evaluate`), in the summary's extras as `passes`."""
        if version is not None and version != self.weight_version:  # the controller's order guarantees it
            raise RuntimeError(
                f"asked to sample step {step}'s request with weight version {version}, but this replica "
                f"holds version {self.weight_version}: a weight delivery was skipped or reordered"
            )
        start = time.perf_counter()
        summary, rollout = self.sample_scored(shard, seed=seed, step=step, rewards=rewards, policy=policy)
        if passes:
            summary.extras["passes"] = self.evaluate(rollout, passes)
        summary.extras["busy_s"] = time.perf_counter() - start
        return summary, handed_over(rollout)

    @torch.no_grad()
    @profiled_call
    def evaluate(self, rollout: Rollout, policies: Sequence[str]) -> dict[str, tuple[torch.Tensor, Any]]:
        """{policy: (log-probs [B, W] on the CPU, the SDE means handed over)} of `rollout`'s window
        steps under each of `policies` (`default`, or `reference` with LoRA: the adapters
        disabled): the trainer's own log-prob pass (`diffrl.train.policies.window_log_probs`, which
        `TrainEngine.log_probs` runs), in micro-batches of `actor.micro_batch_size`. On the same
        weights the results are the trainer's bitwise (docs/async.md, "Balanced pools")."""
        out: dict[str, tuple[torch.Tensor, Any]] = {}
        on_device = rollout.to(self.adapter.device)
        for policy in policies:
            log_probs, means = window_log_probs(
                self.adapter,
                on_device,
                policy,
                lora=self.cfg.model.lora.rank > 0,
                micro_batch_size=self.cfg.actor.micro_batch_size,
                steps_per_forward=self.cfg.actor.replay_steps_per_forward,
            )
            out[policy] = (log_probs.cpu(), handed_over(means.cpu()))
        return out

    @profiled_call
    def evaluate_parts(self, parts: Sequence[Any], policies: Sequence[str]) -> dict[str, Any]:
        """`evaluate` of the handed-over rollout `parts` (joined in order) with the weights held
        now: `passes`, the `weight_version` they used and the seconds it took (`busy_s`). The
        controller queues it right after the delivery of the weights a batch sampled behind them
        trains from (`Separate.evaluate_later`, diffrl.controller.pipeline)."""
        start = time.perf_counter()
        rollout = concat_rollouts(fetched(parts))
        passes = self.evaluate(rollout, policies)
        return {
            "passes": passes,
            "weight_version": self.weight_version,
            "busy_s": time.perf_counter() - start,
        }

    @profiled_call
    def sample_scored(
        self, shard: PromptShard, *, seed: int, step: int, rewards: Any, policy: str = POLICY
    ) -> tuple[RolloutSummary, Rollout]:
        """`sample_and_score`'s summary and rollout (on the CPU, without extras), in process."""
        rollout = self._sample_scored(shard, seed=seed, step=step, rewards=rewards, policy=policy)
        return rollout.summary(), replace(rollout, extras={})

    def _sample_scored(
        self, shard: PromptShard, *, seed: int, step: int, rewards: Any, policy: str
    ) -> Rollout:
        """The rollout of `sample_and_score`, with the reward handles and the weight version in
        its extras."""
        handles: list[Any] = []
        with torch.no_grad(), self._use_policy(policy):
            rollout = self.sampler.sample(
                shard.prompts,
                seed=seed,
                step=step,
                uids=shard.uids,
                metadata=shard.metadata,
                negative_prompts=shard.negative_prompts,
                on_decoded=_submitter(rewards, shard.prompts, shard.metadata, handles, shard.images),
                sample_offset=shard.sample_offset,
                images=shard.images,
            )
        rollout = rollout.to("cpu")
        rollout.extras["reward_handles"] = handles
        rollout.extras["weight_version"] = self.weight_version
        return rollout

    @profiled_call
    def validate_and_score(self, shard: PromptShard, *, rewards: Any) -> Rollout:
        """`sample_validation` of a shard of prompts, scored."""
        with self._use_policy(POLICY):
            rollout = self.sampler.sample_validation(
                shard.prompts,
                uids=shard.uids,
                metadata=shard.metadata,
                negative_prompts=shard.negative_prompts,
                sample_offset=shard.sample_offset,
                images=shard.images,
            ).to("cpu")
        handles: list[Any] = []
        _submitter(rewards, shard.prompts, shard.metadata, handles, shard.images)(rollout.samples)
        rollout.extras["reward_handles"] = handles
        return rollout

    def memory(self) -> dict[str, float]:
        """Peak memory since the last call (GPU allocated/reserved, host RSS)."""
        from diffrl.telemetry import memory_metrics

        return memory_metrics(self.adapter.device)

    # ------------------------------------------------------------------ weights (separate placement)
    def join_weight_sync(
        self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        """Join the trainer's weight-sync group as rank `rank` (trainer rank 0 is rank 0)."""
        from diffrl.workers.weight_sync import WeightSyncGroup

        self._weight_sync = WeightSyncGroup.join(
            host, port, rank, world_size, backend=backend, timeout_s=timeout_s
        )

    @torch.no_grad()
    @profiled_call
    def receive_weights(self, specs: Sequence[Any], version: int, bucket_bytes: int) -> dict[str, float]:
        """Receive the tensors `specs` names into the module, in place; sample as `version` from now."""
        if self._weight_sync is None:
            raise RuntimeError("receive_weights before join_weight_sync: the controller must join first")
        params = self.adapter.transformer.state_dict(keep_vars=True)
        stats = self._weight_sync.receive(specs, params, bucket_bytes=bucket_bytes)
        check_synced_set(specs, self.adapter.transformer, f"weight sync of version {version}")
        fp8.refresh_cast_weights(self.adapter.transformer, (spec.name for spec in specs))
        self.weight_version = version
        return stats.metrics()

    def weight_digest(self) -> dict[str, str]:
        """sha256 of every state-dict tensor's bytes (tests compare replicas with the trainer)."""
        return weight_digests(self.adapter.transformer.state_dict())

    def close_weight_sync(self) -> None:
        if self._weight_sync is not None:
            self._weight_sync.close()
            self._weight_sync = None


def check_synced_set(specs: Sequence[Any], transformer: torch.nn.Module, where: str) -> None:
    """Raise AdapterMismatchError unless what a sync streamed (`specs`) is every tensor of the
    replica's module (a full sync) or every one of its LoRA tensors (an adapters-only sync).

    The stream's own checks hold each streamed tensor to a tensor of the module; this holds the
    module to the stream: a LoRA module the replica carries and the trainer never sends would
    keep its initial weights (B = 0, the base model) while the replica samples as "trained"."""
    from diffrl.models.lora_check import check_adapter_tensors, shapes_of
    from diffrl.train.export import adapter_key_predicate, lora_adapter_names

    state = transformer.state_dict()
    keep = lambda key: True  # noqa: E731
    if lora_adapter_names(transformer):
        is_adapter = adapter_key_predicate(transformer)
        if all(is_adapter(spec.name) for spec in specs):  # adapters only: the module's LoRA tensors
            keep = is_adapter
    check_adapter_tensors(
        where,
        {spec.name: spec.shape for spec in specs},
        shapes_of((k, v) for k, v in state.items() if keep(k)),
        side="the replica's model",
        fix="Trainer and rollout replicas must inject the same LoRA adapters (same model.lora settings)",
    )


def reuses_log_probs(cfg: Config) -> bool:
    """Whether the trainer takes the training rollouts' log-probs as its old ones (the run plan's
    rule, `diffrl.config.plan.old_log_probs_source`: `rollout`). Its sampler then computes the SDE
    window steps in the trainer's micro-batches (`TrajectorySampler._trained_slices`); a run that
    recomputes them, or trains on clean samples (direct preference), samples at its own."""
    from diffrl.config.plan import ROLLOUT, old_log_probs_source

    return old_log_probs_source(cfg) == ROLLOUT


def computes_as_trained(cfg: Config) -> bool:
    """Whether a replica computes its SDE window steps through the trainer's training graph: a
    compiled policy-gradient run with LoRA sampled from the unmerged adapters. Compiled blocks run
    another graph with grad than without (fused and so rounded differently), and the trainer's
    update and its recomputed old log-probs run the grad one; the same graph on the replica keeps
    its log-probs the trainer's bit for bit on the same weights, as a colocated sampler's are."""
    from diffrl.algos import POLICY_GRADIENT

    return (
        cfg.model.compile
        and cfg.model.lora.rank > 0
        and not cfg.model.lora.merge_inference
        and cfg.algorithm.trainer_type == POLICY_GRADIENT
    )


def as_trained_replica(adapter: ModelAdapter, micro_batch_size: int) -> None:
    """Make a replica's module trace the trainer's graph: the trained (`default`) LoRA weights
    require grad, as the trainer's do (no optimizer holds them and no backward runs: each grad-on
    window step's graph is dropped at once), and the sampler slices window steps to the actor's
    micro-batch size (`TrajectorySampler._trained_slices`), as the trainer re-evaluates them."""
    for name, param in adapter.transformer.named_parameters():
        if f".{POLICY}." in name:
            param.requires_grad_(True)
    adapter.train_micro_batch_size = micro_batch_size


def weight_digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    import hashlib

    out = {}
    for name, tensor in state.items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        data = full.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        out[name] = hashlib.sha256(data).hexdigest()
    return out


def _submitter(
    rewards: Any,
    prompts: Sequence[str],
    metadata: Sequence[dict],
    handles: list[Any],
    images: Sequence[tuple[ConditionImage, ...]] | None = None,
):
    """An `on_decoded` callback sending each micro-batch's pixels to the reward workers; with
    `images` (an edit run: each prompt's condition images) also each sample's as `sources`, as the
    `ConditionImage`s themselves (a path or the encoded bytes), which the reward process decodes
    only if one of its rewards reads them."""

    def submit(chunk) -> None:
        rows = chunk.prompt_index_B.tolist()
        batch = (chunk.pixels, [prompts[i] for i in rows], [metadata[i] for i in rows])
        if images is None:
            handles.append(rewards.submit(*batch))
        else:
            handles.append(rewards.submit(*batch, sources=[images[i] for i in rows]))

    return submit


__all__ = [
    "PromptShard",
    "RolloutWorker",
    "attention_backend",
    "build_adapter",
    "weight_digests",
    "worker_device",
]
