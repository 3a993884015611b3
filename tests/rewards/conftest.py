"""Shared fixtures of the reward tests: a tiny random CLIP directory (built once per session)."""

from pathlib import Path

import pytest

from diffrl.rewards.tiny import save_tiny_aesthetic_head, save_tiny_clip


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory) -> Path:
    """A random CLIP (16-d embeddings) + processor + LAION-layout aesthetic head, saved to disk."""
    directory = save_tiny_clip(tmp_path_factory.mktemp("tiny_clip"), seed=0, projection_dim=16)
    save_tiny_aesthetic_head(directory, embed_dim=16, seed=1)
    return directory
