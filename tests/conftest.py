import os

# Every Ray cluster a test starts stays on loopback: Ray reads this single-machine switch when first
# imported, which test modules do at collection (diffrl.workers.ensure_ray sets it for `diffrl train`).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


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
