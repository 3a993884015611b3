"""Worker failures name the worker: a Ray actor that dies (exits, is killed, is SIGKILLed from
outside) fails the call with a `WorkerError` naming its class, rank, node and PID and quoting its
last log lines, within seconds, also when a peer's error came back first; `wait_any` returns the
first finished calls and fails fast. A worker that dies while idle, or busy while the controller
waits on another one, is found by the liveness watch and ends that wait with its error.

The PIDs and node IP the messages must contain come from the actors themselves (`os.getpid()` in a
method) and from `ray.nodes()`, not from the group's `identities`, so a wrong identity fails.
Ray starts once for the module (2 CPUs, 0.5 CPU per worker).
"""

import gc
import os
import pickle
import re
import signal
import sys
import threading
import time

import pytest
import ray
import ray.cloudpickle

from diffrl.workers import (
    InProcessGroup,
    RayGroup,
    WorkerError,
    WorkerIdentity,
    ensure_ray,
    gather,
    liveness,
    wait_any,
)
from diffrl.workers.errors import _read_tails, _remote_tails, log_tail
from diffrl.workers.futures import DEATH_GRACE_S, get_watched

# Ray's workers do not have tests/workers on their path: send this module's classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Fragile:
    """A worker that logs, sleeps, fails or exits on request."""

    def pid(self) -> int:
        return os.getpid()

    def say_then_exit(self, n_lines: int) -> None:
        for i in range(n_lines):
            print(f"\x1b[32mstep {i}\x1b[0m of the rollout")  # coloured, as progress output often is
        print("CUDA out of memory (pretend)", file=sys.stderr, flush=True)
        os._exit(1)  # no exception, no traceback: the process is simply gone

    def say_then_sleep(self, message: str, seconds: float) -> str:
        print(message, flush=True)
        time.sleep(seconds)
        return message

    def sleep_then(self, seconds: float, value: object) -> object:
        time.sleep(seconds)
        return value

    def fail(self) -> None:
        raise ValueError("bad shard")

    def die_after(self, seconds: float) -> None:
        time.sleep(seconds)
        os.kill(os.getpid(), signal.SIGKILL)

    def block(self, event: threading.Event) -> str:
        """In process only: wait until the test sets `event` (at most 30 s)."""
        return "released" if event.wait(30) else "not released"


# The SIGTERM handler the module's cluster saw after ensure_ray started it (None: Ray was running).
SIGTERM_AFTER_START: list = []


def _on_sigterm(signum, frame):  # what `diffrl train` installs (diffrl.controller.stopping), in short
    raise KeyboardInterrupt


@pytest.fixture(scope="module")
def ray_cluster():
    started = not ray.is_initialized()
    if started:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            ensure_ray(None, num_cpus=2)
            SIGTERM_AFTER_START.append(signal.getsignal(signal.SIGTERM))
        finally:
            signal.signal(signal.SIGTERM, previous)
    yield ray.nodes()[0]["NodeManagerAddress"]
    # Object refs still held in cycles (a caught error's traceback holds the frames that held
    # them) must go while Ray is up: one freed after ray.shutdown makes Ray end the process.
    gc.collect()
    if started:
        ray.shutdown()


def test_starting_ray_keeps_the_sigterm_handler(ray_cluster):
    """ray.init installs its own SIGTERM handler (a sys.exit that ended `diffrl train` in SIGABRT);
    ensure_ray puts back the one that was there."""
    if not SIGTERM_AFTER_START:
        pytest.skip("Ray was already running in this process")
    assert len(SIGTERM_AFTER_START) == 1 and SIGTERM_AFTER_START[0] is _on_sigterm


# A bound on noticing a death that a slow, loaded CI host keeps (the watch itself probes every
# PROBE_INTERVAL_S; the times measured are printed).
NOTICED_WITHIN_S = 15.0


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _found(since: float) -> list[WorkerError]:
    """The deaths the watch found, once it found one (at most NOTICED_WITHIN_S after `since`)."""
    while not liveness.pending_deaths() and time.monotonic() - since < NOTICED_WITHIN_S:
        time.sleep(0.01)
    return liveness.pending_deaths()


def test_a_worker_killed_while_idle_is_found_and_ends_a_wait_on_another(ray_cluster):
    """Rank 1, idle, is SIGKILLed while the controller is busy elsewhere (not waiting on any
    worker): the watch finds it within seconds, and the controller's next wait, on rank 0's
    minute-long call, raises rank 1's death at once instead of waiting for rank 0."""
    node_ip = ray_cluster
    with RayGroup(Fragile, 2, num_cpus=0.5) as group:
        pids = group.call("pid")
        slow = group._submit(0, "sleep_then", (60.0, "late"), {})
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        deaths = _found(killed)
        noticed = time.monotonic() - killed
        assert len(deaths) == 1, f"no death found within {NOTICED_WITHIN_S} s"
        started = time.monotonic()
        with pytest.raises(WorkerError) as info:
            gather([slow], timeout=60)
        raised = time.monotonic() - started
        print(
            f"\nidle worker killed: found {noticed:.2f} s after the kill, raised {raised:.2f} s into the wait"
        )
        assert raised < NOTICED_WITHIN_S  # not after rank 0's minute
        message = str(info.value)
        assert message.startswith(
            f"Fragile rank 1 (of 2) on node {node_ip} (pid {pids[1]}) died while idle "
            "(its last call: Fragile.pid): ActorDiedError: "
        ), message
        assert info.value.state == "idle" and info.value.process_failed
        assert liveness.pending_deaths() == []  # reported once
        # rank 0 is still alive and answering: its call is not failed by rank 1's death
        assert not slow.done()
    assert liveness.pending_deaths() == [] and not liveness.watching()  # shutdown's kills are no deaths


def test_a_busy_worker_killed_while_the_controller_waits_elsewhere_ends_that_wait(ray_cluster):
    """Rank 1 is SIGKILLed in the middle of a call while the controller waits for a result that
    is not a call of this group (a reward worker's scores: `get_watched`): the wait ends within
    seconds with rank 1's error, naming the call it was running and its last log lines."""
    node_ip = ray_cluster
    other = ray.remote(num_cpus=0)(_sleep).remote(60)  # what the controller waits for
    with RayGroup(Fragile, 2, num_cpus=0.5) as group:
        pids = group.call("pid")
        group._submit(1, "say_then_sleep", ("decoding micro-batch 3", 60.0), {})
        time.sleep(0.5)  # inside the call
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(WorkerError) as info:
            get_watched(other, timeout=60)
        waited = time.monotonic() - killed
        print(f"\nbusy worker killed: the other wait ended {waited:.2f} s after the kill")
        assert waited < NOTICED_WITHIN_S
        message = str(info.value)
        assert message.startswith(
            f"Fragile rank 1 (of 2) on node {node_ip} (pid {pids[1]}) died during Fragile.say_then_sleep: "
            "ActorDiedError: "
        ), message
        assert "  decoding micro-batch 3" in message.splitlines()
        assert group.call_async("pid")[0].result(timeout=30) == pids[0]  # rank 0 goes on
    ray.cancel(other, force=True)


def test_a_worker_that_exits_is_named_with_its_node_pid_and_last_lines(ray_cluster):
    node_ip = ray_cluster
    with RayGroup(Fragile, 2, num_cpus=0.5) as group:
        pids = group.call("pid")
        identities = group.identities
        assert [(i.rank, i.cls_name, i.pid, i.node_ip) for i in identities] == [
            (0, "Fragile", pids[0], node_ip),
            (1, "Fragile", pids[1], node_ip),
        ]
        # Ray sends an actor's stdout and stderr to worker-<id>-<job>-<pid>.out/.err in its logs dir.
        for identity in identities:
            assert [path.rsplit("-", 1)[1] for path in identity.log_files] == [
                f"{identity.pid}.out",
                f"{identity.pid}.err",
            ]

        slow = group._submit(0, "sleep_then", (60.0, "late"), {})
        dying = group._submit(1, "say_then_exit", (30,), {})
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            gather([slow, dying])
        assert time.monotonic() - start < 5.0  # not after rank 0's minute
        message = str(info.value)
        assert message.startswith(
            f"Fragile rank 1 (of 2) on node {node_ip} (pid {pids[1]}) died during Fragile.say_then_exit: "
            "ActorDiedError: "
        ), message
        assert "\x1b" not in message
        # The last 20 lines of stdout (steps 10..29, not 9), then stderr's line.
        out, err = identities[1].log_files
        lines = message.splitlines()
        out_at = lines.index(f"Last 20 lines of {out}:")
        assert lines[out_at + 1 : out_at + 21] == [f"  step {i} of the rollout" for i in range(10, 30)]
        assert "  step 9 of the rollout" not in lines
        err_at = lines.index(f"Last 1 line of {err}:")
        assert lines[err_at + 1] == "  CUDA out of memory (pretend)"

        error = info.value
        assert (error.rank, error.size, error.method) == (1, 2, "Fragile.say_then_exit")
        assert isinstance(error.cause, ray.exceptions.ActorDiedError)
        assert error.identity == identities[1]
        copy = pickle.loads(pickle.dumps(error))
        assert str(copy) == message and copy.identity == identities[1] and copy.rank == 1

        # ray.kill from the controller: rank 0's running call fails naming rank 0.
        ray.kill(group.actors[0])
        with pytest.raises(
            WorkerError,
            match=rf"^Fragile rank 0 \(of 2\) on node {re.escape(node_ip)} \(pid {pids[0]}\) died during Fragile\.sleep_then: ActorDiedError",
        ):
            slow.result(timeout=10)


def test_a_worker_sigkilled_from_outside_fails_gather_within_seconds(ray_cluster):
    node_ip = ray_cluster
    with RayGroup(Fragile, 2, num_cpus=0.5) as group:
        pids = group.call("pid")
        pending = group.call_async("say_then_sleep", "loading 40 GB of weights", 60.0)
        time.sleep(0.5)  # both are inside the call
        os.kill(pids[1], signal.SIGKILL)  # what the kernel's OOM killer does
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            gather(pending, timeout=30)
        assert time.monotonic() - start < 10.0
        message = str(info.value)
        assert message.startswith(
            f"Fragile rank 1 (of 2) on node {node_ip} (pid {pids[1]}) died during Fragile.say_then_sleep: "
        ), message
        assert "  loading 40 GB of weights" in message.splitlines()


def test_gather_names_a_dead_worker_before_the_peer_whose_error_came_first(ray_cluster):
    """A call that fails because a peer in its collective died (gloo: "a peer died") can come back
    before Ray reports the death; gather names the dead worker. Here rank 0 fails at once and rank
    1 dies a second later, so rank 0's error is in first (without the grace gather would raise it
    at once) and the death comes within DEATH_GRACE_S of it."""
    node_ip = ray_cluster
    with RayGroup(Fragile, 2, num_cpus=0.5) as group:
        pids = group.call("pid")
        failing = group._submit(0, "fail", (), {})
        dying = group._submit(1, "die_after", (1.0,), {})
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            gather([failing, dying], timeout=30)
        waited = time.monotonic() - start
        assert str(info.value).startswith(
            f"Fragile rank 1 (of 2) on node {node_ip} (pid {pids[1]}) died during Fragile.die_after: "
            "ActorDiedError"
        ), str(info.value)[:500]
        assert info.value.process_failed
        assert 0.9 < waited < DEATH_GRACE_S + 1.0, waited
        with pytest.raises(WorkerError, match=r"worker rank 0 \(of 2\) failed in Fragile.fail") as own:
            failing.result()
        assert not own.value.process_failed


def test_wait_any_in_process():
    event = threading.Event()
    group = InProcessGroup(Fragile, 3)
    try:
        blocked = group._submit(0, "block", (event,), {})
        fast = group._submit(1, "sleep_then", (0.05, "fast"), {})
        start = time.monotonic()
        assert wait_any([blocked, fast], timeout=10) == [fast]
        assert time.monotonic() - start < 5.0 and fast.result() == "fast"
        with pytest.raises(
            TimeoutError, match=r"^wait_any timed out after 0.2 s while waiting for: rank 0 Fragile.block$"
        ):
            wait_any([blocked], timeout=0.2)
        failing = group._submit(2, "fail", (), {})
        with pytest.raises(
            WorkerError, match=r"worker rank 2 \(of 3\) failed in Fragile.fail: ValueError: bad shard"
        ):
            wait_any([blocked, failing], timeout=10)
        event.set()
        assert blocked.result(timeout=10) == "released"
        assert wait_any([blocked, fast], timeout=10) == [blocked, fast]  # all done: the given order
        with pytest.raises(ValueError, match=r"at least one future"):
            wait_any([])
    finally:
        event.set()
        group.shutdown()


def test_wait_any_on_ray_and_mixed_futures(ray_cluster):
    node_ip = ray_cluster
    with RayGroup(Fragile, 2, num_cpus=0.5) as group:
        pids = group.call("pid")
        slow = group._submit(0, "say_then_sleep", ("still sampling prompt 7", 30.0), {})
        fast = group._submit(1, "sleep_then", (0.1, "fast"), {})
        start = time.monotonic()
        assert wait_any([slow, fast], timeout=20) == [fast]
        assert time.monotonic() - start < 10.0 and fast.result() == "fast"

        # A worker that stops answering: the timeout names it, its node and what it printed last.
        with pytest.raises(TimeoutError) as info:
            wait_any([slow], timeout=0.5)
        lines = str(info.value).splitlines()
        assert lines[0] == "wait_any timed out after 0.5 s while waiting for: rank 0 Fragile.say_then_sleep"
        assert (
            f"Fragile rank 0 on node {node_ip} (pid {pids[0]}) is still running Fragile.say_then_sleep."
            in lines
        )
        assert "  still sampling prompt 7" in lines

        failing = group._submit(1, "fail", (), {})
        with pytest.raises(
            WorkerError, match=r"^worker rank 1 \(of 2\) failed in Fragile.fail: ValueError: bad shard"
        ):
            wait_any([slow, failing], timeout=20)

        # Ray and in-process futures together (a Ray rollout group and an in-process reward model).
        local = InProcessGroup(Fragile, 1)
        try:
            quick = local._submit(0, "sleep_then", (0.1, "local"), {})
            assert wait_any([slow, quick], timeout=20) == [quick]
            with pytest.raises(TimeoutError, match=r"rank 0 Fragile.say_then_sleep"):
                wait_any([slow], timeout=0.3)
        finally:
            local.shutdown()


def testlog_tails_from_another_node_or_nowhere(ray_cluster, tmp_path):
    node_id = ray.get_runtime_context().get_node_id()
    log = tmp_path / "worker-abc-01000000-123.err"
    log.write_text(":job_id:01000000\n:actor_name:Fragile\n" + "".join(f"line {i}\n" for i in range(30)))
    # The lines a task pinned to the worker's node reads are those read here (one node in tests).
    identity = WorkerIdentity(0, "Fragile", "10.0.0.7", node_id, 123, (str(log),))
    here = _read_tails([str(log)], 5)
    assert here == {str(log): [f"line {i}" for i in range(25, 30)]}
    assert _read_tails([str(log)], 40) == {str(log): [f"line {i}" for i in range(30)]}  # no Ray markers
    assert _remote_tails(identity, 5, timeout=30) == here
    # A node that is not in the cluster: say where the file is, within the remote read's deadline.
    gone = WorkerIdentity(0, "Fragile", "10.0.0.7", "ab" * 28, 123, ("/nonexistent/worker-x.out",))
    start = time.monotonic()
    assert log_tail(gone) == "Its log /nonexistent/worker-x.out is on node 10.0.0.7 (not readable from here)."
    assert time.monotonic() - start < 10.0
