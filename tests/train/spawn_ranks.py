"""Run a test's worker on several local processes with deadlines, for the multi-rank CPU tests.

Each worker touches `<out_dir>/joined<rank>` once its rank has joined the process group, so that
the two deadlines measure different things: the start (process spawn, imports, rendezvous: slow
on a loaded 2-core machine) and the run, timed from the moment every rank has joined.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_with_deadlines(
    worker: Callable,
    args: tuple,
    nprocs: int,
    out_dir: Path,
    *,
    start_s: float,
    run_s: float,
    what: str,
) -> None:
    """`worker(rank, *args)` on `nprocs` processes; kill them all and fail the test if they hang."""
    context = mp.spawn(worker, args=args, nprocs=nprocs, join=False)
    deadline, phase, limit = time.monotonic() + start_s, "start", start_s
    while not context.join(timeout=0.5):
        if phase == "start" and all((Path(out_dir) / f"joined{r}").exists() for r in range(nprocs)):
            deadline, phase, limit = time.monotonic() + run_s, "run", run_s
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            for process in context.processes:
                process.join(10)
            pytest.fail(
                f"the {nprocs}-rank {what} {phase} did not finish within {limit:.0f} s: the ranks hang"
            )
