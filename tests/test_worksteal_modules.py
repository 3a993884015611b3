"""tests/conftest.py's `--dist worksteal` scheduler: chunks it sends and tails it steals are whole
test modules where they can be (a module's fixtures are then built on one worker, once)."""

import pytest

pytest.importorskip("xdist")

import importlib.util
from pathlib import Path

# tests/conftest.py by its path: `import conftest` finds whichever conftest module pytest loaded
# first (tests/rewards/conftest.py on some workers)
_spec = importlib.util.spec_from_file_location("tests_root_conftest", Path(__file__).parent / "conftest.py")
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
_work_steal_keeping_modules = _conftest._work_steal_keeping_modules

COLLECTION = [
    "tests/a.py::t0",
    "tests/a.py::t1",
    "tests/b.py::t0",
    "tests/b.py::t1",
    "tests/b.py::t2",
    "tests/c.py::t0",
    "tests/c.py::t1",
    "tests/c.py::t2",
]


class Node:
    def __init__(self):
        self.sent, self.steals = [], []

    def send_runtest_some(self, indices):
        self.sent.append(list(indices))

    def send_steal(self, indices):
        self.steals.append(list(indices))


def scheduler():
    cls = _work_steal_keeping_modules()
    sched = cls.__new__(cls)  # no pytest config: only the parts these use
    sched.collection, sched.pending, sched.node2pending = COLLECTION, [], {}
    return sched


def test_the_first_chunk_ends_where_its_last_module_ends():
    sched, node = scheduler(), Node()
    sched.node2pending[node] = []
    sched.pending[:] = range(len(COLLECTION))
    sched._send_tests(node, 3)  # plain worksteal: b.py's first test only
    assert node.sent == [[0, 1, 2, 3, 4]] and sched.pending == [5, 6, 7]


def test_a_steal_starts_at_a_module_start_or_takes_what_plain_worksteal_takes():
    sched = scheduler()
    # the victim runs a.py's t0: the tail from b.py's t2 on starts at c.py instead
    assert sched._steal_whole_modules(list(range(8)), [4, 5, 6, 7]) == [5, 6, 7]
    # inside the last module, not begun: the whole module
    assert sched._steal_whole_modules([3, 4, 5, 6, 7], [6, 7]) == [5, 6, 7]
    # the victim is in the module already: as plain worksteal
    assert sched._steal_whole_modules([5, 6, 7], [7]) == [7]


def test_the_nodes_steal_requests_go_through_it():
    sched, node = scheduler(), Node()
    sched.add_node(node)  # wraps the node's send_steal
    sched.node2pending[node] = list(range(8))
    node.send_steal([4, 5, 6, 7])
    assert node.steals == [[5, 6, 7]]
