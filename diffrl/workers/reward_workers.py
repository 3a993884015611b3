"""Reward workers: score micro-batches as they arrive, so scoring overlaps sampling.

A worker role like the model workers (Ray actors, the same liveness watch and errors); the reward
functions themselves are `diffrl.rewards`'.

The controller's loop, with either implementation:

    workers = create_reward_workers(cfg.reward, use_ray=True)   # models load once per worker
    handles = []
    for micro_batch in sampler:                                  # sampling the next micro-batch ...
        handles.append(workers.submit(mb.pixels, mb.prompts, mb.metadata))   # ... while this one scores
                                                                 # (edit runs: sources=each sample's images)
    rewards = gather(handles)                                    # RewardBatch of the whole step, in order
    metrics.update(rewards.metrics(uids))

- `RayRewardWorkers`: `reward.workers` Ray actors, each with `reward.cpus_per_worker` CPUs and
  `reward.gpus_per_worker` GPUs (fractions share a GPU), each holding its own `MultiReward`.
  `submit` sends the micro-batch to the next actor (round robin) and returns at once with a
  handle on the Ray `ObjectRef`; scoring runs in the actor's process, truly in parallel with the
  sampler. Micro-batches are equal-sized, so round robin balances the load.
- `InProcessRewardWorkers`: the same interface in this process, for tests, single-process runs and
  debugging: with `overlap=True` one background thread scores (torch, Tesseract and HTTP release
  the GIL, so this overlaps too); with `overlap=False` `submit` scores before it returns.

`handle.result()` returns the micro-batch's `RewardBatch` or raises what scoring raised (a
`RewardError` for a required reward's failure; Ray re-raises it as a subclass of the same type).
A Ray reward actor that died (killed, out of memory) raises the trainer's `WorkerError` naming
the reward worker, as its own workers do, not Ray's raw `ActorDiedError`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import torch

from diffrl.rewards.multi import MultiReward, RewardBatch, RewardSpec, reward_specs
from diffrl.workers import liveness
from diffrl.workers.errors import WorkerError, WorkerIdentity, log_tail
from diffrl.workers.futures import get_watched
from diffrl.workers.ray_group import learn_identities

#: Seconds the reward actors may take to load their models before the run gives up on them.
READY_TIMEOUT_S = 900.0

if TYPE_CHECKING:
    from diffrl.config.schema import RewardConfig


class RewardHandle(Protocol):
    """A micro-batch being scored."""

    def result(self, timeout: float | None = None) -> RewardBatch:
        """Wait (at most `timeout` seconds, then TimeoutError) and return the scores."""
        ...

    def done(self) -> bool:
        """Whether `result()` would return (or raise) without waiting."""
        ...


class RewardWorkers(Protocol):
    """Scores micro-batches asynchronously; see the module docstring."""

    def submit(
        self,
        pixels: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
        sources: Sequence[Sequence[Any]] | None = None,
    ) -> RewardHandle: ...

    def close(self) -> None: ...


def gather(handles: Sequence[RewardHandle], timeout: float | None = None) -> RewardBatch:
    """Wait for every handle (all of them within `timeout` seconds, then TimeoutError) and join
    their micro-batches in submission order."""
    deadline = None if timeout is None else time.monotonic() + timeout
    return RewardBatch.concat(
        [
            handle.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
            for handle in handles
        ]
    )


# ------------------------------------------------------------------------------------ in process
class _FutureHandle:
    def __init__(self, future: Future[RewardBatch]) -> None:
        self.future = future

    def result(self, timeout: float | None = None) -> RewardBatch:
        return self.future.result(timeout)

    def done(self) -> bool:
        return self.future.done()


class InProcessRewardWorkers:
    """`RewardWorkers` in this process (one `MultiReward`, scored on one background thread)."""

    def __init__(self, functions: Mapping[str, Any] | Sequence[RewardSpec], overlap: bool = True) -> None:
        self.reward = MultiReward(functions)
        self.overlap = overlap
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffrl-reward") if overlap else None
        )

    def submit(
        self,
        pixels: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
        sources: Sequence[Sequence[Any]] | None = None,
    ) -> RewardHandle:
        # Copy the inputs now: the caller may reuse its buffers for the next micro-batch. Source
        # images are never written (ConditionImages are frozen): the rows are copied, not the images.
        pixels, prompts = pixels.detach().cpu().clone(), list(prompts)
        metadata = None if metadata is None else [dict(row) for row in metadata]
        sources = None if sources is None else [tuple(row) for row in sources]
        if self._pool is not None:
            return _FutureHandle(self._pool.submit(self.reward, pixels, prompts, metadata, sources))
        future: Future[RewardBatch] = Future()
        try:
            future.set_result(self.reward(pixels, prompts, metadata, sources))
        except Exception as err:
            future.set_exception(err)
        return _FutureHandle(future)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> InProcessRewardWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------------- Ray
class RewardWorker:
    """The body of one Ray reward actor: a `MultiReward` built in the actor's process."""

    def __init__(self, specs: list[RewardSpec]) -> None:
        # An exception raised here would kill the actor and reach the driver as an opaque
        # ActorDiedError; kept and re-raised by `ready`, it arrives as itself (a FileNotFoundError
        # naming the missing model file, say).
        self.reward: MultiReward | None = None
        self.error: Exception | None = None
        try:
            self.reward = MultiReward(specs)
        except Exception as err:
            self.error = err

    def ready(self) -> bool:
        """Returns once the models are loaded; raises what loading raised."""
        if self.error is not None:
            raise self.error
        return True

    def score(
        self,
        pixels: torch.Tensor,
        prompts: list[str],
        metadata: list[dict[str, Any]] | None,
        sources: list[tuple[Any, ...]] | None = None,
    ) -> RewardBatch:
        if self.reward is None:
            raise RuntimeError(f"this reward worker failed to start: {self.error!r}")
        return self.reward(pixels, prompts, metadata, sources)


def _died(
    err: Exception, index: int, size: int, method: str, identity: WorkerIdentity | None = None
) -> WorkerError:
    """The error of a reward actor that died: where it ran and its last log lines, when known."""
    tail = None if identity is None else log_tail(identity)
    return WorkerError(index, size, f"RewardWorker.{method}", err, identity=identity, log_tail=tail)


class _RayHandle:
    def __init__(self, ref: Any, index: int, size: int, identity: WorkerIdentity | None = None) -> None:
        self.ref = ref  # a ray.ObjectRef of the RewardBatch
        self.index, self.size = index, size  # which reward worker scores it
        self.identity = identity

    def result(self, timeout: float | None = None) -> RewardBatch:
        import ray

        try:
            return get_watched(self.ref, timeout)  # ray.get, ended by a worker found dead meanwhile
        except ray.exceptions.GetTimeoutError:
            where = self.identity or f"reward worker {self.index}"
            raise TimeoutError(f"{where} did not score a micro-batch within {timeout:g} s") from None
        except ray.exceptions.RayActorError as err:
            raise _died(err, self.index, self.size, "score", self.identity) from err

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)


class RayRewardWorkers:
    """`workers` Ray actors scoring micro-batches; needs `ray.init()` first (the trainer's job)."""

    def __init__(
        self,
        functions: Mapping[str, Any] | Sequence[RewardSpec],
        workers: int = 1,
        cpus_per_worker: float = 1.0,
        gpus_per_worker: float = 0.0,
        env_vars: Mapping[str, str] | None = None,
    ) -> None:
        import ray

        if not ray.is_initialized():
            raise RuntimeError(
                "RayRewardWorkers needs a running Ray: call ray.init() first (the trainer does, from "
                "trainer.ray_address), or use InProcessRewardWorkers"
            )
        if workers < 1:
            raise ValueError(f"reward.workers={workers!r} is invalid: must be >= 1")
        # Check names and args here, before any actor starts, so a typo fails in the driver.
        specs = list(functions) if isinstance(functions, Sequence) else reward_specs(functions)
        # env_vars: e.g. the thread-pool sizes of diffrl.workers.threads, read when the actor starts
        actor_class = ray.remote(RewardWorker).options(
            num_cpus=cpus_per_worker,
            num_gpus=gpus_per_worker,
            runtime_env={"env_vars": dict(env_vars or {})},
        )
        self.actors = [actor_class.remote(specs) for _ in range(workers)]
        # Wait for model loading so a missing file fails here, not at the first micro-batch.
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            for index, ref in enumerate([actor.ready.remote() for actor in self.actors]):
                try:
                    ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                except ray.exceptions.GetTimeoutError:
                    raise TimeoutError(
                        f"reward worker {index} did not load its reward models within {READY_TIMEOUT_S:g} s"
                    ) from None
                except ray.exceptions.RayActorError as err:
                    raise _died(err, index, workers, "__init__") from err
            # where each actor runs, so a death later names its node, PID and last log lines
            self.identities = learn_identities(self.actors, "RewardWorker", timeout_s=60.0)
            # a reward worker that dies is noticed within a second (diffrl.workers.liveness), not
            # at the next gather of scores; the workers that submit to it are other processes
            self._watch = liveness.watch(self.actors, self.identities)
        except Exception:
            self.close()
            raise
        self._submitted = 0  # round robin; a plain int so the object pickles into other actors

    def submit(
        self,
        pixels: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
        sources: Sequence[Sequence[Any]] | None = None,
    ) -> RewardHandle:
        index = self._submitted % len(self.actors)
        self._submitted += 1
        rows = None if metadata is None else [dict(row) for row in metadata]
        # ConditionImages travel as their path or encoded bytes (pickled once per distinct image:
        # the samples of a prompt share the object) and are decoded in the actor, if a reward reads them.
        images = None if sources is None else [tuple(row) for row in sources]
        ref = self.actors[index].score.remote(pixels.detach().cpu(), list(prompts), rows, images)
        return _RayHandle(ref, index, len(self.actors), self.identities[index])

    def close(self) -> None:
        import ray

        if getattr(self, "_watch", None) is not None:  # first: the kills are no deaths to report
            self._watch.stop()
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []

    def __enter__(self) -> RayRewardWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------ rewards with own GPUs
class _MergedHandle:
    """A micro-batch scored by several pools; `result` merges their parts (`RewardBatch.merge`)."""

    def __init__(self, handles: list[RewardHandle], specs: list[RewardSpec]) -> None:
        self.handles, self.specs = handles, specs

    def result(self, timeout: float | None = None) -> RewardBatch:
        deadline = None if timeout is None else time.monotonic() + timeout
        parts = [
            handle.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
            for handle in self.handles
        ]
        return RewardBatch.merge(parts, self.specs)

    def done(self) -> bool:
        return all(handle.done() for handle in self.handles)


class PooledRewardWorkers:
    """Reward workers in several pools: each reward with GPUs of its own (`reward.functions.<name>.gpus`
    > 0) in a pool of its own, the other rewards in the shared one. Every micro-batch goes to every
    pool at once, so the pools score in parallel; its handle returns the merged `RewardBatch`, the
    total as one `MultiReward` of all the rewards would compute it."""

    def __init__(self, specs: Sequence[RewardSpec], pools: Sequence[RewardWorkers]) -> None:
        self.specs, self.pools = list(specs), list(pools)

    def submit(
        self,
        pixels: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
        sources: Sequence[Sequence[Any]] | None = None,
    ) -> RewardHandle:
        return _MergedHandle(
            [pool.submit(pixels, prompts, metadata, sources) for pool in self.pools], self.specs
        )

    def close(self) -> None:
        for pool in self.pools:
            pool.close()
        self.pools = []

    def __enter__(self) -> PooledRewardWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reward_pools(cfg: RewardConfig) -> list[tuple[list[RewardSpec], int, float, float]]:
    """The Ray pools `reward.*` asks for, each (its rewards, workers, CPUs and GPUs per worker):
    the shared pool (`reward.workers`, `cpus_per_worker`, `gpus_per_worker`) of the rewards without
    GPUs of their own, if any, then one pool per reward with `gpus` > 0 (its `workers`, each with
    `reward.cpus_per_worker` CPUs and its `gpus`). Checks every entry, loading no model."""
    specs = reward_specs(cfg.functions)
    shared = [spec for spec in specs if spec.gpus == 0]
    pools = [(shared, cfg.workers, cfg.cpus_per_worker, cfg.gpus_per_worker)] if shared else []
    pools += [([spec], spec.workers, cfg.cpus_per_worker, spec.gpus) for spec in specs if spec.gpus > 0]
    return pools


def reward_resources(cfg: RewardConfig) -> tuple[float, float]:
    """(CPUs, GPUs) that the Ray reward workers of `reward.*` take in all (`reward_pools`)."""
    pools = reward_pools(cfg)
    return (
        sum(workers * cpus for _, workers, cpus, _ in pools),
        sum(workers * gpus for _, workers, _, gpus in pools),
    )


def create_reward_workers(
    cfg: RewardConfig, *, use_ray: bool, env_vars: Mapping[str, str] | None = None
) -> RewardWorkers:
    """The reward workers `reward.*` asks for: Ray actors, or the in-process equivalent.

    `reward.overlap` applies to the in-process workers (background thread or not); Ray workers
    always score in their own processes, and the trainer decides when it collects. `env_vars` is
    set in each Ray actor's environment (the in-process workers share the caller's). With Ray, a
    reward with `gpus` > 0 gets a pool of its own (`PooledRewardWorkers`); Ray gives its actors
    GPUs that no other actor or placement group holds, so not the policy's. In process, every
    reward scores in this process, on its device.
    """
    if not use_ray:
        return InProcessRewardWorkers(cfg.functions, overlap=cfg.overlap)
    pools = reward_pools(cfg)
    if len(pools) == 1:  # one pool scores every reward: nothing to merge
        specs, workers, cpus, gpus = pools[0]
        return RayRewardWorkers(specs, workers, cpus, gpus, env_vars=env_vars)
    started: list[RewardWorkers] = []
    try:
        for specs, workers, cpus, gpus in pools:
            started.append(RayRewardWorkers(specs, workers, cpus, gpus, env_vars=env_vars))
    except BaseException:
        for pool in started:
            pool.close()
        raise
    # the config's order: the merged total adds the rewards in it, as one MultiReward would
    return PooledRewardWorkers(reward_specs(cfg.functions), started)
