"""The trainer's weights as the source of a sync: a part of the training workers (diffrl.workers.roles).

Separate placement (diffrl.controller.placement): trainer rank 0 hosts and joins the weight-sync
group (`address`, `join`) as its rank 0, the replicas (RolloutWorker.join_weight_sync) ranks 1..R;
a sync streams every tensor or the LoRA adapters only (`specs`, `send`), and bounded staleness
copies a version into host memory to stream later (`snapshot`, `send_snapshot`). Under FSDP2 every
rank walks the same tensors, each all-gathered collectively, while only rank 0 sends. Colocated,
the sampler holds the trained module itself: `InPlaceWeights.set_version` only moves the version
its rollouts record. The controller addresses these as `weights.<method>` (diffrl.workers.group).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from diffrl.config.schema import Config
from diffrl.telemetry.profiling import profiled_call
from diffrl.train.engine import TrainEngine
from diffrl.workers.rollout_worker import RolloutWorker, weight_digests


class WeightSource:
    """The training engine's weights, streamed to the rollout replicas over diffrl.workers.weight_sync."""

    def __init__(self, engine: TrainEngine, cfg: Config):
        self.engine = engine
        self.cfg = cfg
        self.group: Any = None  # rank 0's WeightSyncGroup with the replicas (`join`)
        # rank 0, bounded staleness: weight versions copied for the replicas, not yet sent to them
        self.snapshots: dict[int, list[tuple[str, torch.Tensor]]] = {}

    def address(self) -> tuple[str, int]:
        """Where rank 0 hosts the weight-sync group's store: a free port on loopback for a local Ray
        cluster (nothing listens beyond this host), on this node's address in a multi-node one."""
        from diffrl.workers.sync_rendezvous import free_address

        return free_address(local=self.cfg.trainer.ray_address is None)

    def join(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        """Rank 0 joins the weight-sync group as its source (rank 0 of it); the other ranks take part
        in sends only through FSDP's all-gathers, so they join nothing."""
        from diffrl.train.distributed import rank as process_rank
        from diffrl.workers.weight_sync import WeightSyncGroup

        if process_rank() == 0:
            self.group = WeightSyncGroup.join(host, port, 0, world_size, backend=backend, timeout_s=timeout_s)

    def specs(self, full: bool) -> list[Any]:
        """Name, global shape and dtype of what `send(full)` streams (no gathering needed)."""
        from diffrl.workers.weight_specs import tensor_specs

        keep = self._sync_filter(full)
        specs = tensor_specs((k, t) for k, t in self.engine.transformer.state_dict().items() if keep(k))
        self._require_trained([spec.name for spec in specs])
        return specs

    @torch.no_grad()
    @profiled_call
    def send(self, full: bool, bucket_bytes: int) -> dict[str, float]:
        """Stream the weights to the replicas: every tensor (`full`) or the LoRA adapters only.

        Every rank walks the same tensors (under FSDP2 each is all-gathered, collectively, just
        before it is sent); rank 0 broadcasts them to the replicas bucket by bucket."""
        from diffrl.train.distributed import rank as process_rank

        named = self._named(full)
        if process_rank() != 0:
            for _ in named:  # the all-gathers rank 0 needs
                pass
            return {}
        if self.group is None:
            raise RuntimeError("weights.send before weights.join: the controller must join first")
        return self.group.send(named, bucket_bytes=bucket_bytes).metrics()

    @torch.no_grad()
    @profiled_call
    def snapshot(self, version: int, full: bool) -> list[Any]:
        """Copy what `send(full)` would stream, as weight version `version`, for a later
        `send_snapshot` (bounded staleness: the replicas take it once they have sampled the batches
        queued before it, while this worker trains on). Collective under FSDP2 like `send`; rank 0
        keeps the copies in host memory and returns their specs, the other ranks []."""
        from diffrl.train.distributed import rank as process_rank
        from diffrl.workers.weight_specs import tensor_specs

        named = self._named(full)
        if process_rank() != 0:
            for _ in named:  # the all-gathers rank 0 needs
                pass
            return []
        copies = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in named]
        self._require_trained([name for name, _ in copies])
        self.snapshots[version] = copies
        return tensor_specs(copies)

    @profiled_call
    def send_snapshot(self, version: int, bucket_bytes: int) -> dict[str, float]:
        """Stream the copies `snapshot(version)` kept to the replicas and drop them; rank 0."""
        if self.group is None:
            raise RuntimeError("weights.send_snapshot before weights.join: the controller must join first")
        if version not in self.snapshots:
            raise RuntimeError(f"no snapshot of weight version {version} (held: {sorted(self.snapshots)})")
        copies = self.snapshots.pop(version)
        return self.group.send(iter(copies), bucket_bytes=bucket_bytes).metrics()

    def digest(self) -> dict[str, str]:
        """sha256 of every state-dict tensor's bytes (tests compare replicas with the trainer)."""
        return weight_digests(self.engine.transformer.state_dict())

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    def _named(self, full: bool):
        from diffrl.train.export import iter_weights

        return iter_weights(self.engine.transformer, adapter_only=self.engine.lora and not full)

    def _require_trained(self, streamed: list[str]) -> None:
        """Every tensor the engine trains must be among those streamed: a key filter that missed a
        module (a LoRA layer type it does not know) would leave the replicas' copy untrained."""
        from diffrl.models.lora_check import require_trained_covered, trainable_names

        require_trained_covered(
            "weight sync",
            trainable_names(self.engine.transformer),
            streamed,
            fix="diffrl.train.export.adapter_key_predicate must recognise every adapter tensor: please report it",
        )

    def _sync_filter(self, full: bool) -> Callable[[str], bool]:
        if full or not self.engine.lora:
            return lambda name: True
        from diffrl.train.export import adapter_key_predicate

        return adapter_key_predicate(self.engine.transformer, None)


class InPlaceWeights(WeightSource):
    """A HybridWorker's weights: the sampler's own module, so a new version needs no copy."""

    def __init__(self, engine: TrainEngine, cfg: Config, sampler: RolloutWorker):
        super().__init__(engine, cfg)
        self.sampler = sampler

    def set_version(self, version: int) -> None:
        """Colocated weights change in place; only the version the rollouts record moves."""
        self.sampler.weight_version = version


__all__ = ["InPlaceWeights", "WeightSource"]
