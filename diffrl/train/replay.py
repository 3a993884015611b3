"""Replay of the trained window steps: which (samples, step) pairs each update forward evaluates,
and the policy loss of one re-evaluated step.

The policy-gradient update (`TrainEngine.forward_backward`) trains every micro-batch on its window
steps. Each (micro-batch, step) pair is a `StepPart`: the samples that train the step (all of them,
or DanceGRPO's per-sample subset) and its share of the optimizer step's mean loss. `replay_plan`
groups the parts into `ReplayForward`s, one transformer forward and one backward each:

    actor.replay_steps_per_forward = 1 (default)   S forwards of B rows per micro-batch
    actor.replay_steps_per_forward = k > 1         ⌈S/k⌉ forwards of up to k·B rows (batched replay)

A batched forward concatenates its parts' latents, timesteps and conditioning rows
(`diffrl.transition.evaluate_steps`), splits the velocity back per part, and each part's SDE step
and loss are computed on its own rows exactly as an unbatched forward's are (the losses' batch
statistics, e.g. GRPO-Guard's mean std, stay per step). Its loss is the share-weighted mean of its
parts' losses and its gradient scale their summed share, so the accumulated gradient is the same
Σ share · ∇loss up to float rounding. Fewer, larger forwards mean larger matmuls per kernel launch
and, under FSDP2, one all-gather per unit per forward instead of per step (docs/performance.md,
"Batched replay").

Log-prob passes group the same way (`transition.evaluate_window(steps_per_forward=...)`), so
recomputed old log-probs come from forwards of the update's own shapes: with unchanged weights the
ratio is exactly 1. The sampler's forwards have B rows, so a run with batched replay recomputes the
old log-probs instead of reusing the sampled ones (`Config.reuses_rollout_log_probs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diffrl.algos import LossInputs
from diffrl.train.batch import PolicyGradientBatch
from diffrl.transition import replay_groups


@dataclass(frozen=True)
class StepPart:
    """Window step `step` of the samples `batch` (a micro-batch, or the rows of it that train the
    step), with its share of the optimizer step's mean loss (its gradient is share · ∇loss)."""

    batch: PolicyGradientBatch
    step: int
    share: float


@dataclass(frozen=True)
class ReplayForward:
    """The parts one transformer forward evaluates (one micro-batch's steps), in order."""

    parts: tuple[StepPart, ...]

    @property
    def share(self) -> float:
        return sum(part.share for part in self.parts)


def replay_plan(
    micro_batches: Sequence[PolicyGradientBatch], steps: Sequence[int], steps_per_forward: int
) -> list[ReplayForward]:
    """The forwards of one mini-batch's update: per micro-batch, its trained `steps` in groups of
    `steps_per_forward` (`transition.replay_groups`, as the log-prob passes group them).

    Normalisation: each sample's terms are averaged over the steps it trains (K: all of `steps`,
    or the K that `targets.train_mask_BW` gives each sample), then over the samples, so a part's
    share is len(part) / (micro-batches × len(micro-batch) × K). Steps no sample of the
    micro-batch trains are left out, and so is a group with none left."""
    forwards = []
    for mb in micro_batches:
        mask = mb.targets.train_mask_BW
        mask = None if mask is None else mask.cpu()  # one device-to-host copy per micro-batch
        trained_per_sample = len(steps) if mask is None else int(mask[0, list(steps)].sum())
        norm = 1.0 / (len(micro_batches) * len(mb) * trained_per_sample)
        for group in replay_groups(steps, steps_per_forward):
            parts = []
            for j in group:
                rows = None if mask is None else torch.nonzero(mask[:, j]).flatten()
                if rows is not None and not len(rows):
                    continue
                part = mb if rows is None else mb.select(rows)
                parts.append(StepPart(part, j, len(part) * norm))
            if parts:
                forwards.append(ReplayForward(tuple(parts)))
    return forwards


def loss_inputs(
    mb: PolicyGradientBatch, j: int, device: torch.device, *, old_mean: bool, ref_mean: bool
) -> LossInputs:
    """`LossInputs` of window step j of `mb`: its advantages, old log-probs (the recomputed ones,
    else the rollout's), old SDE means when the loss needs them (likewise), reference means when
    KL is on, and rollout-correction weights."""
    targets, samples = mb.targets, mb.rollout.samples
    old_log_probs = targets.old_log_probs_BW if targets.old_log_probs_BW is not None else samples.log_probs_BW
    old_means = targets.old_means if targets.old_means is not None else samples.means
    return LossInputs(
        advantages_B=targets.advantages_B.to(device),
        old_log_prob_B=old_log_probs[:, j].to(device),
        old_mean=old_means[:, j].to(device) if old_mean else None,
        ref_mean=targets.ref_means[:, j].to(device) if ref_mean else None,
        weights_B=targets.weights_BW[:, j].to(device) if targets.weights_BW is not None else None,
    )


def weighted_mean(
    results: Sequence[tuple[torch.Tensor, dict[str, float]]], shares: Sequence[float]
) -> tuple[torch.Tensor, dict[str, float]]:
    """(Σ wᵢ·lossᵢ, Σ wᵢ·metricsᵢ) with wᵢ = shareᵢ / Σ share: one forward's loss over its parts,
    back-propagated at grad_scale Σ share. One part is returned as it is."""
    if len(results) == 1:
        return results[0]
    total = sum(shares)
    weights = [share / total for share in shares]
    loss = sum(w * part_loss for w, (part_loss, _) in zip(weights, results, strict=True))
    metrics: dict[str, float] = {}
    for w, (_, part_metrics) in zip(weights, results, strict=True):
        for key, value in part_metrics.items():
            metrics[key] = metrics.get(key, 0.0) + w * value
    return loss, metrics
