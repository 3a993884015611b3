"""Run a test's worker on several local processes with deadlines, for the multi-rank CPU tests.

Each worker touches `<out_dir>/joined<rank>` once its rank has joined the process group, so that
the two deadlines measure different things: the start (process spawn, imports, rendezvous: slow
on a loaded 2-core machine) and the run, timed from the moment every rank has joined.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from diffrl.train import distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(worker: Callable, args: tuple, nprocs: int, *, fork: bool = False, join: bool = True):
    """`worker(rank, *args)` on `nprocs` processes: `mp.spawn`, or with `fork` on a machine without
    CUDA, forked from this process (a forked child cannot use CUDA once its parent has asked for
    it, as the suite's conftest does). Forked ranks start with this process's imports (torch,
    diffusers, diffrl: most of a 2-rank CPU test's time on 2 cores) and its module state,
    monkeypatches included, and compute on one thread (`_forked_rank`). Returns mp's context."""
    if fork and not torch.cuda.is_available():
        return mp.start_processes(
            _forked_rank, args=(worker, *args), nprocs=nprocs, join=join, start_method="fork"
        )
    return mp.spawn(worker, args=args, nprocs=nprocs, join=join)


def _forked_rank(rank: int, worker: Callable, *args) -> None:
    # One compute thread before anything computes: the parent's OpenMP threads do not exist in a
    # forked child, and a parallel region over them hangs (a forked rank's first conv did, where
    # the parent had run convs on 2 threads); PyTorch's forked DataLoader workers do the same.
    torch.set_num_threads(1)
    worker(rank, *args)


def spawn_with_deadlines(
    worker: Callable,
    args: tuple,
    nprocs: int,
    out_dir: Path,
    *,
    start_s: float,
    run_s: float,
    what: str,
    fork: bool = False,
) -> None:
    """`worker(rank, *args)` on `nprocs` processes; kill them all and fail the test if they hang.

    `fork`: as `start_ranks`' (forked where the machine has no CUDA, instead of spawned)."""
    context = start_ranks(worker, args, nprocs, fork=fork, join=False)
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


def join_gloo(
    rank: int, world: int, port: int, out_dir: str | Path, timeout_s: float, backend: str = "gloo"
) -> None:
    """In a spawned worker: what a launcher sets (rank, world size, loopback rendezvous), one
    thread, the process group (gloo, or `backend`) with `timeout_s` on its collectives, then the
    `joined<rank>` file that starts `spawn_with_deadlines`' run deadline."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    distributed.init_distributed(backend, timeout=timedelta(seconds=timeout_s))
    Path(out_dir, f"joined{rank}").touch()
