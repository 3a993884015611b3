"""What a worker failure says: `WorkerError`, `WorkerIdentity`, and the log tails that name a dead worker.

Every worker group raises one exception type, `WorkerError` (the rank, the method, the exception
the worker raised), so the controller catches worker failures without caring where the worker ran.
For a Ray worker whose process died or stopped answering, the error also carries its
`WorkerIdentity` (class, rank, node IP and PID, the files its output goes to) and `log_tail`: the
last lines it logged, read here when the file is readable from this process, else by a task on the
worker's node. A dead rollout replica, trainer rank or reward worker is thus identified from the
message alone.

The bottom of `diffrl.workers`' calling machinery: it imports nothing of diffrl; the futures
(`futures`) raise these errors and the Ray groups (`ray_group`, `reward_workers`) learn
the identities. Ray is imported only inside the functions that use it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["LOG_TAIL_LINES", "WORKER_STATES", "WorkerError", "WorkerIdentity", "log_tail"]

#: What a dead worker was doing (`WorkerError.state`).
WORKER_STATES = ("running", "idle", "unknown")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class WorkerIdentity:
    """Where one Ray worker runs: what a failure message needs to point at it.

    `log_files` are the files the actor process's stdout and stderr go to (Ray redirects them to
    `worker-*.out` / `worker-*.err` in its session's logs directory on the worker's node); empty
    when they are not regular files (output to a terminal or a pipe) or the platform cannot say.
    `actor_id` is Ray's id of the actor (hex), what Ray's `RayActorError.actor_id` names, so the
    liveness watch (`liveness`) can tell which death a failed call reports.
    """

    rank: int
    cls_name: str
    node_ip: str
    node_id: str
    pid: int
    log_files: tuple[str, ...] = ()
    actor_id: str = ""

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

    `state` says what the dead worker was doing, for a death the liveness watch found rather than
    a call: "running" `method` (the default: a call's own failure), "idle" since `method` (its
    last call; "" for none), or "unknown" (a worker whose calls others make: a reward worker).
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
        state: str = "running",
    ) -> None:
        if state not in WORKER_STATES:
            raise ValueError(f"state={state!r} is not one of {WORKER_STATES}")
        self.rank = rank
        self.size = size
        self.method = method
        self.cause = cause
        self.remote_traceback = remote_traceback
        self.identity = identity
        self.log_tail = log_tail
        self.state = state
        if identity is None:
            message = f"worker rank {rank} (of {size}) failed in {method}: {type(cause).__name__}: {cause}"
        else:
            # ActorUnavailableError: Ray lost contact, the process may still exist (and hang).
            verb = "became unreachable" if type(cause).__name__ == "ActorUnavailableError" else "died"
            if state == "running":
                verb += f" during {method}"
            elif state == "idle":
                verb += f" while idle (its last call: {method})" if method else " while idle"
            message = (
                f"{identity.cls_name} rank {rank} (of {size}) on node {identity.node_ip} "
                f"(pid {identity.pid}) {verb}: {type(cause).__name__}: {cause}"
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
                self.state,
            ),
        )


# How many lines of each log file a death message quotes, and how far back to look for them.
LOG_TAIL_LINES = 20
_LOG_TAIL_BYTES = 64 * 1024
# How long a failure waits for a task that reads the log of a worker on another node.
_REMOTE_LOG_TIMEOUT_S = 5.0
# Routing markers Ray writes into worker log files (ray_constants.LOG_PREFIX_*); not the worker's.
_RAY_LOG_MARKERS = (":job_id:", ":actor_name:", ":task_name:", ":event_summary:", ":info_message:")


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
