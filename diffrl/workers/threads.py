"""Thread pools sized to the cores this job may use, across every process diffrl starts.

torch (OpenMP / MKL intra-op pools), numpy's BLAS and Tesseract each start as many threads as the
machine has cores, in every process. A job of several processes (the driver, Ray workers, Ray
reward workers) then runs several times more compute threads than cores, and small models slow
down by one to two orders of magnitude under that oversubscription (a tiny SD3 step: 0.3 s with
one thread per process, 26 s with the defaults while other processes ran). So the driver plans the
split once, from the cores it is allowed to run on (`os.sched_getaffinity`, which honours
`taskset`, cgroup cpusets and Slurm; an OMP_NUM_THREADS set by the user caps it), and every
process gets its share:

    plan = plan_threads(workers=2, reward_workers=1, ray=True)   # ThreadPlan(driver=1, worker=.., reward=..)
    restore = set_threads(plan.driver)                           # this process (and what it spawns)
    RayGroup(..., env_vars=thread_env(plan.worker))              # each Ray worker
    RayRewardWorkers(..., env_vars=thread_env(plan.reward))      # each reward actor

A Ray worker's pool size has to arrive as environment variables: OpenMP reads them when the
process starts, before any diffrl code runs in it.

Rule: with Ray the driver only orchestrates (1 thread) and each reward actor scores with 1 thread;
the cores left go to the model workers, split evenly. In a single process (the default CPU job)
the driver holds the model and gets every core; its in-process reward thread shares that pool.
When there are more processes than cores each gets 1 thread: the total is then the number of
processes, the least it can be.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

#: The variables that size a process's compute thread pools: OpenMP (torch's intra-op pool, and
#: Tesseract, which also obeys OMP_THREAD_LIMIT), MKL and OpenBLAS (numpy).
THREAD_ENV_VARS: tuple[str, ...] = (
    "OMP_NUM_THREADS",
    "OMP_THREAD_LIMIT",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
)


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), not the machine's core count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity call
        return os.cpu_count() or 1


def thread_budget() -> int:
    """Compute threads the whole job may use: `available_cores()`, or fewer when the user capped
    it with OMP_NUM_THREADS (a shared machine, a benchmark that pins threads)."""
    cores = available_cores()
    cap = os.environ.get("OMP_NUM_THREADS", "").strip()
    if cap.isdigit() and int(cap) >= 1:
        return min(cores, int(cap))
    return cores


@dataclass(frozen=True)
class ThreadPlan:
    """Compute threads per process: the driver, each model worker, each reward worker."""

    cores: int
    driver: int
    worker: int
    reward: int
    workers: int
    reward_workers: int
    ray: bool

    @property
    def total(self) -> int:
        """Compute threads of the whole process tree."""
        if not self.ray:
            return self.driver
        return self.driver + self.workers * self.worker + self.reward_workers * self.reward


def plan_threads(workers: int, reward_workers: int = 0, *, ray: bool, cores: int | None = None) -> ThreadPlan:
    """The split of `cores` (default: `thread_budget()`) described in the module docstring.

    workers: model workers (Ray actors when `ray`; ignored otherwise: the driver is the worker).
    reward_workers: Ray reward actors (ignored without Ray: rewards then run in the driver).
    """
    cores = thread_budget() if cores is None else cores
    if cores < 1 or workers < 1 or reward_workers < 0:
        raise ValueError(
            f"plan_threads(workers={workers}, reward_workers={reward_workers}, cores={cores}): need "
            "cores >= 1, workers >= 1 and reward_workers >= 0"
        )
    if not ray:
        return ThreadPlan(cores, cores, cores, cores, 1, 0, ray=False)
    spare = cores - (1 + workers + reward_workers)  # after one thread for every process
    worker = 1 + max(0, spare) // workers
    return ThreadPlan(cores, 1, worker, 1, workers, reward_workers, ray=True)


def thread_env(threads: int) -> dict[str, str]:
    """Environment variables that start a process with `threads` compute threads per pool."""
    if threads < 1:
        raise ValueError(f"threads={threads}: a process needs at least 1 compute thread")
    return dict.fromkeys(THREAD_ENV_VARS, str(threads))


def set_threads(threads: int) -> Callable[[], None]:
    """Size this process's torch pool now, and the pools of processes it starts from here on
    (they inherit the environment). Returns what undoes it: a job restores the previous sizes
    when it ends, so a second job in the same process does not read this job's OMP_NUM_THREADS
    as a cap the user set."""
    import torch

    saved_env = {key: os.environ.get(key) for key in THREAD_ENV_VARS}
    saved_threads = torch.get_num_threads()
    os.environ.update(thread_env(threads))
    torch.set_num_threads(threads)

    def restore() -> None:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        torch.set_num_threads(saved_threads)

    return restore


__all__ = [
    "THREAD_ENV_VARS",
    "ThreadPlan",
    "available_cores",
    "plan_threads",
    "set_threads",
    "thread_budget",
    "thread_env",
]
