"""Where sampling and training run, and how new weights reach the sampler (trainer.placement).

    colocated   one pool of HybridWorkers: each samples and trains the same module, so new
                weights are in place when the optimizer steps; a step's prompts are split into
                one equal shard of whole groups per worker (FSDP needs every rank to run the same
                number of forwards).
    separate    a trainer pool of ActorWorkers (FSDP2 ranks among themselves) and a rollout pool
                of RolloutWorker replicas (a model copy each, no optimizer), each in its own Ray
                placement group. A step's prompt groups become a stream of requests of one sampler
                micro-batch each; a replica takes the next request as soon as it has fewer than
                `rollout.requests_in_flight` queued, so a slow replica gets fewer. `sync_weights`
                streams the trainer's weights to the replicas over a torch.distributed group of
                trainer rank 0 and the replicas (diffrl.workers.weight_sync): all tensors the first
                time, then the LoRA adapters only when training LoRA.

Both hand the loop a `PendingRollout`, which becomes a `StagedRollout`
(diffrl.controller.staged_rollout): the controller keeps the summaries, the trajectories go to the
trainer ranks as object references.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from typing import Any

from diffrl.config.schema import Config
from diffrl.controller.sharding import prompt_shard
from diffrl.controller.staged_rollout import PendingRollout, StagedRollout
from diffrl.data import PromptRecord
from diffrl.train.engine import POLICY
from diffrl.transition import RolloutSummary
from diffrl.workers.errors import WorkerError, log_tail
from diffrl.workers.futures import WorkerFuture, blame, failure_of, gather, wait_any, wait_done
from diffrl.workers.group import WorkerGroup
from diffrl.workers.roles import PromptShard

_POLL_S = 1.0  # how often the request stream checks whether the run is stopping


class _ScoredFor:
    """A reward handle of a replica's request. The replica submitted the scoring, so Ray made it
    the owner of the score: a replica that dies before the driver fetched the score turns it into
    Ray's bare `OwnerDiedError`, which names a worker id; this raises the `WorkerError` naming
    the replica (node, pid, last log lines) instead."""

    def __init__(self, handle: Any, request: WorkerFuture):
        # not the request itself: its object ref would pin the rollout in Ray's object store
        self.handle = handle
        self.rank, self.size, self.method = request.rank, request.size, request.method
        self.identity = getattr(request, "identity", None)

    def result(self, timeout: float | None = None) -> Any:
        import ray

        try:
            return self.handle.result(timeout)
        except ray.exceptions.OwnerDiedError as err:
            raise WorkerError(
                self.rank,
                self.size,
                f"{self.method} (the reward scores it submitted were not fetched yet)",
                err,
                identity=self.identity,
                log_tail=None if self.identity is None else log_tail(self.identity),
            ) from err

    def done(self) -> bool:
        return self.handle.done()


class Placement(ABC):
    """The pools a loop calls: `trainer` (forward_backward, log_probs, save, ...) and `samplers`
    (validate_and_score); `sample` starts a step's rollout, `sync_weights` publishes weights."""

    trainer: WorkerGroup
    samplers: WorkerGroup

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.timeout_s = cfg.trainer.worker_timeout_s
        self.weight_version = 0  # trainer steps behind the weights the samplers hold

    @property
    def gpus(self) -> int:
        """GPUs (or CPU workers) the run occupies, for per-GPU throughput and MFU."""
        return self.trainer.size

    @abstractmethod
    def sample(
        self,
        records: Sequence[PromptRecord],
        uids: Sequence[str],
        *,
        step: int,
        rewards: Any,
        policy: str = POLICY,
        keep: bool = False,
        passes: Sequence[str] = (),
        version: int | None = None,
    ) -> PendingRollout:
        """Start sampling `rollout.n` trajectories per prompt; each micro-batch is scored as it decodes.
        `keep`: colocated, each worker keeps the part it sampled and the result's parts are `Kept`
        markers, for the loop to stage each on its own worker (diffrl.workers.staging); with
        separate placement the replicas hand their parts over whatever `keep` says. `passes`
        (separate placement): the policies whose log-probs and means the replicas compute on each
        fresh part with the weights that sampled it (`StagedRollout.pass_result`). `version`
        (separate placement): the weight version the replicas must hold when they sample it,
        which the sync or the `publish_weights` queued before it provides
        (diffrl.controller.pipeline)."""

    def evaluate_later(self, staged: StagedRollout, policies: Sequence[str], version: int) -> None:
        """Start `policies`' passes on `staged` with the weights the samplers hold now (`version`),
        for `staged.pass_result` to collect. Only a placement with a rollout pool has them."""
        raise NotImplementedError(f"{type(self).__name__} placement runs no passes on its samplers")

    @abstractmethod
    def sync_weights(self, version: int, *, full: bool = False) -> dict[str, float]:
        """Make the samplers hold the trainer's current weights, as `version`; returns metrics."""

    def publish_weights(self, version: int) -> dict[str, float]:
        """Copy the trainer's current weights as `version` and queue their delivery to the samplers
        after the sampling queued so far (batches in flight). Only a rollout pool has it."""
        raise NotImplementedError(f"{type(self).__name__} placement has no rollout pool to publish to")

    def drain(self) -> None:  # noqa: B027 (only Separate queues work of its own)
        """Wait until the sampling and the weight deliveries queued so far are done."""

    def shutdown(self) -> None:  # noqa: B027 (only Separate starts something of its own)
        """Stop what the placement started beyond the groups (which the worker session owns)."""


class Colocated(Placement):
    """One pool: HybridWorkers sample and train one module (the module docstring)."""

    def __init__(self, cfg: Config, workers: WorkerGroup):
        super().__init__(cfg)
        self.trainer = self.samplers = workers

    def sample(
        self,
        records: Sequence[PromptRecord],
        uids: Sequence[str],
        *,
        step: int,
        rewards: Any,
        policy: str = POLICY,
        keep: bool = False,
        passes: Sequence[str] = (),
        version: int | None = None,
    ) -> PendingRollout:
        world, n = self.trainer.size, self.cfg.rollout.n
        per_worker = len(records) // world
        shards = [
            prompt_shard(
                records[rank * per_worker : (rank + 1) * per_worker],
                uids[rank * per_worker :],
                rank * per_worker * n,
                self.cfg.rollout.pipeline.negative_prompt,
            )
            for rank in range(world)
        ]
        options = {"keep": True} if keep else {}
        futures = self.trainer.scatter_async(
            "sample_and_score",
            shards,
            seed=self.cfg.rollout_seed,
            step=step,
            rewards=rewards,
            policy=policy,
            **options,
        )
        return PendingRollout(futures, self.timeout_s)

    def sync_weights(self, version: int, *, full: bool = False) -> dict[str, float]:
        if version != self.weight_version:
            gather(self.trainer.call_async("weights.set_version", version), timeout=self.timeout_s)
            self.weight_version = version
        return {}


class Separate(Placement):
    """A trainer pool and a pool of rollout replicas (the module docstring)."""

    def __init__(self, cfg: Config, trainer: WorkerGroup, replicas: WorkerGroup, *, backend: str):
        super().__init__(cfg)
        self.trainer, self.samplers = trainer, replicas
        self.replicas = replicas
        self.backend = backend
        sync = cfg.rollout.weight_sync
        self.bucket_bytes = int(sync.bucket_mb * 2**20)
        self._synced_once = False
        self._pump = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="diffrl-requests"
        )
        self._cancel = threading.Event()
        # weight deliveries queued on the pump between batches in flight (`publish_weights`)
        self._deliveries: list[concurrent.futures.Future] = []
        self._delivery_error: BaseException | None = None
        # One group: trainer rank 0 (the source, rank 0) and the replicas (ranks 1..R).
        host, port = trainer.call_async("weights.address")[0].result(self.timeout_s)
        world = 1 + replicas.size
        joins = trainer.call_async("weights.join", host, port, world, backend, sync.timeout_s)
        joins += [
            replicas.submit(rank, "join_weight_sync", host, port, rank + 1, world, backend, sync.timeout_s)
            for rank in range(replicas.size)
        ]
        gather(joins, timeout=sync.timeout_s + 30)

    @property
    def gpus(self) -> int:
        trainer = self.trainer.size * self.cfg.trainer.gpus_per_worker
        return max(1, round(trainer + self.replicas.size * self.cfg.rollout.gpus_per_replica))

    # ------------------------------------------------------------------------------ sampling
    def requests(self, records: Sequence[PromptRecord], uids: Sequence[str]) -> list[PromptShard]:
        """Whole prompt groups, one sampler micro-batch's worth per request, in prompt order."""
        n = self.cfg.rollout.n
        groups = max(1, self.cfg.rollout.micro_batch_size // n)
        negative = self.cfg.rollout.pipeline.negative_prompt
        return [
            prompt_shard(records[start : start + groups], uids[start : start + groups], start * n, negative)
            for start in range(0, len(records), groups)
        ]

    def sample(
        self,
        records: Sequence[PromptRecord],
        uids: Sequence[str],
        *,
        step: int,
        rewards: Any,
        policy: str = POLICY,
        keep: bool = False,
        passes: Sequence[str] = (),
        version: int | None = None,
    ) -> PendingRollout:
        kwargs = {"seed": self.cfg.rollout_seed, "step": step, "rewards": rewards, "policy": policy}
        if passes:
            kwargs["passes"] = tuple(passes)
        if version is not None:
            kwargs["version"] = version
        future = self._pump.submit(self._stream, self.requests(records, uids), kwargs)
        return PendingRollout(future, self.timeout_s)

    def _stream(
        self, requests: list[PromptShard], kwargs: dict[str, Any]
    ) -> list[tuple[RolloutSummary, Any]]:
        """Keep every replica busy with up to `requests_in_flight` requests until all are answered;
        a replica's failure ends the stream at once (the rest would wait on it)."""
        if self._delivery_error is not None:
            raise RuntimeError(
                f"sampling stopped: a weight delivery to the replicas failed before this batch: "
                f"{self._delivery_error}"
            ) from self._delivery_error
        limit = self.cfg.rollout.requests_in_flight
        results: list[tuple[RolloutSummary, Any] | None] = [None] * len(requests)
        queue = deque(enumerate(requests))
        in_flight: dict[WorkerFuture, tuple[int, int]] = {}
        load = [0] * self.replicas.size
        deadline = time.monotonic() + self.timeout_s
        while queue or in_flight:
            while queue:
                replica = min(range(self.replicas.size), key=load.__getitem__)
                if load[replica] >= limit:
                    break
                index, request = queue.popleft()
                in_flight[self.replicas.submit(replica, "sample_and_score", request, **kwargs)] = (
                    index,
                    replica,
                )
                load[replica] += 1
            # Short waits, so a run that stops (the driver failed elsewhere) ends this thread too.
            remaining = deadline - time.monotonic()
            if self._cancel.is_set():
                raise RuntimeError("sampling cancelled: the run is stopping")
            if remaining <= 0:
                wait_any(list(in_flight), timeout=0)  # the TimeoutError names the silent replicas
            for future in wait_done(list(in_flight), timeout=min(remaining, _POLL_S)):
                index, replica = in_flight.pop(future)
                summary, part = future.result()  # a failed request raises its WorkerError here
                handles = summary.extras.get("reward_handles", [])
                summary.extras["reward_handles"] = [_ScoredFor(h, future) for h in handles]
                results[index] = (summary, part)
                load[replica] -= 1
        return [r for r in results if r is not None]

    def evaluate_later(self, staged: StagedRollout, policies: Sequence[str], version: int) -> None:
        """A batch sampled behind the weights its step starts from gets the passes that need them
        (the old log-probs) with `version`, queued on the request pump after the delivery of that
        version and before the next batch's requests: part i goes to replica i mod R (all hold
        the same weights)."""

        def submit() -> list[WorkerFuture]:
            return [
                self.replicas.submit(i % self.replicas.size, "evaluate_parts", [part], tuple(policies))
                for i, part in enumerate(staged.parts)
            ]

        if len(staged.passes) != len(staged.parts):
            staged.passes = [{} for _ in staged.parts]
        staged.later = (self._pump.submit(submit), version)

    # ------------------------------------------------------------------------------ weights
    def sync_weights(self, version: int, *, full: bool = False) -> dict[str, float]:
        """Stream the trainer's weights to every replica. The first sync (and `full`) moves every
        tensor, so the replicas match whatever the trainer loaded; later ones with LoRA only the
        adapters (the base weights do not change). A no-op when the replicas hold `version`."""
        if version == self.weight_version and self._synced_once and not full:
            return {}
        full = full or not self._synced_once
        start = time.perf_counter()
        specs = self.trainer.call_async("weights.specs", full)[0].result(self.timeout_s)
        sync_timeout = self.cfg.rollout.weight_sync.timeout_s + 30
        sends = self.trainer.call_async("weights.send", full, self.bucket_bytes)
        receives = [
            self.replicas.submit(rank, "receive_weights", specs, version, self.bucket_bytes)
            for rank in range(self.replicas.size)
        ]
        sent = gather(sends + receives, timeout=sync_timeout)[0]
        self.weight_version, self._synced_once = version, True
        return {
            "weight_sync/seconds": time.perf_counter() - start,
            "weight_sync/bytes": float(sent.get("weight_sync/bytes", 0.0)),
            "weight_sync/tensors": float(sent.get("weight_sync/tensors", 0.0)),
            "weight_sync/full": float(full),
        }

    def publish_weights(self, version: int) -> dict[str, float]:
        """With batches in flight (diffrl.controller.pipeline): the trainer ranks copy what a sync
        moves (the LoRA adapters, or every tensor of full fine-tuning; rank 0 keeps the copy in host
        memory) and a delivery of that copy is queued on the request pump, behind the batches
        already queued: the replicas sample those
        with the weights they were scheduled for, then receive `version`, while the trainer goes on
        training. What a batch is sampled with therefore depends on the order of the queue, never on
        timing. Returns what the copy holds (bytes, tensors) and the seconds the trainer spent."""
        if not self._synced_once:  # the loop syncs (every tensor) before it starts a pipeline
            raise RuntimeError("publish_weights before the first sync_weights")
        self._raise_failed_delivery()
        start = time.perf_counter()
        specs = gather(self.trainer.call_async("weights.snapshot", version, False), timeout=self.timeout_s)[0]
        self._deliveries.append(self._pump.submit(self._deliver, version, specs))
        return {
            "weight_sync/seconds": time.perf_counter() - start,
            "weight_sync/bytes": float(sum(spec.nbytes for spec in specs)),
            "weight_sync/tensors": float(len(specs)),
            "weight_sync/full": 0.0,
        }

    def _deliver(self, version: int, specs: list[Any]) -> None:
        """On the pump, between two batches' requests (the replicas are idle): trainer rank 0
        streams its copy of `version` (after the call it is running, if any), the replicas receive
        it. A failure stops the batches queued after it (`_stream`)."""
        try:
            calls = [self.trainer.submit(0, "weights.send_snapshot", version, self.bucket_bytes)]
            calls += [
                self.replicas.submit(rank, "receive_weights", specs, version, self.bucket_bytes)
                for rank in range(self.replicas.size)
            ]
            running = list(calls)
            deadline = time.monotonic() + self.cfg.rollout.weight_sync.timeout_s + 30
            while running:  # short waits, so a run that stops ends this thread too
                if self._cancel.is_set():
                    raise RuntimeError("weight delivery cancelled: the run is stopping")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    wait_any(running, timeout=0)  # the TimeoutError names the silent workers
                for future in wait_done(running, timeout=max(0.0, min(remaining, _POLL_S))):
                    failure = failure_of(future)  # a failed send or receive
                    if failure is not None:
                        raise blame(failure, calls)  # a peer that died, rather than the send it broke
                    running.remove(future)
        except BaseException as err:
            self._delivery_error = err
            raise
        self.weight_version = version

    def _raise_failed_delivery(self) -> None:
        """Re-raise the first failed weight delivery here; forget the ones that are done."""
        for future in self._deliveries:
            if future.done():
                future.result()
        self._deliveries = [future for future in self._deliveries if not future.done()]

    def drain(self) -> None:
        """Wait (at most trainer.worker_timeout_s) for everything queued on the request pump: the
        batches being sampled and the weight deliveries between them."""
        try:
            self._pump.submit(lambda: None).result(self.timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"the queued sampling and weight deliveries did not finish within "
                f"trainer.worker_timeout_s={self.timeout_s:g} s"
            ) from None
        self._raise_failed_delivery()

    def shutdown(self) -> None:
        self._cancel.set()
        self._pump.shutdown(wait=False, cancel_futures=True)


def sync_backend(cfg: Config, has_gpu: bool) -> str:
    """`rollout.weight_sync.backend`, with auto resolved: NCCL needs every member on its own GPU,
    so replicas that share a GPU with the trainer (a GPU share below 1) or CPU workers use gloo."""
    chosen = cfg.rollout.weight_sync.backend
    if chosen != "auto":
        return chosen
    own_gpus = cfg.trainer.gpus_per_worker >= 1 and cfg.rollout.gpus_per_replica >= 1
    return "nccl" if has_gpu and own_gpus else "gloo"


__all__ = ["Colocated", "PendingRollout", "Placement", "Separate", "StagedRollout", "sync_backend"]
