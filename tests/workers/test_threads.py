"""Thread pools sized to the cores: the plan's arithmetic, and what each started process reports."""

import os
import subprocess
import sys

import pytest
import ray
import ray.cloudpickle
import torch

from diffrl.workers import RayGroup
from diffrl.workers.reward_workers import RayRewardWorkers
from diffrl.workers.threads import (
    THREAD_ENV_VARS,
    available_cores,
    plan_threads,
    set_threads,
    thread_budget,
    thread_env,
)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import tests/


class Probe:
    def threads(self) -> int:
        return torch.get_num_threads()


@pytest.mark.parametrize("cores", [1, 2, 3, 8, 16, 64])
@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("reward_workers", [0, 1, 3])
def test_plan_fits_the_cores(cores, workers, reward_workers):
    plan = plan_threads(workers, reward_workers, ray=True, cores=cores)
    processes = 1 + workers + reward_workers
    assert min(plan.driver, plan.worker, plan.reward) >= 1
    # Fits the cores, or each process has one thread when there are more processes than cores.
    assert plan.total <= max(cores, processes)
    assert plan.total == plan.driver + workers * plan.worker + reward_workers * plan.reward
    if cores >= processes:  # the spare cores go to the model workers, none left idle but the remainder
        assert cores - workers < plan.total <= cores
    single = plan_threads(workers, reward_workers, ray=False, cores=cores)
    assert single.total == single.driver == cores  # one process: the driver holds the model


def test_plan_example_and_errors():
    plan = plan_threads(2, 1, ray=True, cores=16)
    assert (plan.driver, plan.worker, plan.reward, plan.total) == (1, 7, 1, 16)
    with pytest.raises(ValueError, match=r"workers=0"):
        plan_threads(0, ray=True, cores=4)
    with pytest.raises(ValueError, match=r"threads=0"):
        thread_env(0)


def test_budget_is_the_affinity_capped_by_the_users_omp_setting(monkeypatch):
    assert available_cores() == len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert thread_budget() == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert thread_budget() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "64")
    assert thread_budget() == 4


def test_thread_env_sizes_a_child_process():
    # torch never starts more threads than cores, so both sizes are within the machine's.
    for threads in sorted({1, available_cores()}):
        env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV_VARS}
        env.update(thread_env(threads))
        out = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert int(out.stdout) == threads


def test_set_threads_sizes_this_process(monkeypatch):
    before = torch.get_num_threads()
    for key in THREAD_ENV_VARS:
        monkeypatch.delenv(key, raising=False)
    restore = set_threads(1)
    try:
        assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        restore()
    # a second job in this process must not read the first one's sizes as the user's cap
    assert torch.get_num_threads() == before
    assert all(key not in os.environ for key in THREAD_ENV_VARS)
    assert thread_budget() == available_cores()


def test_process_tree_threads_fit_the_cores(monkeypatch):
    """Driver, two Ray model workers and a Ray reward worker, each started with its share of this
    machine's cores: the compute threads they report (torch's pool) sum to at most the cores."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    plan = plan_threads(2, 1, ray=True)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    before = torch.get_num_threads()
    group = rewards = None
    try:
        set_threads(plan.driver)
        group = RayGroup(Probe, 2, num_cpus=1.0, env_vars=thread_env(plan.worker))
        rewards = RayRewardWorkers({"shapes": {}}, 1, env_vars=thread_env(plan.reward))
        reward_threads = ray.get(
            [a.__ray_call__.remote(lambda self: torch.get_num_threads()) for a in rewards.actors], timeout=60
        )
        reported = [torch.get_num_threads(), *group.call("threads"), *reward_threads]
    finally:
        torch.set_num_threads(before)
        if rewards is not None:
            rewards.close()
        if group is not None:
            group.shutdown()
        if started:
            ray.shutdown()
    assert reported == [plan.driver, plan.worker, plan.worker, plan.reward]
    assert sum(reported) <= max(available_cores(), len(reported))
