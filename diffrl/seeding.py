"""Seeds derived from (seed, step, sample, ...): every random draw in diffrl comes from here.

A sample's noise depends only on its own keys, never on the batch it was drawn in or on how many
draws happened before it, so runs are reproducible across micro-batch sizes and worker counts.
numpy's SeedSequence does the mixing (it is built for exactly this: independent streams from tuples
of integers).
"""

from __future__ import annotations

import numpy as np

from diffrl.lazy import lazy_import

torch = lazy_import("torch")  # deferred: see diffrl.lazy

# Stream tags, always the FIRST key: (stream, seed, ...). Two purposes can then never share a
# stream, whatever their other keys are.
NOISE_STREAM = 0  # (NOISE_STREAM, seed, step, sample): initial and SDE noise of one sample
WINDOW_STREAM = 1  # (WINDOW_STREAM, seed, step): the SDE window start
DATA_STREAM = 2  # (DATA_STREAM, seed, epoch): the prompt order of an epoch
LORA_INIT_STREAM = 3  # (LORA_INIT_STREAM, seed, adapter index): LoRA initialisation
SHUFFLE_STREAM = 4  # (SHUFFLE_STREAM, seed, step, epoch): mini-batch order
SFT_STREAM = (
    5  # (SFT_STREAM, seed, step, sample): noise level, noise, prompt dropout and rendering of one SFT sample
)
GROUP_NOISE_STREAM = 10  # (GROUP_NOISE_STREAM, seed, step, group): a prompt group's shared initial noise
TIMESTEP_SUBSET_STREAM = 11  # (TIMESTEP_SUBSET_STREAM, seed, step, sample): the window steps a sample trains
# (PREFERENCE_STREAM, seed, step, epoch, sample or pair): the noise levels and fresh noise of one
# clean sample (NFT, AWM) or preference pair (DPO) in the direct-preference trainer
PREFERENCE_STREAM = 12
# (EDIT_STREAM, seed, 0, kind) picks the edits of a shapes-edit prompt file; (EDIT_STREAM, seed, 1,
# row) draws the layout of its row (diffrl.toy.edit)
EDIT_STREAM = 13
# (DISTILL_STREAM, seed, step, phase, sample): a distillation sample's initial noise, student step,
# re-noising level and noise; phase 0 is the student's update, k >= 1 the k-th fake-score update
DISTILL_STREAM = 14


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
