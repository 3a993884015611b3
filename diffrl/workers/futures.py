"""Futures and waits: the pending result of one call on one worker, and how the controller waits.

`WorkerFuture` (`LocalFuture` for an in-process worker, `RayFuture` for a Ray actor's call) is what
a group's `call_async`, `scatter_async` and `submit` return; `result()` gives the value or raises
`WorkerError`. The waits:

- `gather` returns the results in the order of the futures given (rank order for one call). It
  fails fast: the first worker error seen is raised, even while other workers still run (a rank
  blocked in a collective waiting for a dead peer would otherwise hang the controller). A dead
  worker is named before the peers that failed because of it (`blame`): a method's error waits up
  to `DEATH_GRACE_S` for Ray to report a death among the other calls.
- `wait_any` waits for the first of several calls to finish, with the same fail-fast rule;
  `wait_done` is the same wait without raising, for a caller that polls; `failure_of` is a
  finished call's error or None.
- A timeout names every call still running and, for a Ray worker, where it runs and what it
  logged last.
- While any Ray worker is watched (`liveness`), every wait here, and `get_watched` (`ray.get` for
  a reference that is not a worker call's), also ends when the watch finds a worker dead: it
  raises that worker's `WorkerError`, whichever worker the wait was for (a dead trainer rank ends
  the validation the controller waits for on the rollout pool).

Apart from the groups because one wait may span several of them (a weight sync's send on a
trainer rank and its receives on the rollout replicas). Builds on `errors`; the groups (`group`,
`ray_group`) build on it.
"""

from __future__ import annotations

import concurrent.futures
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from diffrl.workers import liveness
from diffrl.workers.errors import WorkerError, WorkerIdentity, log_tail

__all__ = [
    "DEATH_GRACE_S",
    "LocalFuture",
    "RayFuture",
    "WorkerFuture",
    "blame",
    "failure_of",
    "gather",
    "get_watched",
    "wait_any",
    "wait_done",
]


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
        _local_wait([self.future], concurrent.futures.ALL_COMPLETED, _deadline(timeout))
        try:
            return self.future.result(0 if timeout is not None else None)
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

        deadline = _deadline(timeout)
        try:
            _ray_wait([self.ref], 1, deadline)
            return ray.get(self.ref, timeout=_remaining(deadline))
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"rank {self.rank} {self.method} did not finish within {timeout} s") from None
        except ray.exceptions.RayTaskError as err:
            raise _worker_error_from_ray(err, self.rank, self.size, self.method) from err.cause
        except ray.exceptions.RayActorError as err:
            # ActorDiedError, ActorUnavailableError: the process, not the method, failed.
            liveness.mark_reported(err)
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
    deadline = _deadline(timeout)
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
        death = liveness.take_death()  # found by the watch (the peer may not be among `futures`)
        if death is not None:
            return death
        for future in others:
            if id(future) in checked or not future.done():
                continue
            checked.add(id(future))
            failure = failure_of(future)
            if failure is not None and failure.process_failed:
                return failure
        left = list(dict.fromkeys(future.ref for future in others if id(future) not in checked))
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not (left or liveness.watching()):
            return error
        if left:
            import ray

            ray.wait(left, num_returns=1, timeout=min(remaining, liveness.POLL_S), fetch_local=False)
        else:
            time.sleep(min(remaining, liveness.POLL_S))


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
    deadline = _deadline(timeout)
    if all(isinstance(f, RayFuture) for f in futures):
        import ray

        refs = list(dict.fromkeys(f.ref for f in futures))  # type: ignore[attr-defined]  # ray.wait: unique
        _ray_wait(refs, 1, deadline)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        ready_set = set(ready)
        done = [f for f in futures if f.ref in ready_set]  # type: ignore[attr-defined]
    elif all(isinstance(f, LocalFuture) for f in futures):
        _local_wait(
            [f.future for f in futures],  # type: ignore[attr-defined]
            concurrent.futures.FIRST_COMPLETED,
            deadline,
        )
        done = [f for f in futures if f.done()]
    else:
        # Ray and in-process futures have no common wait: poll both, briefly.
        done = [f for f in futures if f.done()]
        while not done and (deadline is None or time.monotonic() < deadline):
            _raise_death()
            time.sleep(0.01 if deadline is None else min(0.01, _remaining(deadline) or 0.0))
            done = [f for f in futures if f.done()]
    return done


def get_watched(ref: Any, timeout: float | None = None) -> Any:
    """`ray.get(ref, timeout=timeout)` that ends, raising the `WorkerError`, when the liveness
    watch finds a worker dead meanwhile: for a Ray reference that is not one of a group's calls (a
    reward worker's scores). Raises what `ray.get` raises otherwise (`GetTimeoutError` after
    `timeout`)."""
    import ray

    deadline = _deadline(timeout)
    try:
        _ray_wait([ref], 1, deadline)
        return ray.get(ref, timeout=_remaining(deadline))
    except ray.exceptions.RayActorError as err:
        liveness.mark_reported(err)
        raise


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _raise_death() -> None:
    """Raise the `WorkerError` of a worker the liveness watch found dead, if one is not reported yet."""
    death = liveness.take_death()
    if death is not None:
        raise death


def _slice(deadline: float | None) -> float | None:
    """How long one wait may block: up to the deadline, or `liveness.POLL_S` while workers are
    watched, so a death the watch finds ends the wait."""
    remaining = _remaining(deadline)
    if not liveness.watching():
        return remaining
    return liveness.POLL_S if remaining is None else min(liveness.POLL_S, remaining)


def _ray_wait(refs: list[Any], num_returns: int, deadline: float | None) -> list[Any]:
    """`ray.wait(refs, num_returns)` until `deadline`; the ready references (fewer than
    `num_returns` after the deadline). Raises a death the watch found, before waiting and while
    it waits, also when `refs` are ready: a stream of short calls (requests to the replicas) is
    always ready, and would not see a trainer rank that died meanwhile."""
    import ray

    while True:
        _raise_death()
        ready, _ = ray.wait(refs, num_returns=num_returns, timeout=_slice(deadline), fetch_local=False)
        if len(ready) >= num_returns or (deadline is not None and time.monotonic() >= deadline):
            return ready


def _local_wait(futures: list[concurrent.futures.Future], return_when: str, deadline: float | None) -> None:
    """`concurrent.futures.wait` until `deadline`, raising a death the watch found (as `_ray_wait`)."""
    while True:
        _raise_death()
        done, not_done = concurrent.futures.wait(futures, timeout=_slice(deadline), return_when=return_when)
        finished = (
            not not_done
            or (return_when == concurrent.futures.FIRST_COMPLETED and done)
            or (return_when == concurrent.futures.FIRST_EXCEPTION and any(f.exception() for f in done))
        )
        if finished or (deadline is not None and time.monotonic() >= deadline):
            return


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
    _local_wait([f.future for f in futures], concurrent.futures.FIRST_EXCEPTION, deadline)
    done = {f.future for f in futures if f.future.done()}
    not_done = {f.future for f in futures} - done
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
        ready = _ray_wait([f.ref for f in pending], 1, deadline)
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
