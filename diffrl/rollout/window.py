"""Where the SDE window sits in a trajectory (Flow-GRPO-Fast, MixGRPO).

Only W consecutive steps [k0, k0 + W) inside `window_range = [lo, hi)` take SDE steps; the rest are
ODE. k0 is chosen once per training step and shared by every sample of the step, so all samples
of a prompt group are comparable (per-sample windows inflate the reward spread and collapse
training).
"""

from __future__ import annotations

from diffrl.seeding import WINDOW_STREAM, numpy_rng


def window_start(
    strategy: str, lo: int, hi: int, size: int, *, seed: int, step: int, iters_per_group: int = 1
) -> int:
    """k0 for training step `step`.

    random:       k0 ~ U{lo, ..., hi − W}, from a generator seeded by (seed, step)
    progressive:  k0 = min(lo + ⌊step / iters_per_group⌋ · W, hi − W)   (MixGRPO's sliding window)
    """
    if not 0 <= lo < hi or not 1 <= size <= hi - lo:
        raise ValueError(f"window of size {size} does not fit the range [{lo}, {hi})")
    if strategy == "random":
        return int(numpy_rng(WINDOW_STREAM, seed, step).integers(lo, hi - size + 1))
    if strategy == "progressive":
        return min(lo + (step // iters_per_group) * size, hi - size)
    raise ValueError(f"unknown window strategy {strategy!r}; choose random or progressive")
