import os

# Every Ray cluster a test starts stays on loopback: Ray reads this single-machine switch when first
# imported, which test modules do at collection (diffrl.workers.ensure_ray sets it for `diffrl train`).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest
import torch


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
