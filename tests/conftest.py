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
