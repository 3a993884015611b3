"""Seeds derived from (seed, step, sample, ...): every random draw in diffrl comes from here.

A sample's noise depends only on its own keys, never on the batch it was drawn in or on how many
draws happened before it, so runs are reproducible across micro-batch sizes and worker counts.
numpy's SeedSequence does the mixing (it is built for exactly this: independent streams from tuples
of integers).
"""

from __future__ import annotations

import numpy as np
import torch

# Stream tags, so two purposes sharing (seed, step) never share a stream.
NOISE_STREAM = 0
WINDOW_STREAM = 1
DATA_STREAM = 2
LORA_INIT_STREAM = 3


def derive_seed(*keys: int) -> int:
    """A 63-bit seed that depends on every key (non-negative ints)."""
    if any(k < 0 for k in keys):
        raise ValueError(f"seed keys must be non-negative integers, got {keys}")
    return int(np.random.SeedSequence(list(keys)).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def generator(device: torch.device | str, *keys: int) -> torch.Generator:
    """A torch generator on `device` seeded from `keys`."""
    return torch.Generator(device=device).manual_seed(derive_seed(*keys))


def numpy_rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng(derive_seed(*keys))
