"""WorkerGroup: how the single controller calls its workers, explicitly and by name.

The controller holds one group per role (actor, rollout, reference, reward, ...) and calls the
workers' small typed API through three verbs, so every remote call in a trainer is greppable:

    with RayGroup(ActorWorker, 4, cfg, num_gpus=1) as actors:
        actors.call("load_checkpoint", path)                       # same args to all, results by rank
        metrics = actors.scatter("forward_backward", shards, loss="flow_grpo")   # worker i gets shards[i]
        pending = rollout.call_async("sample", prompts)           # returns at once ...
        scores = reward_model.score(previous_pixels)              # ... the controller works meanwhile
        rollouts = gather(pending)                                # then waits, results by rank

There is no metaprogrammed dispatch (no decorators that split or merge arguments): splitting a
batch into shards and joining the results is the controller's visible code.

A worker is composed of parts (diffrl.workers.roles): its own methods are the step's calls, and
the parts it declares in `PARTS` (name -> class) are addressed as `"part.method"`, the method's
name in that class (`trainer.call("weights.send", full, bucket_bytes)` runs
`worker.weights.send(full, bucket_bytes)`). One dot, a declared part, a public method: nothing
else is looked up (`bound_method`).

Two implementations with the same semantics:

- `RayGroup` (in `ray_group`): one Ray actor per worker (`ray.remote(cls)`), each in its own
  bundle of a placement group (`PACK` or `SPREAD`), with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
  `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` in its environment, so the workers can call
  `torch.distributed.init_process_group(backend)` (the `env://` default) and form a process group
  among themselves: gloo on CPU, NCCL on GPUs, FSDP2 on top.
- `InProcessGroup` (here): n instances in this process, for tests, debugging and single-CPU
  runs; each worker has one thread of its own (like an actor: its calls run one at a time, in
  order), or runs in the caller's thread with `synchronous=True` (for a debugger).

Semantics shared by both:

- Calls to one worker run in the order they were made; different workers run concurrently.
- `gather` (in `futures`, like every wait) returns results in the order of the futures given
  (rank order for one call). It fails fast: the first worker error seen is raised as a
  `WorkerError` naming the rank, the method and the original exception, even while other workers
  still run (a rank blocked in a collective waiting for a dead peer would otherwise hang the
  controller). A dead worker is named before the
  peers that failed because of it (`blame`): a method's error waits up to `DEATH_GRACE_S` for Ray
  to report a death among the other calls.
- Constructor errors surface when the group is created, as a `WorkerError` with the rank.
- A Ray worker that dies (killed, out of memory, crashed) or becomes unreachable fails its calls
  with a `WorkerError` naming its class, rank, node IP and PID and quoting the last lines it
  logged (from the files Ray sends its stdout and stderr to), so a dead rollout replica, trainer
  rank or reward worker is identified from the message alone. `wait_any` waits for the first of
  several calls to finish, with the same fail-fast rule.
- A Ray worker that dies while idle, or while the controller waits on other workers, is found by
  the liveness watch (`liveness`, within about a second) and the controller's current or next wait
  raises its `WorkerError` ("died while idle (its last call: ...)" or "died during ...").

One difference to keep in mind: Ray copies arguments and results (pickling; NumPy arrays come back
read-only), `InProcessGroup` passes the objects themselves, so a worker that mutates an argument
in place changes the controller's object only in process. Workers should not mutate arguments.

Where things live, each module importing only from those before it: `errors` (`WorkerError`,
`WorkerIdentity`, log tails) <- `liveness` (the watch on Ray actors) <- `futures` (`WorkerFuture`,
`gather`, `wait_any`, `blame`) <- this module (the `WorkerGroup` API, its verbs written once, and
`InProcessGroup`) <- `ray_group` (`RayGroup`, `ensure_ray`).
"""

from __future__ import annotations

import concurrent.futures
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from diffrl.workers.futures import LocalFuture, WorkerFuture, gather

__all__ = ["InProcessGroup", "WorkerGroup", "bound_method", "public_methods"]


# ----------------------------------------------------------------------------------- the API
class WorkerGroup(ABC):
    """`size` workers of one class, called by method name; see the module docstring.

    Subclasses implement `_submit(rank, method, args, kwargs)` and `shutdown()`; the verbs are
    written once here so both groups share their argument checking and semantics.
    """

    cls: type
    size: int
    _closed: bool = False  # set by shutdown()
    # The deadline of `call` and `scatter` (seconds, None = none): a worker that takes longer has
    # stopped answering, and the TimeoutError names it (the trainer sets trainer.worker_timeout_s).
    timeout_s: float | None = None

    # ------------------------------------------------------------------ what a subclass provides
    @abstractmethod
    def _submit(self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> WorkerFuture:
        """Start `method(*args, **kwargs)` on worker `rank`; return at once."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers (and their resources). Idempotent; the group is unusable after."""

    # ------------------------------------------------------------------------------ the verbs
    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method(*args, **kwargs)` on every worker and wait (at most `timeout_s`); results
        in rank order."""
        return gather(self.call_async(method, *args, **kwargs), self.timeout_s)

    def scatter(self, method: str, shards: Sequence[Any], **kwargs: Any) -> list[Any]:
        """Call `method(shards[i], **kwargs)` on worker i and wait (at most `timeout_s`); results
        in rank order."""
        return gather(self.scatter_async(method, shards, **kwargs), self.timeout_s)

    def submit(self, rank: int, method: str, *args: Any, **kwargs: Any) -> WorkerFuture:
        """Call `method(*args, **kwargs)` on worker `rank` alone, without waiting (a request to one
        replica of a pool, load-balanced by the caller)."""
        self._check_method(method)
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not a worker of this group of {self.size}")
        return self._submit(rank, method, args, kwargs)

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> list[WorkerFuture]:
        """`call` without waiting: one future per worker, in rank order (collect with `gather`)."""
        self._check_method(method)
        args, kwargs = self._share_args(args, kwargs)
        return [self._submit(rank, method, args, kwargs) for rank in range(self.size)]

    def scatter_async(self, method: str, shards: Sequence[Any], **kwargs: Any) -> list[WorkerFuture]:
        """`scatter` without waiting: one future per worker, in rank order (collect with `gather`)."""
        self._check_method(method)
        if isinstance(shards, str | bytes | Mapping) or not hasattr(shards, "__len__"):
            raise TypeError(
                f"scatter({method!r}, shards=...) needs a sequence of {self.size} shards (one per "
                f"worker), got {type(shards).__name__}"
            )
        if len(shards) != self.size:
            raise ValueError(
                f"scatter({method!r}) got {len(shards)} shards for {self.size} workers: pass exactly "
                f"one shard per worker (split the batch into {self.size}, e.g. with tensor.chunk({self.size}))"
            )
        _, kwargs = self._share_args((), kwargs)
        return [self._submit(rank, method, (shards[rank],), kwargs) for rank in range(self.size)]

    def gather(self, futures: Sequence[WorkerFuture], timeout: float | None = None) -> list[Any]:
        """The module-level `gather` (here too, so `group.gather(group.call_async(...))` reads well)."""
        return gather(futures, timeout)

    # --------------------------------------------------------------------------------- helpers
    def _share_args(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Hook to prepare arguments sent to every worker once (RayGroup stores them once)."""
        return args, kwargs

    def _check_method(self, method: str) -> None:
        """Fail in the controller, before anything is sent, when `method` is not on the class (or,
        for `part.method`, on the class of a part it declares)."""
        self._check_open()
        part, _, name = method.rpartition(".")
        parts = getattr(self.cls, "PARTS", {})
        owner = parts.get(part) if part else self.cls
        if owner is None:
            raise ValueError(
                f"{self.cls.__name__} has no part {part!r} (in {method!r}); its parts are {sorted(parts)}"
            )
        if name.startswith("_") or not callable(getattr(owner, name, None)):
            public = [
                f"{prefix}{n}"
                for prefix, cls in [("", self.cls), *((f"{p}.", c) for p, c in sorted(parts.items()))]
                for n in public_methods(cls)
            ]
            raise ValueError(f"{self.cls.__name__} has no method {method!r}; its public methods are {public}")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} of {self.cls.__name__} was shut down")

    def __len__(self) -> int:
        return self.size

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "shut down" if self._closed else f"{self.size} workers"
        return f"{type(self).__name__}({self.cls.__name__}, {state})"


def public_methods(cls: type) -> list[str]:
    """The names of `cls`'s public methods, sorted (a worker's RPC surface, a part's calls)."""
    return sorted(
        name for name, value in inspect.getmembers(cls) if callable(value) and not name.startswith("_")
    )


def bound_method(worker: Any, method: str) -> Callable[..., Any]:
    """`worker.method`, or for `part.method` the method of the part `worker` declares in
    `PARTS` under that name (the module docstring); the group checked the name before sending."""
    part, _, name = method.rpartition(".")
    if part:
        if part not in getattr(type(worker), "PARTS", {}):
            raise ValueError(f"{type(worker).__name__} has no part {part!r} (in {method!r})")
        return getattr(getattr(worker, part), name)
    return getattr(worker, method)


def _check_reserved_names(cls: type, reserved: Sequence[str], group: str) -> None:
    """Group options share the keyword space with `cls`'s constructor; refuse an ambiguous class.

    `RayGroup(cls, n, *args, num_gpus=1, **kwargs)` forwards `*args/**kwargs` to `cls`, so a
    constructor parameter named like a group option could never be passed; say so instead of
    silently giving the value to the group.
    """
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return
    clashes = sorted(set(params) & set(reserved))
    if clashes:
        raise TypeError(
            f"{cls.__name__}.__init__ has parameter(s) {clashes} with the same name as {group} options, "
            f"so they could not be passed through {group}(cls, n, *args, **kwargs); rename them in "
            f"{cls.__name__}"
        )


def _check_size(n: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"a worker group needs n >= 1 workers, got n={n!r}")


# -------------------------------------------------------------------------------- in process
class InProcessGroup(WorkerGroup):
    """`n` instances of `cls` in this process, with the same semantics as `RayGroup`.

    Each worker gets one thread of its own, created before the instance and used for every call,
    so per-thread state a worker sets up in `__init__` (CUDA current device, grad mode) holds for
    its calls, calls to one worker never overlap, and the controller can overlap work with
    `call_async` (torch ops release the GIL). `synchronous=True` runs everything in the caller's
    thread instead (futures come back already resolved), for debuggers and profilers.

    No distributed environment is set up: `n` instances in one process cannot form a
    torch.distributed process group; use `RayGroup` for that.
    """

    OPTIONS: tuple[str, ...] = ("synchronous",)

    def __init__(self, cls: type, n: int, *args: Any, synchronous: bool = False, **kwargs: Any) -> None:
        _check_size(n)
        _check_reserved_names(cls, self.OPTIONS, "InProcessGroup")
        self.cls = cls
        self.size = n
        self.synchronous = synchronous
        self._executors: list[concurrent.futures.ThreadPoolExecutor] = []
        if not synchronous:
            self._executors = [
                concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=f"diffrl-{cls.__name__}-{rank}"
                )
                for rank in range(n)
            ]
        self.workers: list[Any] = [None] * n  # the instances, for tests; the controller uses the verbs
        constructed = [self._run(rank, f"{cls.__name__}.__init__", cls, args, kwargs) for rank in range(n)]
        try:
            self.workers = gather(constructed)
        except BaseException:
            self.shutdown()
            raise

    def _run(
        self, rank: int, label: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> LocalFuture:
        if self.synchronous:
            future: concurrent.futures.Future = concurrent.futures.Future()
            try:
                future.set_result(fn(*args, **kwargs))
            except Exception as err:
                future.set_exception(err)
        else:
            future = self._executors[rank].submit(fn, *args, **kwargs)
        return LocalFuture(future, rank, self.size, label)

    def _submit(self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> WorkerFuture:
        bound = bound_method(self.workers[rank], method)
        return self._run(rank, f"{self.cls.__name__}.{method}", bound, args, kwargs)

    def shutdown(self) -> None:
        """Let running calls finish, cancel queued ones, drop the instances (freeing their memory)."""
        for executor in self._executors:
            executor.shutdown(wait=True, cancel_futures=True)
        self._executors = []
        self.workers = []
        self._closed = True
