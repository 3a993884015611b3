import os
import tempfile
from typing import Any

# Every Ray cluster a test starts stays on loopback: Ray reads this single-machine switch when first
# imported, which test modules do at collection (diffrl.workers.ensure_ray sets it for `diffrl train`).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Records of passed start-up checks (diffrl.controller.check_cache) never come from outside the
# session; `_fresh_check_records` gives each test function its own folder on top.
os.environ["DIFFRL_CHECK_CACHE"] = tempfile.mkdtemp(prefix="diffrl_check_records_")


def _pin_xdist_worker() -> None:
    """Under pytest-xdist (`pytest -n N`), give worker i its own share of the cores (i, i+N, ...),
    before torch loads. Many tests wait on process starts (Ray actors, spawned ranks), which another
    worker's tests fill; but two workers on the same cores would each run their compute threads
    on all of them and slow each other down. diffrl plans its threads from the affinity
    (diffrl.workers.threads.available_cores), and the processes a test starts inherit it."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    index, count = int(worker.removeprefix("gw")), int(count)
    if len(cores) >= count:
        os.sched_setaffinity(0, cores[index::count])


_pin_xdist_worker()

import pytest  # noqa: E402  (after the pinning: torch sizes its thread pool on load)
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Skip `gpu`-marked tests on machines without CUDA (run them with `pytest -m gpu` on a GPU)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_xdist_make_scheduler(config, log):
    """`--dist worksteal` that keeps a test module on one worker where it can (see
    WorkStealKeepingModules); other --dist modes are xdist's own."""
    if config.getvalue("dist") != "worksteal":
        return None
    return _work_steal_keeping_modules()(config, log)


def _work_steal_keeping_modules():
    from xdist.scheduler import WorkStealingScheduling

    class WorkStealKeepingModules(WorkStealingScheduling):
        """xdist's work stealing, with every chunk of tests it sends or steals made of whole test
        modules where it can be. Plain worksteal cuts the collection anywhere: a module's tests then
        run on both workers, or on one worker with another module's tests between them, and each
        part builds the module's fixtures again (a module-scoped run of separate pools is 30-60 s
        on 2 cores, and the fault-injection module's zygote imports diffrl). A steal that would
        have to cut the module its victim is already in takes the tests as plain worksteal does,
        so no worker idles while another has tests queued."""

        def _module(self, index: int) -> str:
            return self.collection[index].split("::", 1)[0]

        def _send_tests(self, node, num: int) -> None:
            # the first chunk of the start (or a later one) ends where a module ends
            while 0 < num < len(self.pending) and self._module(self.pending[num - 1]) == self._module(
                self.pending[num]
            ):
                num += 1
            super()._send_tests(node, num)

        def add_node(self, node) -> None:
            super().add_node(node)
            send_steal = node.send_steal

            def whole_modules(indices):
                send_steal(self._steal_whole_modules(self.node2pending[node], list(indices)))

            node.send_steal = whole_modules

        def _steal_whole_modules(self, pending: list[int], indices: list[int]) -> list[int]:
            """The tail of `pending` to steal instead of `indices` (a tail of it): from the first
            module start inside it on; else from the start of the module it lies in, if the victim
            has not begun that module (its first pending test, the one running, is before it)."""
            start = len(pending) - len(indices)
            if start <= 0 or pending[start:] != indices:
                return indices
            for at in range(start, len(pending)):
                if self._module(pending[at - 1]) != self._module(pending[at]):
                    return pending[at:]
            at = start
            while at > 1 and self._module(pending[at - 1]) == self._module(pending[start]):
                at -= 1
            return pending[at:] if self._module(pending[at - 1]) != self._module(pending[at]) else indices

    return WorkStealKeepingModules


@pytest.fixture(autouse=True)
def _fresh_check_records(tmp_path_factory, monkeypatch):
    """Each test starts with no record of a passed start-up check (diffrl.controller.check_cache):
    one test's pass must not skip another's check; `diffrl train` subprocesses inherit it."""
    monkeypatch.setenv("DIFFRL_CHECK_CACHE", str(tmp_path_factory.mktemp("check_records")))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """`tiny_model(family)` -> the directory of a tiny random pipeline, built once per session."""
    from diffrl.models.tiny import build_tiny

    built = {}

    def get(family: str):
        if family not in built:
            built[family] = build_tiny(family, tmp_path_factory.mktemp(f"tiny_{family}"), seed=0)
        return built[family]

    return get


# ------------------------------------------------------------------ one Ray cluster for many runs
# Starting a local Ray cluster costs 4-16 s on a 2-core host (GCS, raylet, agents, monitors: seven
# processes), and each of the tests' `diffrl train` runs on Ray would start and stop its own. The
# tests that ask for `shared_ray` (also through a module-scoped fixture) share one, kept up across
# consecutive such tests; before any other test it is stopped, so that test finds no Ray running
# (tests/workers/test_group.py checks that) and may start a cluster of its own.
_SHARED_RAY: dict = {}


def _start_shared_ray() -> None:
    import ray

    from diffrl.workers.ray_group import ensure_ray

    assert not ray.is_initialized(), "Ray is running but not as the shared cluster: a test left it up"
    env = {
        # Ray's worker processes inherit the environment the cluster starts with
        "DIFFRL_CACHE": str(_SHARED_RAY["cache"]),
        "OMP_NUM_THREADS": "1",
        # no idle workers prestarted: every diffrl actor has a runtime env of its own (RANK, ...) and
        # never takes one, and on 2 cores their start slows the actors that are needed
        "RAY_prestart_worker_first_driver": "0",
    }
    with pytest.MonkeyPatch.context() as start_env:
        for key, value in env.items():
            start_env.setenv(key, value)
        # CPUs are Ray's bookkeeping: enough for the largest run of the suite (3 model workers,
        # reward workers, the driver), as ensure_ray's own num_cpus would be for that run
        ensure_ray(None, num_cpus=8)
    _SHARED_RAY["up"] = True


def _stop_shared_ray() -> None:
    if _SHARED_RAY.pop("up", False):
        import ray

        ray.shutdown()


def _all_cpus_free(wait_s: float = 5.0) -> bool:
    import time

    import ray

    deadline = time.monotonic() + wait_s  # a removed placement group frees its CPUs a moment later
    while ray.available_resources().get("CPU", 0.0) < ray.cluster_resources().get("CPU", 0.0):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture(scope="session")
def shared_ray(tmp_path_factory):
    """A local Ray cluster (diffrl's `ensure_ray`: loopback only) that `diffrl.controller.run.train`
    joins and leaves running (ensure_ray returns False when Ray is up), instead of one per run.

    Its actors resolve `tiny:<family>` in the cluster's DIFFRL_CACHE, the folder this yields: a test
    sets its own DIFFRL_CACHE to it, so that its driver builds and reads the same tiny models. The
    actors' thread counts come from diffrl (thread_env), not from the cluster's environment."""
    _SHARED_RAY["cache"] = tmp_path_factory.mktemp("shared_ray_cache")
    _start_shared_ray()
    return _SHARED_RAY["cache"]


def _uses_shared_ray(item) -> bool:
    return "shared_ray" in getattr(item, "fixturenames", ())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture of the test: stop the shared cluster unless the test uses it (a module
    fixture may start a cluster of its own), or start it again if an earlier test stopped it."""
    if not _uses_shared_ray(item):
        _stop_shared_ray()
    elif "cache" in _SHARED_RAY and not _SHARED_RAY.get("up"):
        _start_shared_ray()


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    # A run that failed may have left actors or placement groups holding CPUs: start afresh then.
    if _uses_shared_ray(item) and _SHARED_RAY.get("up") and not _all_cpus_free():
        _stop_shared_ray()


def pytest_sessionfinish(session, exitstatus):
    _stop_shared_ray()


# ------------------------------------------------------------- reliability cases that need a condition
# A reliability case (tests/controller/test_hostile_inputs.py: an unwritable output place, a full
# disk) needs a condition the machine may refuse (a tmpfs needs mount rights); it then skips, or
# fails under CI=true. Each records what it needs in its report's user_properties (which reach
# pytest-xdist's controller too), so that the summary says how many ran, how many skipped, and why.
_CONDITION = "reliability_condition"


def _reliability_outcomes(stats) -> dict[str, tuple[str, Any]]:
    """nodeid -> (outcome, the report that decided it) of every case that recorded a condition:
    a skip or a failure in any phase decides, a passed teardown does not undo it."""
    outcomes: dict[str, tuple[str, Any]] = {}
    for key in ("passed", "failed", "skipped", "error"):
        for report in stats.get(key, []):
            if not any(name == _CONDITION for name, _ in getattr(report, "user_properties", ())):
                continue
            before = outcomes.get(report.nodeid)
            if before is None or before[0] == "passed":
                outcomes[report.nodeid] = (report.outcome, report)
    return outcomes


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    text = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    outcomes = _reliability_outcomes(terminalreporter.stats)
    if not outcomes:
        return
    counts = {}
    for outcome, _ in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    if "skipped" not in counts:
        counts["skipped"] = 0
    said = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
    terminalreporter.write_sep("-", f"reliability cases that need a condition: {said}")
    skipped = [report for outcome, report in outcomes.values() if outcome == "skipped"]
    reasons = [_skip_reason(report) for report in skipped]
    for reason in sorted(set(reasons)):
        terminalreporter.write_line(f"{reasons.count(reason)} skipped: {reason}")
    if skipped:
        # on the last line as well: "N passed, M skipped, K reliability cases skipped (why: above)"
        terminalreporter.stats.setdefault("reliability cases skipped (why: above)", []).extend(skipped)
