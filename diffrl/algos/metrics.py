"""Batch statistics of rewards and advantages, logged once per training step.

Naming scheme (the one every part of diffrl logs with): `<group>/<stat>`, lower_snake_case,
slash-separated, values plain Python floats.

- `rewards/mean|max|min|zero_std_ratio|std_mean|group_size` from `reward_metrics` (the combined
  reward); per-reward values use the same function with `prefix="rewards/<reward name>"`.
- `advantages/mean|max|min` from `advantage_metrics`.
- Loss metrics are returned bare by the losses (`policy_loss`, `ppo_kl`, `clipfrac`,
  `clipfrac_higher`, `clipfrac_lower`, `ratio_mean`, `ratio_std`, `kl`) and logged by the
  training engine as `actor/<name>`.

These are the names VeRL-Omni users know, without its `critic/` prefix.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from diffrl.algos.advantages import group_index, group_mean_std
from diffrl.lazy import lazy_import

torch = lazy_import("torch")  # deferred: see diffrl.lazy


def reward_metrics(
    rewards_B: torch.Tensor,
    uids: Sequence[Hashable] | np.ndarray | torch.Tensor,
    prefix: str = "rewards",
) -> dict[str, float]:
    """Statistics of the (B,) per-sample rewards of one step, grouped by prompt uid.

    Returns `{prefix}/...`:
        mean, max, min    over the B samples
        zero_std_ratio    fraction of groups whose rewards are all exactly equal (these groups
                          get zero advantage and teach nothing)
        std_mean          mean over groups of the group's population std (ddof=0)
        group_size        B / number of groups
    """
    if not isinstance(rewards_B, torch.Tensor) or rewards_B.ndim != 1 or rewards_B.numel() == 0:
        raise ValueError(f"rewards_B must be a non-empty 1-D tensor, got {rewards_B!r:.80}")
    group_B = group_index(uids, rewards_B.shape[0])
    rewards64_B = rewards_B.detach().to("cpu", torch.float64)
    num_groups = int(group_B.max()) + 1
    _, std_G = group_mean_std(rewards64_B, group_B)
    # Ties by exact comparison (max == min), not std == 0, which rounding can miss.
    max_G = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(
        0, group_B, rewards64_B, reduce="amax"
    )
    min_G = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce(
        0, group_B, rewards64_B, reduce="amin"
    )
    return {
        f"{prefix}/mean": rewards64_B.mean().item(),
        f"{prefix}/max": rewards64_B.max().item(),
        f"{prefix}/min": rewards64_B.min().item(),
        f"{prefix}/zero_std_ratio": (max_G == min_G).double().mean().item(),
        f"{prefix}/std_mean": std_G.mean().item(),
        f"{prefix}/group_size": rewards64_B.shape[0] / num_groups,
    }


def advantage_metrics(adv: torch.Tensor, prefix: str = "advantages") -> dict[str, float]:
    """mean / max / min of the advantages over all elements (per sample, or per sample and step)."""
    if not isinstance(adv, torch.Tensor) or adv.numel() == 0:
        raise ValueError(f"advantages must be a non-empty tensor, got {adv!r:.80}")
    adv64 = adv.detach().to("cpu", torch.float64).flatten()
    return {
        f"{prefix}/mean": adv64.mean().item(),
        f"{prefix}/max": adv64.max().item(),
        f"{prefix}/min": adv64.min().item(),
    }
