"""`diffrl.controller.run._start_together`: a run's pools (trainer, replicas, reward workers) start
at once, and a failed start leaves none of the others running."""

import threading
from contextlib import ExitStack

import pytest

from diffrl.controller.run import _start_together


def test_the_starts_run_at_once_and_return_in_order():
    # a barrier of two only opens when both starts wait at it together: run one after the other,
    # the first would wait alone and time out
    barrier = threading.Barrier(2, timeout=10)
    closed = []

    def start(name):
        def run():
            barrier.wait()
            return name, lambda: closed.append(name)

        return run

    with ExitStack() as stack:
        assert _start_together(stack, start("trainer"), start("replicas")) == ["trainer", "replicas"]
        assert closed == []
    assert sorted(closed) == ["replicas", "trainer"]


def test_a_failed_start_closes_the_started_ones_and_raises_the_first_failure():
    closed = []
    with pytest.raises(RuntimeError, match="trainer failed"), ExitStack() as stack:
        _start_together(
            stack,
            lambda: (_ for _ in ()).throw(RuntimeError("trainer failed")),
            lambda: ("replicas", lambda: closed.append("replicas")),
            lambda: (_ for _ in ()).throw(ValueError("rewards failed too")),
            lambda: (None, None),  # nothing to close (a run without reward functions)
        )
    assert closed == ["replicas"]


def test_a_single_start_runs_in_the_callers_thread():
    threads = []
    with ExitStack() as stack:
        assert _start_together(stack, lambda: (threads.append(threading.current_thread()), None)) == [None]
    assert threads == [threading.main_thread()]
