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

Two implementations with the same semantics:

- `RayGroup`: one Ray actor per worker (`ray.remote(cls)`), each in its own bundle of a placement
  group (`PACK` or `SPREAD`), with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
  `MASTER_ADDR` and `MASTER_PORT` in its environment, so the workers can call
  `torch.distributed.init_process_group(backend)` (the `env://` default) and form a process group
  among themselves: gloo on CPU, NCCL on GPUs, FSDP2 on top.
- `InProcessGroup`: n instances in this process, for tests, debugging and single-CPU runs; each
  worker has one thread of its own (like an actor: its calls run one at a time, in order), or runs
  in the caller's thread with `synchronous=True` (for a debugger).

Semantics shared by both:

- Calls to one worker run in the order they were made; different workers run concurrently.
- `gather` returns results in the order of the futures given (rank order for one call). It fails
  fast: the first worker error seen is raised as a `WorkerError` naming the rank, the method and
  the original exception, even while other workers still run (a rank blocked in a collective
  waiting for a dead peer would otherwise hang the controller). A dead worker is named before the
  peers that failed because of it (`blame`): a method's error waits up to `DEATH_GRACE_S` for Ray
  to report a death among the other calls.
- Constructor errors surface when the group is created, as a `WorkerError` with the rank.
- A Ray worker that dies (killed, out of memory, crashed) or becomes unreachable fails its calls
  with a `WorkerError` naming its class, rank, node IP and PID and quoting the last lines it
  logged (from the files Ray sends its stdout and stderr to), so a dead rollout replica, trainer
  rank or reward worker is identified from the message alone. `wait_any` waits for the first of
  several calls to finish, with the same fail-fast rule.

One difference to keep in mind: Ray copies arguments and results (pickling; NumPy arrays come back
read-only), `InProcessGroup` passes the objects themselves, so a worker that mutates an argument
in place changes the controller's object only in process. Workers should not mutate arguments.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import os
import re
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

__all__ = [
    "InProcessGroup",
    "RayGroup",
    "WorkerError",
    "WorkerFuture",
    "WorkerGroup",
    "WorkerIdentity",
    "blame",
    "ensure_ray",
    "failure_of",
    "gather",
    "wait_any",
    "wait_done",
]

PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
PLACEMENT_STRATEGIES: tuple[str, ...] = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

# Environment variables RayGroup sets on every actor; user env_vars may not override them.
DIST_ENV_VARS: tuple[str, ...] = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


# ------------------------------------------------------------------------------------- errors
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class WorkerIdentity:
    """Where one Ray worker runs: what a failure message needs to point at it.

    `log_files` are the files the actor process's stdout and stderr go to (Ray redirects them to
    `worker-*.out` / `worker-*.err` in its session's logs directory on the worker's node); empty
    when they are not regular files (output to a terminal or a pipe) or the platform cannot say.
    """

    rank: int
    cls_name: str
    node_ip: str
    node_id: str
    pid: int
    log_files: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.cls_name} rank {self.rank} on node {self.node_ip} (pid {self.pid})"


class WorkerError(RuntimeError):
    """A worker's method (or constructor) raised, or its process died; `rank`, `method`, `cause`.

    One exception type for both groups, so the controller can catch worker failures without
    caring where the worker ran. `cause` is the exception the worker raised, unwrapped from Ray's
    `RayTaskError` (for an actor that died, the `RayActorError`). For Ray the message carries the
    remote traceback, since the cause object has none in this process. For a Ray worker whose
    process died, `identity` says where it ran and `log_tail` holds the last lines it logged (or
    where to find them), both in the message.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        method: str,
        cause: BaseException,
        remote_traceback: str | None = None,
        identity: WorkerIdentity | None = None,
        log_tail: str | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self.method = method
        self.cause = cause
        self.remote_traceback = remote_traceback
        self.identity = identity
        self.log_tail = log_tail
        if identity is None:
            message = f"worker rank {rank} (of {size}) failed in {method}: {type(cause).__name__}: {cause}"
        else:
            # ActorUnavailableError: Ray lost contact, the process may still exist (and hang).
            verb = "became unreachable" if type(cause).__name__ == "ActorUnavailableError" else "died"
            message = (
                f"{identity.cls_name} rank {rank} (of {size}) on node {identity.node_ip} "
                f"(pid {identity.pid}) {verb} during {method}: {type(cause).__name__}: {cause}"
            )
        # Ray colours its task names and actor output; escape codes make messages unreadable.
        message = _ANSI.sub("", message)
        if remote_traceback:
            message += f"\n\nRemote traceback of rank {rank}:\n{_ANSI.sub('', remote_traceback).rstrip()}"
        if log_tail:
            message += f"\n\n{log_tail.rstrip()}"
        super().__init__(message)

    @property
    def process_failed(self) -> bool:
        """Whether the worker's process died or became unreachable (Ray's `RayActorError`), rather
        than its method raising."""
        return any(cls.__name__ == "RayActorError" for cls in type(self.cause).__mro__)

    def __reduce__(self) -> tuple[Any, ...]:  # picklable, so a WorkerError can cross processes itself
        return (
            WorkerError,
            (
                self.rank,
                self.size,
                self.method,
                self.cause,
                self.remote_traceback,
                self.identity,
                self.log_tail,
            ),
        )


# How many lines of each log file a death message quotes, and how far back to look for them.
LOG_TAIL_LINES = 20
_LOG_TAIL_BYTES = 64 * 1024
# How long a failure waits for a task that reads the log of a worker on another node.
_REMOTE_LOG_TIMEOUT_S = 5.0
# Routing markers Ray writes into worker log files (ray_constants.LOG_PREFIX_*); not the worker's.
_RAY_LOG_MARKERS = (":job_id:", ":actor_name:", ":task_name:", ":event_summary:", ":info_message:")


def _actor_identity(_instance: Any) -> tuple[str, str, int, tuple[str, ...]]:
    """Runs inside an actor (`__ray_call__`): its node, PID and the files fd 1 and 2 point to."""
    import ray

    files: list[str] = []
    for fd in (1, 2):
        try:
            # Linux's view of the process's own descriptors; elsewhere (macOS) this fails.
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if os.path.isabs(target) and os.path.isfile(target) and target not in files:
            files.append(target)
    return (
        ray.util.get_node_ip_address(),
        ray.get_runtime_context().get_node_id(),
        os.getpid(),
        tuple(files),
    )


def _tail_lines(path: str, lines: int) -> list[str]:
    """The last `lines` lines of a text file (read from its end), without Ray's markers and colours."""
    with open(path, "rb") as file:
        size = file.seek(0, os.SEEK_END)
        file.seek(max(0, size - _LOG_TAIL_BYTES))
        text = file.read().decode("utf-8", errors="replace")
    if size > _LOG_TAIL_BYTES:
        text = text.split("\n", 1)[-1]  # the first line read is likely cut
    kept = [_ANSI.sub("", line.rstrip()) for line in text.splitlines()]
    kept = [line for line in kept if line and not line.startswith(_RAY_LOG_MARKERS)]
    return kept[-lines:]


def _read_tails(paths: Sequence[str], lines: int) -> dict[str, list[str]]:
    """`{path: last lines}` of the files readable here; runs here or as a task on a worker's node."""
    tails = {}
    for path in paths:
        try:
            tails[path] = _tail_lines(path, lines)
        except OSError:
            continue
    return tails


def _remote_tails(identity: WorkerIdentity, lines: int, timeout: float) -> dict[str, list[str]]:
    """Read the log files of a worker on another node with a task pinned to that node.

    Empty when the node cannot run it within `timeout` (the node died with the worker, say).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        task = ray.remote(num_cpus=0, max_retries=0)(_read_tails).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(identity.node_id, soft=False)
        )
        ref = task.remote(list(identity.log_files), lines)
        ready, _ = ray.wait([ref], timeout=timeout)
        if not ready:
            ray.cancel(ref, force=True)
            return {}
        return ray.get(ref, timeout=0)
    except Exception:  # the node is gone, Ray is shutting down: say where the files are instead
        return {}


def log_tail(identity: WorkerIdentity, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines a worker wrote to each of its log files, or where those files are."""
    if not identity.log_files:
        return (
            f"No log files are known for {identity} (its output did not go to files); look for its "
            "output in the console of the Ray node that ran it"
        )
    tails = _read_tails(identity.log_files, lines)  # same node, or a filesystem shared with it
    if len(tails) < len(identity.log_files) and _ray_is_up():
        tails.update(_remote_tails(identity, lines, _REMOTE_LOG_TIMEOUT_S))
    parts, silent = [], []
    for path in identity.log_files:
        if path not in tails:
            parts.append(f"Its log {path} is on node {identity.node_ip} (not readable from here).")
        elif tails[path]:
            n = len(tails[path])
            body = "\n".join(f"  {line}" for line in tails[path])
            parts.append(f"Last {n} {'line' if n == 1 else 'lines'} of {path}:\n{body}")
        else:
            silent.append(path)
    if silent and not parts:
        parts.append(f"It logged nothing ({', '.join(silent)}).")
    return "\n".join(parts)


def _ray_is_up() -> bool:
    import ray

    return ray.is_initialized()


# ------------------------------------------------------------------------------------ futures
class WorkerFuture(ABC):
    """The pending result of one call on one worker (from `call_async` / `scatter_async`).

    `result()` returns the value or raises `WorkerError`; pass a list of futures to `gather` to
    wait for several at once (fail-fast, results in order).
    """

    def __init__(self, rank: int, size: int, method: str) -> None:
        self.rank = rank
        self.size = size
        self.method = method  # "ClassName.method", for error messages

    @abstractmethod
    def result(self, timeout: float | None = None) -> Any:
        """Wait (at most `timeout` seconds, then `TimeoutError`) and return the call's result."""

    @abstractmethod
    def done(self) -> bool:
        """Whether `result()` would return (or raise) without waiting."""

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<{type(self).__name__} rank={self.rank} {self.method} {state}>"


class LocalFuture(WorkerFuture):
    """A `concurrent.futures.Future` of an `InProcessGroup` worker (possibly already resolved)."""

    def __init__(self, future: concurrent.futures.Future, rank: int, size: int, method: str) -> None:
        super().__init__(rank, size, method)
        self.future = future

    def result(self, timeout: float | None = None) -> Any:
        try:
            return self.future.result(timeout)
        except Exception as err:
            # concurrent.futures.TimeoutError is the builtin TimeoutError: tell our wait running
            # out (future still pending) from a TimeoutError the worker itself raised.
            if not self.future.done():
                raise TimeoutError(
                    f"rank {self.rank} {self.method} did not finish within {timeout} s"
                ) from None
            raise WorkerError(self.rank, self.size, self.method, err) from err

    def done(self) -> bool:
        return self.future.done()


class RayFuture(WorkerFuture):
    """A Ray `ObjectRef` of an actor method call; `identity` (where the actor runs) once known."""

    def __init__(
        self, ref: Any, rank: int, size: int, method: str, identity: WorkerIdentity | None = None
    ) -> None:
        super().__init__(rank, size, method)
        self.ref = ref
        self.identity = identity

    def result(self, timeout: float | None = None) -> Any:
        import ray

        try:
            return ray.get(self.ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"rank {self.rank} {self.method} did not finish within {timeout} s") from None
        except ray.exceptions.RayTaskError as err:
            raise _worker_error_from_ray(err, self.rank, self.size, self.method) from err.cause
        except ray.exceptions.RayActorError as err:
            # ActorDiedError, ActorUnavailableError: the process, not the method, failed.
            tail = None if self.identity is None else log_tail(self.identity)
            raise WorkerError(
                self.rank, self.size, self.method, err, identity=self.identity, log_tail=tail
            ) from err

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait([self.ref], timeout=0, fetch_local=False)
        return bool(ready)

    def __repr__(self) -> str:
        where = "" if self.identity is None else f" node={self.identity.node_ip} pid={self.identity.pid}"
        return super().__repr__()[:-1] + where + ">"


def _worker_error_from_ray(err: Any, rank: int, size: int, method: str) -> WorkerError:
    """Unwrap a `RayTaskError`: the original exception as `cause`, the remote traceback kept.

    `ray.get` raises `RayTaskError(ValueError)`-style instances (a subclass of both, from
    `as_instanceof_cause`) whose `str` is Ray's header (task name, pid, ip) and the remote
    traceback; `.cause` is the exception the worker raised.
    """
    return WorkerError(rank, size, method, err.cause, remote_traceback=str(err))


def gather(futures: Sequence[WorkerFuture], timeout: float | None = None) -> list[Any]:
    """Wait for `futures` and return their results in the order given.

    Fails fast: raises the first `WorkerError` seen without waiting for the other workers (a
    worker blocked in a collective for a failed peer may never return). When several have already
    failed, the lowest position in `futures` wins, except that a dead Ray worker is named before a
    method's error, also one Ray reports up to `DEATH_GRACE_S` later (`blame`). `timeout`
    (seconds, for the whole gather) raises `TimeoutError` naming the ranks still running. Futures
    of different groups may be mixed; if they are not all of one kind, they are awaited one by
    one, in order.
    """
    futures = list(futures)
    deadline = None if timeout is None else time.monotonic() + timeout
    if futures and all(isinstance(f, RayFuture) for f in futures):
        _wait_ray(futures, deadline, timeout)  # type: ignore[arg-type]
    elif futures and all(isinstance(f, LocalFuture) for f in futures):
        _wait_local(futures, deadline, timeout)  # type: ignore[arg-type]
    return [future.result(_remaining(deadline)) for future in futures]


# How long a method's error waits for Ray to report a dead worker among the other calls (`blame`).
# Both follow the death closely (gloo notices the closed connection at once, Ray the exited
# process: tens of milliseconds apart on 2 CPU cores, in either order); the grace allows for a
# loaded machine, and is spent only on the way to failing.
DEATH_GRACE_S = 3.0


def blame(error: WorkerError, futures: Sequence[WorkerFuture], grace_s: float = DEATH_GRACE_S) -> WorkerError:
    """The failure to report when `error` ended a wait on `futures`: `error` itself when its
    process failed; else the first of `futures` (in the order given) whose Ray worker is reported
    dead or unreachable within `grace_s` seconds; else `error`.

    Calls that wait on each other (the weight sync's send and receives, FSDP's all-reduces in an
    optimizer step) fail together when one worker dies: its gloo peers raise "a peer died" at once,
    and Ray can deliver that before it reports the death. The dead worker is the one to name. In
    process workers do not die on their own: with no Ray futures there is nothing to wait for."""
    if error.process_failed or grace_s <= 0:
        return error
    others = [future for future in futures if isinstance(future, RayFuture)]
    deadline = time.monotonic() + grace_s
    checked: set[int] = set()
    while True:
        for future in others:
            if id(future) in checked or not future.done():
                continue
            checked.add(id(future))
            failure = failure_of(future)
            if failure is not None and failure.process_failed:
                return failure
        left = list(dict.fromkeys(future.ref for future in others if id(future) not in checked))
        remaining = deadline - time.monotonic()
        if not left or remaining <= 0:
            return error
        import ray

        ray.wait(left, num_returns=1, timeout=remaining, fetch_local=False)


def failure_of(future: WorkerFuture) -> WorkerError | None:
    """The `WorkerError` of a finished call, or None when it succeeded."""
    try:
        future.result()
    except WorkerError as err:
        return err
    return None


def wait_any(futures: Sequence[WorkerFuture], timeout: float | None = None) -> list[WorkerFuture]:
    """Wait until at least one of `futures` is done; return the done ones, in the order given.

    For a controller that serves whichever worker finishes first (rollout replicas, say). Fails
    fast like `gather`: if one of the done futures failed, its `WorkerError` is raised (the lowest
    position first) instead of returning. `timeout` (seconds) raises `TimeoutError` naming the
    calls still running. Collect the values with `future.result()` (no waiting for a done one).
    """
    futures = list(futures)
    if not futures:
        raise ValueError("wait_any() needs at least one future (nothing would ever finish)")
    done = wait_done(futures, timeout)
    if not done:
        raise _timeout_error(futures, timeout, verb="wait_any")
    for future in done:
        # Raises its WorkerError if it failed. No timeout: a done Ray result may still have to come
        # from another node (ray.wait above does not fetch), which is not a worker that hangs.
        future.result()
    return done


def wait_done(futures: Sequence[WorkerFuture], timeout: float | None) -> list[WorkerFuture]:
    """The done ones of `futures` (in order) once at least one is, or [] after `timeout` seconds:
    `wait_any` without its errors, for a caller that polls (and checks other things between)."""
    futures = list(futures)
    deadline = None if timeout is None else time.monotonic() + timeout
    if all(isinstance(f, RayFuture) for f in futures):
        import ray

        refs = list(dict.fromkeys(f.ref for f in futures))  # type: ignore[attr-defined]  # ray.wait: unique
        ray.wait(refs, num_returns=1, timeout=_remaining(deadline), fetch_local=False)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        ready_set = set(ready)
        done = [f for f in futures if f.ref in ready_set]  # type: ignore[attr-defined]
    elif all(isinstance(f, LocalFuture) for f in futures):
        concurrent.futures.wait(
            [f.future for f in futures],  # type: ignore[attr-defined]
            timeout=_remaining(deadline),
            return_when=concurrent.futures.FIRST_COMPLETED,
        )
        done = [f for f in futures if f.done()]
    else:
        # Ray and in-process futures have no common wait: poll both, briefly.
        done = [f for f in futures if f.done()]
        while not done and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.01 if deadline is None else min(0.01, _remaining(deadline) or 0.0))
            done = [f for f in futures if f.done()]
    return done


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _timeout_error(
    pending: Sequence[WorkerFuture], timeout: float | None, verb: str = "gather"
) -> TimeoutError:
    """Name every call still running; for a Ray worker also where it runs and what it logged last.

    A worker that stops answering is as much a failure as one that died: the message must be
    enough to find it (the lines are short, the whole message stays readable for a few ranks).
    """
    running = ", ".join(f"rank {f.rank} {f.method}" for f in pending)
    message = f"{verb} timed out after {timeout} s while waiting for: {running}"
    seen = set()
    for future in pending:
        identity = getattr(future, "identity", None)
        if identity is None or identity in seen:
            continue
        seen.add(identity)
        message += f"\n\n{identity} is still running {future.method}.\n{log_tail(identity, 10)}"
    return TimeoutError(message)


def _wait_local(futures: list[LocalFuture], deadline: float | None, timeout: float | None) -> None:
    """Block until all are done or one fails; raise that failure (lowest position first)."""
    done, not_done = concurrent.futures.wait(
        [f.future for f in futures],
        timeout=_remaining(deadline),
        return_when=concurrent.futures.FIRST_EXCEPTION,
    )
    for future in futures:
        if future.future in done and future.future.exception() is not None:
            future.result()  # raises the WorkerError
    if not_done:
        raise _timeout_error([f for f in futures if f.future in not_done], timeout)


def _wait_ray(futures: list[RayFuture], deadline: float | None, timeout: float | None) -> None:
    """Like `_wait_local`, with `ray.wait`: look at each result as soon as it is ready."""
    import ray

    pending = list(futures)
    while pending:
        ready, _ = ray.wait([f.ref for f in pending], num_returns=1, timeout=_remaining(deadline))
        if not ready:
            raise _timeout_error(pending, timeout)
        # Everything already finished, not only the one ray.wait returned, in position order.
        ready_refs, _ = ray.wait([f.ref for f in pending], num_returns=len(pending), timeout=0)
        ready_set = set(ready_refs) | set(ready)
        finished = [f for f in pending if f.ref in ready_set]
        for future in finished:
            failure = failure_of(future)  # cheap for a result: it is local
            if failure is not None:
                raise blame(failure, futures)
        pending = [f for f in pending if f.ref not in ready_set]


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
        """Fail in the controller, before anything is sent, when `method` is not on the class."""
        self._check_open()
        if not callable(getattr(self.cls, method, None)):
            public = sorted(
                name
                for name, value in inspect.getmembers(self.cls)
                if callable(value) and not name.startswith("_")
            )
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
        bound = getattr(self.workers[rank], method)
        return self._run(rank, f"{self.cls.__name__}.{method}", bound, args, kwargs)

    def shutdown(self) -> None:
        """Let running calls finish, cancel queued ones, drop the instances (freeing their memory)."""
        for executor in self._executors:
            executor.shutdown(wait=True, cancel_futures=True)
        self._executors = []
        self.workers = []
        self._closed = True


# ---------------------------------------------------------------------------------------- Ray
def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Start a local Ray cluster (`address=None`) or join one (`"auto"`, `"host:port"`, `"ray://..."`).

    The one place diffrl calls `ray.init` (groups never do, so tests and users keep control of the
    cluster). Returns True if this call started or joined Ray, False if Ray was already running in
    this process (the caller then should not `ray.shutdown()` it). A `host:port` address is probed
    with a plain TCP connection first, so an unreachable cluster fails in a second with a message
    rather than after Ray's long connection retries.

    A local cluster listens on loopback only. Ray resolves `_node_ip_address="127.0.0.1"` back to
    the machine's network address on Linux and then binds GCS, raylet, workers and agents to every
    interface; the one switch that keeps them all on 127.0.0.1 is Ray's single-machine mode
    (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, the default on macOS and Windows), which Ray reads when
    it is first imported. This sets it unless the user chose a value; `=1` opts out (a local head
    other machines may join). Ray >= 2.59 also requires its token on a local cluster (~/.ray/auth_token).
    """
    import os
    import sys

    if address is None and "ray" not in sys.modules:
        os.environ.setdefault(_RAY_CLUSTER_MODE_ENV, "0")
    import ray

    if ray.is_initialized():
        return False
    if address is None:
        from ray._private import ray_constants

        if ray_constants.ENABLE_RAY_CLUSTER and os.environ.get(_RAY_CLUSTER_MODE_ENV) is None:
            raise ValueError(
                "ensure_ray(): Ray was imported before diffrl could keep the local cluster on loopback, "
                "so it would listen on every network interface. Set "
                f"{_RAY_CLUSTER_MODE_ENV}=0 before starting Python (or =1 to accept a cluster reachable "
                "from the network), or start Ray yourself before calling diffrl"
            )
        from diffrl.telemetry.console import ray_init_kwargs

        # address="local": a cluster of this run's own. Without an address Ray joins any cluster
        # already running on the machine (RAY_ADDRESS, the last `ray start`, or a GCS process it
        # finds), e.g. another user's or another diffrl run's, sharing its workers and failing on
        # num_cpus. Then the workers' quieting environment and Ray's log level.
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **ray_init_kwargs())
        return True
    if num_cpus is not None:
        raise ValueError(
            f"ensure_ray(address={address!r}, num_cpus={num_cpus}): num_cpus only applies to a local "
            "cluster this process starts; an existing cluster has its own resources (drop num_cpus)"
        )
    _probe_address(address)
    try:
        from diffrl.telemetry.console import ray_init_kwargs

        ray.init(address=address, **ray_init_kwargs())
    except ConnectionError as err:
        raise ConnectionError(
            f"could not connect to the Ray cluster at address={address!r}: {err}. Start one with "
            "`ray start --head` on the head node, or leave the address empty (trainer.ray_address=null) "
            "to start a local cluster"
        ) from err
    return True


# Ray's switch for single-machine mode (ray._private.ray_constants); "0" = loopback-only local cluster.
_RAY_CLUSTER_MODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _probe_address(address: str) -> None:
    """Fail fast and clearly when a `host:port` (or `ray://host:port`) address does not answer."""
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if address == "auto" or not sep or not port.isdigit():
        return  # "auto" (and anything not host:port) is resolved by Ray itself
    try:
        with socket.create_connection((host, int(port)), timeout=3.0):
            pass
    except OSError as err:
        raise ConnectionError(
            f"the Ray cluster at address={address!r} is unreachable ({err}); check the host and port "
            "(`ray status` on the head node prints them), start one with `ray start --head`, or leave "
            "the address empty (trainer.ray_address=null) to start a local cluster"
        ) from err


# The identity call runs after the constructors, on idle actors: seconds, unless an actor hangs.
_IDENTITY_TIMEOUT_S = 60.0


def _free_port() -> int:
    """A TCP port free on this node right now (the OS picks it; torchrun does the same)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _node_ip_and_free_port() -> tuple[str, int]:
    """Runs as a Ray task on rank 0's node when that is not the driver's node."""
    import ray

    return ray.util.get_node_ip_address(), _free_port()


class RayGroup(WorkerGroup):
    """`n` Ray actors of `cls`, one per placement-group bundle, wired for torch.distributed.

    Every actor is `ray.remote(cls).options(num_cpus=..., num_gpus=..., scheduling_strategy=<its
    bundle>, runtime_env={"env_vars": ...})`, constructed with `*args, **kwargs`. The environment
    holds `RANK`, `WORLD_SIZE`, `LOCAL_RANK`/`LOCAL_WORLD_SIZE` (position among this group's
    workers on the same node) and `MASTER_ADDR`/`MASTER_PORT` (rank 0's node and a port free there
    at creation), plus `env_vars` (one mapping for all ranks, or a sequence of one per rank).

    With `num_gpus=1` Ray sets `CUDA_VISIBLE_DEVICES` to the actor's GPU, so a worker uses
    `cuda:0` (its only visible device), not `cuda:LOCAL_RANK`.

    Placement: by default the group creates (and at `shutdown` removes) a placement group of `n`
    bundles `{"CPU": num_cpus, "GPU": num_gpus, **resources}` with `placement_strategy` (`PACK`: as
    few nodes as possible, for NVLink; `SPREAD`: across nodes); custom `resources` (e.g.
    `{"rollout_node": 1}`) keep a pool on the nodes started with them. Pass an existing `placement_group` (and
    `bundle_indices`, default `range(n)`) to colocate groups: e.g. a reward group with fractional
    GPUs in the bundles of the rollout group; the group then does not remove it.

    Requires a running Ray (`ensure_ray`); waits for placement (`placement_timeout_s`, then a
    `TimeoutError` listing the cluster's free resources) and for every constructor (errors
    re-raised as `WorkerError` with the rank). Then it asks each actor where it runs
    (`identities`: node IP and id, PID, log files), so a later call failing because the actor died
    raises a `WorkerError` that names it and quotes its last log lines.
    """

    OPTIONS: tuple[str, ...] = (
        "num_cpus",
        "num_gpus",
        "env_vars",
        "placement_strategy",
        "placement_group",
        "bundle_indices",
        "placement_timeout_s",
        "resources",
    )

    def __init__(
        self,
        cls: type,
        n: int,
        *args: Any,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        env_vars: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
        placement_strategy: PlacementStrategy = "PACK",
        placement_group: PlacementGroup | None = None,
        bundle_indices: Sequence[int] | None = None,
        placement_timeout_s: float | None = 300.0,
        resources: Mapping[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        import ray
        from ray.actor import ActorClass
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        _check_size(n)
        if isinstance(cls, ActorClass):
            raise TypeError("RayGroup takes the plain worker class, not a ray.remote(...) actor class")
        _check_reserved_names(cls, self.OPTIONS, "RayGroup")
        if not ray.is_initialized():
            raise RuntimeError(
                "RayGroup needs a running Ray: call diffrl.workers.ensure_ray(address) first (the "
                "trainer does, from trainer.ray_address), or use InProcessGroup"
            )
        if num_cpus < 0 or num_gpus < 0 or (num_cpus == 0 and num_gpus == 0 and placement_group is None):
            raise ValueError(
                f"RayGroup(num_cpus={num_cpus}, num_gpus={num_gpus}): each worker needs a positive "
                "amount of CPUs or GPUs (its placement-group bundle cannot be empty)"
            )
        if placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"placement_strategy={placement_strategy!r} is not one of {list(PLACEMENT_STRATEGIES)}"
            )
        per_rank_env = _per_rank_env_vars(env_vars, n)

        self.cls = cls
        self.size = n
        self.actors: list[ActorHandle] = []
        self.identities: list[WorkerIdentity] = []  # by rank, once every constructor returned
        self._owns_placement_group = placement_group is None
        if placement_group is None:
            bundle = {"CPU": float(num_cpus), "GPU": float(num_gpus), **(resources or {})}
            bundle = {key: float(value) for key, value in bundle.items() if value > 0}
            placement_group = ray.util.placement_group(
                [dict(bundle) for _ in range(n)], strategy=placement_strategy
            )
            bundle_indices = list(range(n))
        else:
            bundle_indices = list(range(n)) if bundle_indices is None else list(bundle_indices)
            if len(bundle_indices) != n:
                raise ValueError(
                    f"bundle_indices={bundle_indices} has {len(bundle_indices)} entries for n={n} workers"
                )
        self.placement_group = placement_group
        self.bundle_indices = bundle_indices
        try:
            self._wait_placed(placement_timeout_s, num_cpus, num_gpus)
            bundle_nodes = ray.util.placement_group_table(placement_group)["bundles_to_node_id"]
            nodes = [bundle_nodes[index] for index in bundle_indices]
            self.master_addr, self.master_port = self._master_address(nodes[0])
            self.node_ids = nodes
            self.env_vars = [
                {**per_rank_env[rank], **self._dist_env(rank, nodes)} for rank in range(n)
            ]  # what each actor got
            remote_cls = ray.remote(cls)
            for rank in range(n):
                options = remote_cls.options(
                    num_cpus=num_cpus,
                    num_gpus=num_gpus,
                    resources=dict(resources or {}),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=placement_group,
                        placement_group_bundle_index=bundle_indices[rank],
                    ),
                    runtime_env={"env_vars": self.env_vars[rank]},
                )
                self.actors.append(options.remote(*args, **kwargs))
            # Wait for every constructor, so a failing __init__ surfaces here, with its rank.
            label = f"{cls.__name__}.__init__"
            gather(
                [
                    RayFuture(actor.__ray_ready__.remote(), rank, n, label)
                    for rank, actor in enumerate(self.actors)
                ]
            )
            self.identities = self._learn_identities(_IDENTITY_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    def _wait_placed(self, timeout_s: float | None, num_cpus: float, num_gpus: float) -> None:
        import ray

        ready, _ = ray.wait([self.placement_group.ready()], timeout=timeout_s)
        if not ready:
            raise TimeoutError(
                f"could not place {self.size} workers of {self.cls.__name__} (num_cpus={num_cpus}, "
                f"num_gpus={num_gpus} each) within placement_timeout_s={timeout_s}: the cluster has "
                f"{ray.cluster_resources()} in all, {ray.available_resources()} free. Ask for fewer "
                "workers or resources, or add nodes"
            )

    def _master_address(self, node_id: str) -> tuple[str, int]:
        """Rank 0's node IP and a port free on that node (probed there if it is another node)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if node_id == ray.get_runtime_context().get_node_id():
            return ray.util.get_node_ip_address(), _free_port()
        probe = ray.remote(num_cpus=0)(_node_ip_and_free_port).options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=self.bundle_indices[0]
            )
        )
        return ray.get(probe.remote())

    def _dist_env(self, rank: int, nodes: Sequence[str]) -> dict[str, str]:
        same_node = [r for r in range(self.size) if nodes[r] == nodes[rank]]
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.size),
            "LOCAL_RANK": str(same_node.index(rank)),
            "LOCAL_WORLD_SIZE": str(len(same_node)),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }

    def _share_args(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Serialize each argument once (`ray.put`), not once per actor; Ray resolves top-level refs."""
        import ray

        if self.size == 1:
            return args, kwargs

        def put(value: Any) -> Any:
            return value if isinstance(value, ray.ObjectRef) else ray.put(value)

        return tuple(put(a) for a in args), {key: put(value) for key, value in kwargs.items()}

    def _submit(self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> WorkerFuture:
        ref = getattr(self.actors[rank], method).remote(*args, **kwargs)
        return RayFuture(ref, rank, self.size, f"{self.cls.__name__}.{method}", self.identities[rank])

    def _learn_identities(self, timeout_s: float) -> list[WorkerIdentity]:
        return learn_identities(self.actors, self.cls.__name__, timeout_s)

    def shutdown(self) -> None:
        """Kill the actors (at once, running calls included) and remove our placement group."""
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self._owns_placement_group and getattr(self, "placement_group", None) is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
        self._closed = True


def learn_identities(actors: Sequence[Any], cls_name: str, timeout_s: float) -> list[WorkerIdentity]:
    """Ask every Ray actor where it runs (one round trip), for failure messages that can name it."""
    label = f"{cls_name}.__ray_call__"
    futures = [
        RayFuture(actor.__ray_call__.remote(_actor_identity), rank, len(actors), label)
        for rank, actor in enumerate(actors)
    ]
    return [
        WorkerIdentity(rank, cls_name, node_ip, node_id, pid, log_files)
        for rank, (node_ip, node_id, pid, log_files) in enumerate(gather(futures, timeout=timeout_s))
    ]


def _per_rank_env_vars(
    env_vars: Mapping[str, str] | Sequence[Mapping[str, str]] | None, n: int
) -> list[dict[str, str]]:
    """One env mapping per rank from `None`, a shared mapping, or a per-rank sequence; validated."""
    if env_vars is None:
        per_rank: list[Mapping[str, str]] = [{} for _ in range(n)]
    elif isinstance(env_vars, Mapping):
        per_rank = [env_vars] * n
    else:
        per_rank = list(env_vars)
        if len(per_rank) != n:
            raise ValueError(
                f"env_vars has {len(per_rank)} per-rank mappings for n={n} workers: pass one mapping "
                "for all ranks, or exactly one per rank"
            )
    checked = []
    for rank, env in enumerate(per_rank):
        clashes = sorted(set(env) & set(DIST_ENV_VARS))
        if clashes:
            raise ValueError(
                f"env_vars for rank {rank} sets {clashes}, which RayGroup sets itself; remove them"
            )
        bad = {
            key: value for key, value in env.items() if not isinstance(key, str) or not isinstance(value, str)
        }
        if bad:
            raise ValueError(f"env_vars for rank {rank} must map str to str; not: {bad}")
        checked.append(dict(env))
    return checked
