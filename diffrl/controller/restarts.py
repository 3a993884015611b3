"""trainer.max_restarts: a run whose worker or node dies starts its pools again and resumes.

Only a death restarts: a `WorkerError` that carries the dead worker's identity (Ray reported its
process gone or unreachable, or the scores it owned lost) or whose cause is Ray's
`RayActorError`. A method that raised (a reward's exception, a bad config found in a worker), a
stop signal (SIGTERM, Ctrl-C: `stop_requested`) or any other error ends the run as without the
setting. A restart happens in the same process and keeps the run folder (its lock and
console.log); the pools have been shut down by the failed attempt's exit, so the next attempt
starts a fresh Ray cluster (or joins trainer.ray_address again) and resumes from the newest
complete checkpoint, as trainer.resume=auto does, or from step 0 when there is none yet (then the
new attempt's step 1 replaces the metrics the failed one logged). Resume is exact, so a restarted
run logs the metrics an uninterrupted one logs (tests/controller/test_restarts.py).

Each restart is one printed line (terminal and RUN/console.log) and one record in
RUN/restarts.jsonl: the restart's number, the step that failed, the checkpoint step resumed from,
the dead worker's one-line description, and the whole error text (remote traceback, log tail).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from diffrl.config.schema import Config
from diffrl.controller.stopping import stop_requested
from diffrl.train.checkpoint import latest_checkpoint
from diffrl.workers.errors import WorkerError

RESTARTS_FILE = "restarts.jsonl"

T = TypeVar("T")


def worker_death(error: BaseException) -> WorkerError | None:
    """The `WorkerError` of a dead worker that `error` is or was raised from, else None (a
    method that raised, any other failure, or a stop signal received meanwhile)."""
    if stop_requested() is not None:
        return None
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, WorkerError) and (seen.identity is not None or seen.process_failed):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def checkpoint_step(checkpoint: Path | None) -> int:
    if checkpoint is None:
        return 0
    return int(json.loads((checkpoint / "meta.json").read_text())["step"])


def run_with_restarts(
    cfg: Config,
    run_dir: Path,
    checkpoint: Path | None,
    attempt: Callable[[Path | None, dict[str, Any]], T],
) -> T:
    """`attempt(checkpoint, state)` until it returns, restarting it up to trainer.max_restarts
    times after a worker death (`worker_death`) with the run's newest complete checkpoint.
    `state` says whether this attempt is a restart (`state["restarted"]`), and the attempt puts
    its loop in it (`state["loop"]`), for the step that failed; the last failure, or one that is no death, propagates unchanged."""
    limit = cfg.trainer.max_restarts
    done = 0
    while True:
        state: dict[str, Any] = {"restarted": done > 0}
        try:
            return attempt(checkpoint, state)
        except Exception as error:
            dead = worker_death(error)
            if dead is None or done >= limit:
                raise
            done += 1
            loop = state.get("loop")
            failed_step = getattr(loop, "step", 0)
            checkpoint = latest_checkpoint(run_dir / "checkpoints")
            resumed = checkpoint_step(checkpoint)
            worker = str(dead).split("\n", 1)[0]
            name = str(dead.identity) if dead.identity is not None else f"worker rank {dead.rank}"
            where = f"at step {failed_step}" if failed_step else "before its first step"
            source = f"checkpoint step {resumed}" if checkpoint is not None else "step 0 (no checkpoint yet)"
            print(f"{name} died {where}: restarting from {source} (restart {done} of {limit})", flush=True)
            record = {
                "restart": done,
                "of": limit,
                "failed_step": failed_step,
                "resumed_step": resumed,
                "checkpoint": None if checkpoint is None else str(checkpoint),
                "worker": worker,
                "error": str(dead),
                "time": time.time(),
            }
            with open(run_dir / RESTARTS_FILE, "a", encoding="utf-8") as out:
                out.write(json.dumps(record) + "\n")


__all__ = ["RESTARTS_FILE", "checkpoint_step", "run_with_restarts", "worker_death"]
