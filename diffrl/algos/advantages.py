"""Advantage estimators: per-sample outcome rewards -> per-sample advantages, grouped by prompt.

Every sample carries a group id (`uid`): the samples drawn for the same prompt share one. The
advantage of a sample is its reward relative to its group; it is computed once per training step
on the driver and broadcast over the window steps by the trainer (clipping to ±adv_clip_max
happens inside the loss, not here).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from diffrl.algos.registry import register_advantage
from diffrl.lazy import lazy_import

if TYPE_CHECKING:
    from diffrl.config.schema import AlgorithmConfig

torch = lazy_import("torch")  # deferred: see diffrl.lazy

STD_EPS = 1e-4
"""Added to the std before dividing (Flow-GRPO and VeRL-Omni use 1e-4)."""


def group_index(uids: Sequence[Hashable] | np.ndarray | torch.Tensor, batch_size: int) -> torch.Tensor:
    """Dense group ids: (B,) int64 in [0, G), numbered in order of first appearance.

    `uids` is one hashable id per sample (str, int, ...), a numpy array or a 1-D tensor. Two
    samples are in the same group iff their uids compare equal (so 1 and "1" are different).
    """
    if isinstance(uids, torch.Tensor):
        if uids.ndim != 1:
            raise ValueError(f"uids must be 1-D (one id per sample), got shape {tuple(uids.shape)}")
        uids = uids.tolist()
    elif isinstance(uids, np.ndarray):
        if uids.ndim != 1:
            raise ValueError(f"uids must be 1-D (one id per sample), got shape {uids.shape}")
        uids = uids.tolist()
    elif isinstance(uids, str | bytes):
        raise ValueError(f"uids must be a sequence with one id per sample, got the string {uids!r}")
    if len(uids) != batch_size:
        raise ValueError(f"got {len(uids)} uids for {batch_size} rewards; need exactly one uid per sample")
    first_seen: dict[Hashable, int] = {}
    try:
        ids = [first_seen.setdefault(uid, len(first_seen)) for uid in uids]
    except TypeError as err:
        raise ValueError(f"uids must be hashable (str or int), got {type(uids[0]).__name__}: {err}") from err
    return torch.tensor(ids, dtype=torch.int64)


def group_mean_std(values_B: torch.Tensor, group_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group mean and population std (ddof=0) of `values_B`, each of shape (G,).

    `group_B` are dense ids from `group_index`. A one-sample group has std 0.
    """
    num_groups = int(group_B.max()) + 1
    count_G = torch.bincount(group_B, minlength=num_groups).to(values_B.dtype)
    mean_G = torch.zeros(num_groups, dtype=values_B.dtype).index_add_(0, group_B, values_B) / count_G
    centered_B = values_B - mean_G[group_B]
    var_G = torch.zeros(num_groups, dtype=values_B.dtype).index_add_(0, group_B, centered_B**2) / count_G
    return mean_G, var_G.sqrt()


def _check_rewards(rewards_B: torch.Tensor) -> None:
    if not isinstance(rewards_B, torch.Tensor) or rewards_B.ndim != 1 or rewards_B.numel() == 0:
        shape = tuple(rewards_B.shape) if isinstance(rewards_B, torch.Tensor) else type(rewards_B).__name__
        raise ValueError(f"rewards_B must be a non-empty 1-D tensor (one reward per sample), got {shape}")
    bad = (~torch.isfinite(rewards_B)).nonzero().flatten()
    if bad.numel():
        raise ValueError(
            f"rewards_B has non-finite values at samples {bad.tolist()[:10]} "
            f"(e.g. {rewards_B[bad[0]].item()}); fix the reward function instead of training on them"
        )


@register_advantage("flow_grpo")
def compute_flow_grpo_advantages(
    rewards_B: torch.Tensor,
    uids: Sequence[Hashable] | np.ndarray | torch.Tensor,
    cfg: AlgorithmConfig,
) -> torch.Tensor:
    """Group-relative outcome advantages (Flow-GRPO; Dr.GRPO when not normalised).

        A_i = (r_i − mean_g(r)) / (std + 1e-4)     cfg.norm_adv_by_std = True (default)
        A_i =  r_i − mean_g(r)                     cfg.norm_adv_by_std = False (Dr.GRPO)

    mean_g is the mean reward of sample i's group g. std is the std of all B rewards of the batch
    when cfg.global_std (default), else the std of group g.

    std convention: population std (ddof=0, divide by n), as the Flow-GRPO reference does
    (`np.std` in its PerPromptStatTracker). VeRL-Omni uses `torch.std` (ddof=1, divide by n−1);
    for a group of 24 the two differ by ~2%. ddof=0 is defined for every group size: a one-sample
    group gets A = 0 (its reward is its own mean) in every mode, never NaN.

    Args:
        rewards_B: (B,) outcome reward per sample (any float dtype; computed in float64).
        uids: (B,) group id per sample (prompt uid), str or int; see `group_index`.
        cfg: `AlgorithmConfig`; reads `norm_adv_by_std` and `global_std`.

    Returns:
        adv_B: (B,) advantages on the device of `rewards_B`, in its dtype (float32 for integer
            rewards), no grad.
    """
    _check_rewards(rewards_B)
    group_B = group_index(uids, rewards_B.shape[0])
    rewards64_B = rewards_B.detach().to("cpu", torch.float64)
    mean_G, std_G = group_mean_std(rewards64_B, group_B)
    adv_B = rewards64_B - mean_G[group_B]
    if cfg.norm_adv_by_std:
        std = rewards64_B.std(correction=0) if cfg.global_std else std_G[group_B]
        adv_B = adv_B / (std + STD_EPS)
    out_dtype = rewards_B.dtype if rewards_B.is_floating_point() else torch.float32
    return adv_B.to(device=rewards_B.device, dtype=out_dtype)
