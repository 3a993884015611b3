"""WorkerGroup: InProcessGroup and RayGroup call plain classes the same way, by name, in rank order.

Expected values are written out by hand from the test class's arithmetic, not computed by one group
and compared with the other, so a bug shared by both groups still fails. Ray starts once for the
module (2 CPUs); each Ray group takes 0.5 CPU per worker, so two groups fit at once.
"""

import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import ClassVar

import pytest
import ray
import ray.cloudpickle
import torch
import torch.distributed as dist

from diffrl.workers import InProcessGroup, RayGroup, WorkerError, WorkerFuture, ensure_ray, gather

# pytest imports this file as `test_group` from tests/workers, a directory Ray's worker processes do
# not have on their path: pickle this module's classes by value so the actors can rebuild them.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "DIFFRL_TAG",
)


class Ledger:
    """A part of `Counter` (addressed as "ledger.<method>"): what was written to it, in order."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, line: str, *, twice: bool = False) -> int:
        self.lines += [line] * (2 if twice else 1)
        return len(self.lines)

    def read(self) -> list[str]:
        return list(self.lines)

    def _hidden(self) -> None:  # not a call: private
        raise AssertionError("a private method of a part was called")


class Counter:
    """A plain worker class: a running total, some tensor math, failures on request; a part."""

    PARTS: ClassVar[dict[str, type]] = {"ledger": Ledger}

    def __init__(self, start: float = 0.0, fail: bool = False) -> None:
        if fail:
            raise ValueError(f"cannot start from {start}")
        self.total = start
        self.init_thread = threading.current_thread().name
        self.ledger = Ledger()
        self.scratch = Ledger()  # an attribute, not a declared part: never addressed

    def threads(self) -> tuple[str, str]:
        """The thread that constructed this worker and the one running this call."""
        return self.init_thread, threading.current_thread().name

    def add(self, x: float) -> float:
        self.total += x
        return self.total

    def affine(self, shard_N: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
        return shard_N * factor + self.total

    def fail_if(self, flag: bool) -> str:
        if flag:
            raise ValueError(f"flagged shard at total={self.total}")
        return "ok"

    def sleep_then(self, seconds: float, value: object) -> object:
        time.sleep(seconds)
        return value

    def env(self) -> dict[str, str | None]:
        return {key: os.environ.get(key) for key in ENV_KEYS}

    def timeout_error(self) -> None:
        raise TimeoutError("mine")

    def pid(self) -> int:
        return os.getpid()

    def all_reduce(self, value: float) -> tuple[int, int, float]:
        """Join the process group RayGroup's env vars describe, sum `value` over ranks, leave."""
        dist.init_process_group("gloo", timeout=timedelta(seconds=30))  # env:// from RANK, MASTER_*
        try:
            tensor = torch.tensor([value])
            dist.all_reduce(tensor)
            return dist.get_rank(), dist.get_world_size(), tensor.item()
        finally:
            dist.destroy_process_group()


def run_script(group) -> list:
    """The same calls on any group of 2 Counters started at 1.0; returns every result."""
    out = [group.call("add", 2.0)]  # 1 + 2 on both
    out.append(group.scatter("add", [10.0, 20.0]))  # rank 0: 13, rank 1: 23
    shards = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    out.append(group.scatter("affine", shards, factor=2.0))  # 2 * shard + total
    first = group.call_async("add", x=1.0)  # 14, 24
    second = group.scatter_async("add", [0.5, 0.25])  # after `first` on each worker: 14.5, 24.25
    assert all(isinstance(f, WorkerFuture) for f in first + second)
    out.append(group.gather(first + second))
    out.append(gather(group.call_async("add", 0.0), timeout=30))
    return out


EXPECTED = [
    [3.0, 3.0],
    [13.0, 23.0],
    [torch.tensor([15.0, 17.0]), torch.tensor([29.0, 31.0])],
    [14.0, 24.0, 14.5, 24.25],
    [14.5, 24.25],
]


def check_script(results: list) -> None:
    assert len(results) == len(EXPECTED)
    for got, want in zip(results, EXPECTED, strict=True):
        if isinstance(want[0], torch.Tensor):
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w)
        else:
            assert got == want


def check_errors(group) -> None:
    """Argument errors fail in the controller; a worker error names its rank; the group survives."""
    with pytest.raises(ValueError, match=r"scatter\('add'\) got 3 shards for 2 workers"):
        group.scatter("add", [1.0, 2.0, 3.0])
    with pytest.raises(TypeError, match=r"needs a sequence of 2 shards"):
        group.scatter("add", {0: 1.0, 1: 2.0})
    with pytest.raises(ValueError, match=r"Counter has no method 'ad'; its public methods are \['add'"):
        group.call("ad", 1.0)
    with pytest.raises(
        WorkerError, match=r"worker rank 1 \(of 2\) failed in Counter\.fail_if: ValueError"
    ) as info:
        group.scatter("fail_if", [False, True])
    assert info.value.rank == 1 and info.value.method == "Counter.fail_if"
    assert isinstance(info.value.cause, ValueError)
    assert str(info.value.cause).startswith("flagged shard at total=")
    assert group.call("fail_if", False) == ["ok", "ok"]  # still usable


def check_parts(group) -> None:
    """ "part.method" runs the method of the part the worker declares, in call order with the
    worker's own methods; an undeclared part, a private or a missing method fails in the controller."""
    assert group.call("ledger.write", "a") == [1, 1]
    assert group.scatter("ledger.write", ["b", "c"], twice=True) == [3, 3]
    futures = group.call_async("ledger.write", "d") + group.call_async("add", 0.0)
    assert group.gather(futures)[:2] == [4, 4]
    assert group.submit(1, "ledger.read").result(30) == ["a", "c", "c", "d"]
    with pytest.raises(
        ValueError, match=r"Counter has no part 'scratch' \(in 'scratch\.write'\); its parts are \['ledger'\]"
    ):
        group.call("scratch.write", "x")
    with pytest.raises(
        ValueError, match=r"Counter has no method 'ledger\._hidden'; its public methods are \['add'"
    ):
        group.call("ledger._hidden")
    with pytest.raises(
        ValueError,
        match=r"no method 'ledger\.wirte'; its public methods are \[.*'ledger\.read', 'ledger\.write'\]",
    ):
        group.call("ledger.wirte", "x")
    with pytest.raises(ValueError, match=r"Counter has no part 'ledger\.x'"):
        group.call("ledger.x.write", "x")
    assert group.call("ledger.read")[0] == ["a", "b", "b", "d"]  # nothing else reached the worker


def check_overlap(group) -> None:
    """`call_async` returns before the work ends, and workers run concurrently."""
    start = time.perf_counter()
    futures = group.call_async("sleep_then", 0.6, "done")
    assert time.perf_counter() - start < 0.3
    assert not any(f.done() for f in futures)
    assert gather(futures) == ["done", "done"]
    assert time.perf_counter() - start < 1.1  # 2 x 0.6 s would be 1.2 s one after the other
    assert all(f.done() for f in futures)


# ------------------------------------------------------------------------------ before Ray starts
def test_ensure_ray_and_ray_group_need_a_reachable_cluster():
    assert not ray.is_initialized(), "an earlier test left Ray running: it must shut down what it starts"
    with pytest.raises(RuntimeError, match=r"RayGroup needs a running Ray: call diffrl.workers.ensure_ray"):
        RayGroup(Counter, 2)
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.perf_counter()
    with pytest.raises(ConnectionError, match=rf"Ray cluster at address='127.0.0.1:{port}' is unreachable"):
        ensure_ray(f"127.0.0.1:{port}")
    assert time.perf_counter() - start < 5.0
    with pytest.raises(ValueError, match=r"num_cpus only applies to a local cluster"):
        ensure_ray("127.0.0.1:6379", num_cpus=2)
    assert not ray.is_initialized()


def test_ensure_ray_starts_a_cluster_of_its_own_whatever_the_environment_points_at(monkeypatch):
    """Ray without an address joins RAY_ADDRESS (or any cluster running on the machine): a run must
    not share another run's cluster, so ensure_ray() asks for a local one explicitly."""
    assert not ray.is_initialized()
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{sock.getsockname()[1]}")
    try:
        assert ensure_ray(None, num_cpus=1) is True
        assert ray.cluster_resources()["CPU"] == 1.0  # the cluster it started, with its num_cpus
    finally:
        ray.shutdown()


def test_submit_and_the_group_deadline():
    with InProcessGroup(Counter, 2) as group:
        assert group.submit(1, "add", 2.0).result() == 2.0
        assert [w.total for w in group.workers] == [0.0, 2.0]  # rank 1 alone
        with pytest.raises(ValueError, match=r"rank 2 is not a worker of this group of 2"):
            group.submit(2, "add", 1.0)
        with pytest.raises(ValueError, match=r"Counter has no method 'nope'"):
            group.submit(0, "nope")
        group.timeout_s = 0.1
        with pytest.raises(TimeoutError, match=r"gather timed out after 0.1 s"):
            group.call("sleep_then", 0.5, "late")


# ------------------------------------------------------------------------------------ in process
@pytest.mark.parametrize("synchronous", [False, True])
def test_in_process_group(synchronous):
    with InProcessGroup(Counter, 2, 1.0, synchronous=synchronous) as group:
        assert group.size == len(group) == 2
        check_script(run_script(group))
        check_errors(group)
        check_parts(group)
        if not synchronous:
            check_overlap(group)
        assert [w.total for w in group.workers] == [14.5, 24.25]
    with pytest.raises(RuntimeError, match=r"InProcessGroup of Counter was shut down"):
        group.call("add", 1.0)


def test_in_process_threads_and_constructor_error():
    with InProcessGroup(Counter, 2) as group:
        (init0, call0), (init1, call1) = group.call("threads")
        assert init0 == call0 and init1 == call1  # built in the thread that runs its calls
        assert len({call0, call1, threading.current_thread().name}) == 3  # one thread per worker
        # A TimeoutError the worker raises is the worker's error; a gather running out is not.
        with pytest.raises(
            WorkerError, match=r"rank \d \(of 2\) failed in Counter.timeout_error: TimeoutError: mine"
        ):
            group.call("timeout_error")
        pending = group.call_async("sleep_then", 0.5, "late")
        with pytest.raises(
            TimeoutError,
            match=r"gather timed out after 0.1 s while waiting for: rank 0 Counter.sleep_then, rank 1",
        ):
            gather(pending, timeout=0.1)
        assert gather(pending) == ["late", "late"]
        # Fail fast: rank 1's error is raised while rank 0 still sleeps.
        start = time.perf_counter()
        slow, failing = (
            group._submit(0, "sleep_then", (1.0, "late"), {}),
            group._submit(1, "fail_if", (True,), {}),
        )
        with pytest.raises(WorkerError, match=r"worker rank 1 \(of 2\) failed in Counter.fail_if"):
            gather([slow, failing])
        assert time.perf_counter() - start < 0.6 and not slow.done()
    with InProcessGroup(Counter, 2, synchronous=True) as group:
        main = threading.current_thread().name
        assert group.call("threads") == [(main, main), (main, main)]
        future = group.call_async("add", 1.0)[0]
        assert future.done() and future.result() == 1.0  # already resolved
    with pytest.raises(
        WorkerError,
        match=r"worker rank 0 \(of 2\) failed in Counter.__init__: ValueError: cannot start from 5.0",
    ):
        InProcessGroup(Counter, 2, 5.0, fail=True)


def test_group_options_cannot_shadow_constructor_parameters():
    class Shadowing:
        def __init__(self, num_gpus: int) -> None:
            self.num_gpus = num_gpus

    with pytest.raises(
        TypeError, match=r"parameter\(s\) \['num_gpus'\] with the same name as RayGroup options"
    ):
        RayGroup(Shadowing, 1, num_gpus=0)
    with pytest.raises(ValueError, match=r"n >= 1"):
        InProcessGroup(Counter, 0)


# ------------------------------------------------------------------------------------------- Ray
@pytest.fixture(scope="module")
def ray_cluster():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_group(ray_cluster):
    tags = [{"DIFFRL_TAG": "first"}, {"DIFFRL_TAG": "second"}]
    group = RayGroup(Counter, 2, 1.0, num_cpus=0.5, env_vars=tags, placement_strategy="PACK")
    yield group
    group.shutdown()


def test_ray_group_same_results_as_in_process(ray_group):
    assert ray_group.size == 2
    check_script(run_script(ray_group))
    check_errors(ray_group)
    check_parts(ray_group)
    check_overlap(ray_group)
    pids = ray_group.call("pid")
    assert len(set(pids)) == 2 and os.getpid() not in pids  # one process per worker


def test_ray_worker_error_keeps_the_remote_traceback(ray_group):
    with pytest.raises(WorkerError) as info:
        ray_group.scatter("fail_if", [True, False])
    message = str(info.value)
    assert message.startswith("worker rank 0 (of 2) failed in Counter.fail_if: ValueError: flagged shard")
    assert "Remote traceback of rank 0" in message and 'raise ValueError(f"flagged shard' in message
    assert type(info.value.cause) is ValueError  # unwrapped from RayTaskError


def test_ray_env_vars_form_a_gloo_process_group(ray_group):
    envs = ray_group.call("env")
    assert [env["RANK"] for env in envs] == ["0", "1"]
    assert [env["LOCAL_RANK"] for env in envs] == ["0", "1"]  # one node
    assert [env["DIFFRL_TAG"] for env in envs] == ["first", "second"]
    for env in envs:
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == ray.nodes()[0]["NodeManagerAddress"]  # the one node's IP
        assert env["MASTER_PORT"] == str(ray_group.master_port)
    assert 1024 <= ray_group.master_port <= 65535
    # The real check: both actors join one gloo group from these variables and sum across it.
    assert ray_group.scatter("all_reduce", [1.5, 2.0]) == [(0, 2, 3.5), (1, 2, 3.5)]
    # On a multi-node cluster rank 0 may sit on another node: the address comes from a task there.
    address, port = ray_group._master_address(node_id="another node")
    assert address == ray.nodes()[0]["NodeManagerAddress"] and 1024 <= port <= 65535
    table = ray.util.placement_group_table(ray_group.placement_group)
    assert table["strategy"] == "PACK" and len(table["bundles"]) == 2
    assert all(bundle == {"CPU": 0.5} for bundle in table["bundles"].values())


def test_ray_options_are_checked(ray_cluster):
    with pytest.raises(ValueError, match=r"env_vars has 1 per-rank mappings for n=2"):
        RayGroup(Counter, 2, env_vars=[{"A": "1"}])
    with pytest.raises(ValueError, match=r"env_vars for rank 0 sets \['MASTER_PORT'\]"):
        RayGroup(Counter, 2, env_vars={"MASTER_PORT": "1234"})
    with pytest.raises(ValueError, match=r"placement_strategy='TIGHT' is not one of"):
        RayGroup(Counter, 2, placement_strategy="TIGHT")
    # Infeasible placement fails with the cluster's resources in the message and leaves nothing behind.
    with pytest.raises(
        TimeoutError, match=r"could not place 2 workers of Counter \(num_cpus=0.5, num_gpus=1"
    ):
        RayGroup(Counter, 2, num_cpus=0.5, num_gpus=1, placement_timeout_s=1.0)
    pending = [pg for pg in ray.util.placement_group_table().values() if pg["state"] not in ("REMOVED",)]
    assert all(pg["bundles"][0].get("GPU", 0) == 0 for pg in pending)


def wait_for_free_cpus(expected: float, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        free = ray.available_resources().get("CPU", 0.0)
        if abs(free - expected) < 1e-6:
            return free
        time.sleep(0.1)
    return ray.available_resources().get("CPU", 0.0)


def test_ray_fail_fast_then_shutdown_releases_everything(ray_group):
    total = ray.cluster_resources()["CPU"]
    free_before = wait_for_free_cpus(total - 1.0)  # the module's group holds 2 x 0.5 CPU
    assert free_before == pytest.approx(total - 1.0)
    group = RayGroup(Counter, 2, num_cpus=0.5, placement_strategy="SPREAD")
    assert wait_for_free_cpus(free_before - 1.0) == pytest.approx(free_before - 1.0)
    actors, placement = list(group.actors), group.placement_group
    # Rank 0 blocks for a minute; rank 1's error comes back at once, not after rank 0.
    slow = group._submit(0, "sleep_then", (60.0, "late"), {})
    failing = group._submit(1, "fail_if", (True,), {})
    start = time.perf_counter()
    with pytest.raises(WorkerError, match=r"worker rank 1 \(of 2\)"):
        gather([slow, failing])
    assert time.perf_counter() - start < 10.0
    group.shutdown()  # kills rank 0 mid-call
    group.shutdown()  # idempotent
    assert wait_for_free_cpus(free_before) == pytest.approx(free_before)
    assert ray.util.placement_group_table(placement)["state"] == "REMOVED"
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.pid.remote(), timeout=30)
    with pytest.raises(
        WorkerError, match=r"^Counter rank 0 \(of 2\) on node .* died during Counter.sleep_then: .*Actor"
    ):
        slow.result(timeout=30)
    with pytest.raises(RuntimeError, match=r"RayGroup of Counter was shut down"):
        group.call("pid")


def test_ray_constructor_error_in_a_shared_placement_group(ray_group):
    placement = ray.util.placement_group([{"CPU": 0.5}, {"CPU": 0.5}])
    try:
        with pytest.raises(
            WorkerError,
            match=r"(?s)failed in Counter.__init__: ActorDiedError: .*ValueError: cannot start from 7.0$",
        ):
            RayGroup(Counter, 2, 7.0, fail=True, num_cpus=0.5, placement_group=placement)
        # The group did not own the placement group, so it is still there for the next group.
        assert ray.util.placement_group_table(placement)["state"] == "CREATED"
        with RayGroup(Counter, 1, 2.0, num_cpus=0.5, placement_group=placement, bundle_indices=[1]) as group:
            assert group.call("add", 1.0) == [3.0]
            assert group.call("env")[0]["RANK"] == "0"
            assert group.env_vars[0]["WORLD_SIZE"] == "1"
        assert ray.util.placement_group_table(placement)["state"] == "CREATED"
    finally:
        ray.util.remove_placement_group(placement)
