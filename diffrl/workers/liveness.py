"""The liveness watch: a Ray worker that dies is noticed within about a second, whether the
controller is waiting on it or not.

Ray fails the calls of an actor that died within milliseconds, but only its calls: a worker that
died while idle, or while the controller waited on other workers (validation on the rollout pool,
the reward gather, a trainer rank during sampling), was noticed only when the controller next
called it, seconds to minutes later. The watch keeps one no-op call (`_probe`) queued on every
watched actor. Calls to one actor run one at a time, in order, so the probe waits behind whatever
the actor runs (costing it nothing while it is busy) and Ray fails it as soon as the actor dies;
an idle actor runs it at once, and it is queued again `PROBE_INTERVAL_S` later. One daemon thread
per process looks at every probe ten times a second (`ray.wait` without blocking: a thread blocked
in Ray when `ray.shutdown` comes makes Ray end the process; a group's `Watch.stop` waits for a look
to finish).

A death found this way is kept as the `WorkerError` naming the worker (class, rank, node IP, PID,
what it was doing, its last log lines) until a wait reports it: every wait of `futures` (`gather`,
`wait_any`, `wait_done`, a future's `result`, `get_watched`) raises a death not reported yet
instead of waiting on (it looks every `POLL_S` while it waits). Each death is reported once, by
whichever comes first: such a wait, or the failed call of the dead worker itself (`mark_reported`).
So the controller's next or current wait ends the run with the dead worker's error, and a caller
that handled a death is not told again.

Why not Ray's other means: `ray.util.state` answers through the dashboard, which diffrl's local
cluster does not start; a liveness call that blocks inside the actor needs a concurrency group of
its own, and an actor with one runs every method on a thread pool instead of its main thread (the
thread its constructor ran in, whose grad mode and CUDA device the worker set up).

Builds on `errors`; `futures` waits with it and the Ray groups (`ray_group`,
`diffrl.workers.reward_workers`) register their actors. Ray is imported only inside functions.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from diffrl.workers.errors import WorkerError, WorkerIdentity, log_tail

__all__ = [
    "POLL_S",
    "PROBE_INTERVAL_S",
    "Watch",
    "mark_reported",
    "pending_deaths",
    "take_death",
    "watch",
    "watching",
]

#: Seconds between two probes of an idle actor: how late at most the watch learns of its death.
PROBE_INTERVAL_S = 0.5
#: How often a waiting controller looks for a death the watch found.
POLL_S = 0.2
# How often the watch's thread looks at its probes (a look does not block in Ray, see `_in_ray`).
_LOOK_S = 0.1

#: `describe(rank) -> (state, method)`: what the worker of `rank` is doing (WorkerError.state).
Describe = Callable[[int], tuple[str, str]]


def _probe(_instance: Any) -> None:
    """Runs inside the actor (`__ray_call__`), between its calls: nothing to do."""


@dataclass(eq=False)
class _Watched:
    """One watched actor: its probe in flight (None between probes) and when the next is due."""

    key: int  # the Watch it belongs to
    actor: Any
    identity: WorkerIdentity
    size: int
    describe: Describe | None
    tidy: Callable[[], None] | None
    probe: Any = None
    due: float = 0.0


class Watch:
    """The registration of a group's actors; `stop()` it before killing them on purpose.

    Holds only a number, so an object holding it pickles (the reward workers travel to the workers
    that submit to them); `stop()` in another process does nothing."""

    def __init__(self, key: int) -> None:
        self.key = key

    def stop(self) -> None:
        _REGISTRY.remove(self.key)


class _Registry:
    """The watched actors of this process, the deaths found, and the thread that probes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the state below
        # Held by the thread while it calls Ray or holds Ray objects, never while it sleeps:
        # `remove` takes it, so once a group stopped its watch the thread is not inside Ray and
        # holds none of its refs (a call into Ray after `ray.shutdown`, the release of a ref
        # included, makes Ray end the process). Taken before `_lock`, never after it.
        self._in_ray = threading.Lock()
        self._keys = itertools.count(1)
        self._watched: list[_Watched] = []
        self._deaths: list[tuple[int, WorkerError]] = []  # (watch key, error), found, not reported
        self._reported: set[str] = set()  # actor ids whose death was reported
        self._active: set[int] = set()  # the watches not stopped
        self._thread: threading.Thread | None = None

    def add(
        self,
        actors: Sequence[Any],
        identities: Sequence[WorkerIdentity],
        describe: Describe | None,
        tidy: Callable[[], None] | None,
    ) -> int:
        if len(actors) != len(identities):
            raise ValueError(f"watch() got {len(actors)} actors and {len(identities)} identities")
        with self._lock:
            key = next(self._keys)
            self._active.add(key)
            size = len(actors)
            self._watched += [
                _Watched(key, a, i, size, describe, tidy) for a, i in zip(actors, identities, strict=True)
            ]
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="diffrl-liveness", daemon=True)
                self._thread.start()
        return key

    def remove(self, key: int) -> None:
        with self._in_ray, self._lock:
            self._active.discard(key)
            self._watched = [w for w in self._watched if w.key != key]
            self._deaths = [(k, error) for k, error in self._deaths if k != key]

    def watching(self) -> bool:
        return bool(self._watched) or bool(self._deaths)

    def take_death(self) -> WorkerError | None:
        with self._lock:
            while self._deaths:
                _, error = self._deaths.pop(0)
                actor_id = error.identity.actor_id if error.identity is not None else ""
                if actor_id and actor_id in self._reported:
                    continue  # its own failed call told the caller first
                self._reported.add(actor_id)
                return error
        return None

    def pending(self) -> list[WorkerError]:
        with self._lock:
            return [error for _, error in self._deaths]

    def mark_reported(self, actor_id: str) -> None:
        with self._lock:
            self._reported.add(actor_id)

    # ------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        import ray

        while True:
            with self._in_ray:
                with self._lock:
                    if not ray.is_initialized():  # shut down: what was watched belonged to that cluster
                        self._watched, self._deaths, self._active = [], [], set()
                    if not self._watched:
                        self._thread = None
                        return
                    watched = list(self._watched)
                # Ray shutting down, an actor handle gone: look again, or end above
                with contextlib.suppress(Exception):
                    self._probe_once(ray, watched)
                # Drop the actor handles and probe refs here, while `remove` waits: freeing them
                # after a ray.shutdown that followed it would be a call into Ray too.
                del watched
            time.sleep(_LOOK_S)

    def _probe_once(self, ray: Any, watched: list[_Watched]) -> None:
        """One look, without blocking in Ray: queue the probes that are due, then take the
        finished ones (an idle actor's that ran, a dead actor's that failed)."""
        now = time.monotonic()
        for w in watched:
            if w.probe is None and now >= w.due:
                w.probe = w.actor.__ray_call__.remote(_probe)
        probes = {w.probe: w for w in watched if w.probe is not None}
        ready = (
            ray.wait(list(probes), num_returns=len(probes), timeout=0, fetch_local=False)[0] if probes else []
        )
        for ref in ready:
            w = probes[ref]
            w.probe = None
            w.due = time.monotonic() + PROBE_INTERVAL_S
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.ActorUnavailableError:
                continue  # Ray lost contact for now; a call to it says more, this probes again
            except ray.exceptions.RayActorError as err:
                self._died(w, err)
            except Exception:  # the probe itself failed (cannot happen for a live diffrl worker)
                self._forget(w)
        # after the deaths' `describe`, which may need a call that the death just ended
        for tidy in {id(w.tidy): w.tidy for w in watched if w.tidy is not None}.values():
            tidy()

    def _forget(self, w: _Watched) -> None:
        with self._lock:
            self._watched = [other for other in self._watched if other is not w]

    def _died(self, w: _Watched, err: Exception) -> None:
        """Keep the dead worker's error for the next wait; read its log now, before Ray cleans up."""
        self._forget(w)
        with self._lock:
            if w.identity.actor_id in self._reported:
                return
        state, method = w.describe(w.identity.rank) if w.describe is not None else ("unknown", "")
        error = WorkerError(
            w.identity.rank,
            w.size,
            method,
            err,
            identity=w.identity,
            log_tail=log_tail(w.identity),
            state=state,
        )
        with self._lock:
            if w.key in self._active:  # not stopped meanwhile (a shutdown kills on purpose)
                self._deaths.append((w.key, error))


_REGISTRY = _Registry()


def watch(
    actors: Sequence[Any],
    identities: Sequence[WorkerIdentity],
    describe: Describe | None = None,
    tidy: Callable[[], None] | None = None,
) -> Watch:
    """Watch Ray `actors` (`identities[i]` is where actors[i] runs) until the returned `Watch`
    is stopped. `describe(rank)` says what a worker is doing when its death is found ("running"
    a method, "idle" since its last call); without it the error says neither. `tidy()` runs on
    the watch's thread after every round of probes (a group forgets its finished calls there)."""
    return Watch(_REGISTRY.add(actors, identities, describe, tidy))


def watching() -> bool:
    """Whether any actor of this process is watched (the waits then look for deaths)."""
    return _REGISTRY.watching()


def take_death() -> WorkerError | None:
    """The first death the watch found that was not reported yet (now reported), or None."""
    return _REGISTRY.take_death()


def pending_deaths() -> list[WorkerError]:
    """The deaths found and not reported yet, leaving them so (for tests and diagnostics)."""
    return _REGISTRY.pending()


def mark_reported(error: BaseException) -> None:
    """A call of a dead actor failed with `error` (Ray's `RayActorError`): its death is reported,
    so the watch does not report it again."""
    actor_id = getattr(error, "actor_id", None)
    if actor_id:
        _REGISTRY.mark_reported(actor_id)
