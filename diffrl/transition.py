"""The transition shared by the sampler and the trainer: the `Rollout` batch and step re-evaluation.

The sampler (`diffrl.rollout`) produces a `Rollout`: per-sample SDE-window trajectories with their
log-probs, plus what they are conditioned on. The trainer (`diffrl.train`) re-evaluates its window
steps with the current weights through `evaluate_step`: the same adapter call and the same
`diffrl.sde.step` the sampler used, so with unchanged weights it reproduces the sampled log-probs
exactly. Both import this module; neither imports the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from tensordict import tensorclass

from diffrl import sde
from diffrl.models.base import ModelAdapter, PromptEmbeds


@dataclass(frozen=True)
class RolloutSettings:
    """How a rollout was sampled; the trainer re-evaluates its steps with exactly these settings."""

    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    true_cfg_scale: float | None
    sde_type: str  # the kind of the window steps ("ode" for a validation rollout)
    noise_level: float
    sigma_1: float  # the schedule's second sigma (the `sde` kind needs it at σ = 1)
    seed: int
    step: int


@tensorclass
class Trajectories:
    """Per-sample tensors; the batch dimension is the sample (B = prompts × samples per prompt).

    W is the SDE window size (0 for an all-ODE validation rollout); `...` is one sample's latent
    shape in the adapter's layout.
    """

    window_latents: torch.Tensor  # fp32 [B, W+1, ...]: x_{k0}, ..., x_{k0+W}
    log_probs_BW: torch.Tensor  # fp32 [B, W]: log p(x_{k+1} | x_k) averaged over latent elements
    means: torch.Tensor  # fp32 [B, W, ...]: the SDE means μ_k
    stds_BW: torch.Tensor  # fp32 [B, W]: transition stds
    final_latents: torch.Tensor  # fp32 [B, ...]: x at σ = 0 (the clean sample)
    pixels: torch.Tensor  # uint8 [B, 3, H, W] or [B, T, 3, H, W]
    prompt_index_B: torch.Tensor  # long [B]: row of the sample's prompt in Rollout.prompt_embeds
    sample_index_B: torch.Tensor  # long [B]: index of the sample within its step (its seed key)


class PerSample:
    """Per-sample views of the per-prompt lists (`prompts`, `uids`, `metadata`), through each
    sample's prompt row."""

    prompts: list[str]
    uids: list[str]
    metadata: list[dict[str, Any]]

    def _prompt_index(self) -> torch.Tensor:
        raise NotImplementedError

    def sample_uids(self) -> list[str]:
        """The prompt uid of every sample, for grouping advantages."""
        return [self.uids[i] for i in self._prompt_index().tolist()]

    def sample_prompts(self) -> list[str]:
        return [self.prompts[i] for i in self._prompt_index().tolist()]

    def sample_metadata(self) -> list[dict[str, Any]]:
        return [self.metadata[i] for i in self._prompt_index().tolist()]


@dataclass
class Rollout(PerSample):
    """Trajectories of one step plus what they are conditioned on.

    Prompt-level data (embeddings, texts, uids, metadata) is stored once per unique prompt (P rows)
    and referenced by `samples.prompt_index_B`; `select` slices samples and shares the prompt table.
    The window is the same for every sample: `step_indices` [W], `sigmas` [W+1], `timesteps` [W].
    """

    samples: Trajectories
    prompt_embeds: PromptEmbeds  # [P]
    prompts: list[str]  # [P]
    uids: list[str]  # [P]
    metadata: list[dict[str, Any]]  # [P]
    step_indices: torch.Tensor  # long [W]: denoising step k of each window step
    sigmas: torch.Tensor  # fp32 [W+1]: σ_{k0}, ..., σ_{k0+W}
    timesteps: torch.Tensor  # fp32 [W]: the model timesteps of the window steps
    settings: RolloutSettings
    extras: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.samples.batch_size[0]

    @property
    def window_size(self) -> int:
        return int(self.step_indices.numel())

    def select(self, index: torch.Tensor | slice | list[int]) -> Rollout:
        """The rollout restricted to some samples (a micro-batch), sharing the prompt table."""
        if isinstance(index, list):
            index = torch.tensor(index, dtype=torch.long)
        return replace(self, samples=self.samples[index])

    def to(self, device: torch.device | str) -> Rollout:
        """The rollout with every tensor on `device` (a no-op for tensors already there)."""
        return replace(self.to_samples_device(device), prompt_embeds=self.prompt_embeds.to(device))

    def to_samples_device(self, device: torch.device | str) -> Rollout:
        """Everything but the prompt table on `device` (callers moving many micro-batches that share
        one table move it once)."""
        return replace(
            self,
            samples=self.samples.to(device),
            sigmas=self.sigmas.to(device),
            timesteps=self.timesteps.to(device),
        )

    def compact(self) -> Rollout:
        """A copy whose sample tensors own exactly their rows.

        `select` returns views; pickling a view (Ray sends arguments pickled) writes its whole
        underlying buffer, so a micro-batch sent as a view would carry the entire step's rollout.
        """
        return replace(self, samples=self.samples.clone())

    def _prompt_index(self) -> torch.Tensor:
        return self.samples.prompt_index_B

    def summary(self) -> RolloutSummary:
        """What the controller needs of this rollout when its tensors go to the trainer ranks."""
        return RolloutSummary(
            prompts=list(self.prompts),
            uids=list(self.uids),
            metadata=list(self.metadata),
            prompt_index_B=self.samples.prompt_index_B.cpu(),
            sample_index_B=self.samples.sample_index_B.cpu(),
            log_probs_BW=self.samples.log_probs_BW.cpu(),
            window_size=self.window_size,
            extras=dict(self.extras),
        )

    def sample_cond(self) -> PromptEmbeds:
        """One row of prompt embeddings per sample."""
        return self.prompt_embeds[self.samples.prompt_index_B.to(self.prompt_embeds.embeds.device)]


@dataclass
class RolloutSummary(PerSample):
    """A rollout without its latents, means, pixels or prompt embeddings: what the controller
    handles (uids for advantages, sample indices for per-sample draws, the sampled log-probs for
    the mismatch diagnostics, reward handles and weight versions in `extras`) while the tensors
    travel from the sampler to the trainer ranks (diffrl.controller.placement.StagedRollout)."""

    prompts: list[str]  # [P]
    uids: list[str]  # [P]
    metadata: list[dict[str, Any]]  # [P]
    prompt_index_B: torch.Tensor  # long [B]
    sample_index_B: torch.Tensor  # long [B]
    log_probs_BW: torch.Tensor  # fp32 [B, W]
    window_size: int
    extras: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.prompt_index_B.numel())

    def _prompt_index(self) -> torch.Tensor:
        return self.prompt_index_B


def concat_rollouts(rollouts: Sequence[Rollout]) -> Rollout:
    """Join workers' rollouts of the same step: samples, prompt tables (re-indexed), reward handles,
    and each sample's weight version (`extras["weight_version_B"]`, from each part's
    `extras["weight_version"]`)."""
    extras = _joined_extras(rollouts)
    if len(rollouts) == 1:
        return replace(rollouts[0], extras=extras)
    samples = []
    for r, offset in zip(rollouts, _prompt_offsets(rollouts), strict=True):
        s = r.samples.clone()
        s.prompt_index_B = s.prompt_index_B + offset
        samples.append(s)
    return replace(
        rollouts[0],
        samples=torch.cat(samples),
        prompt_embeds=PromptEmbeds.cat_padded([r.prompt_embeds for r in rollouts]),
        prompts=[p for r in rollouts for p in r.prompts],
        uids=[u for r in rollouts for u in r.uids],
        metadata=[m for r in rollouts for m in r.metadata],
        extras=extras,
    )


def concat_summaries(summaries: Sequence[RolloutSummary]) -> RolloutSummary:
    """`concat_rollouts` for the summaries the controller keeps: the same order and prompt rows."""
    offsets = _prompt_offsets(summaries)
    return RolloutSummary(
        prompts=[p for r in summaries for p in r.prompts],
        uids=[u for r in summaries for u in r.uids],
        metadata=[m for r in summaries for m in r.metadata],
        prompt_index_B=torch.cat([r.prompt_index_B + o for r, o in zip(summaries, offsets, strict=True)]),
        sample_index_B=torch.cat([r.sample_index_B for r in summaries]),
        log_probs_BW=torch.cat([r.log_probs_BW for r in summaries]),
        window_size=summaries[0].window_size,
        extras=_joined_extras(summaries),
    )


def _prompt_offsets(parts: Sequence[Rollout | RolloutSummary]) -> list[int]:
    offsets, total = [], 0
    for part in parts:
        offsets.append(total)
        total += len(part.prompts)
    return offsets


def _joined_extras(parts: Sequence[Rollout | RolloutSummary]) -> dict:
    """The parts' reward handles in order, and one weight version per sample."""
    return {
        "reward_handles": [h for part in parts for h in part.extras.get("reward_handles", [])],
        "weight_version_B": torch.cat(
            [torch.full((len(p),), int(p.extras.get("weight_version", 0)), dtype=torch.long) for p in parts]
        ),
    }


def replay_groups(steps: Sequence[int], steps_per_forward: int) -> list[list[int]]:
    """The window steps of a micro-batch that share one transformer forward, in order:
    consecutive runs of `steps_per_forward` (`actor.replay_steps_per_forward`; 1 = one forward per
    step). The update and every log-prob pass group the same way, so a recomputed old log-prob
    comes from a forward of the very shape the update's first forward has."""
    if steps_per_forward < 1:
        raise ValueError(f"steps_per_forward must be >= 1; got {steps_per_forward}")
    steps = list(steps)
    return [steps[i : i + steps_per_forward] for i in range(0, len(steps), steps_per_forward)]


def evaluate_window(
    adapter: ModelAdapter,
    rollout: Rollout,
    micro_batch_size: int,
    *,
    as_trained: bool = False,
    steps_per_forward: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_probs_BW, means [B, W, ...]) of every window step, micro-batch by micro-batch, detached.

    No grad by default. `as_trained` computes each step with grad on, as the update's forward
    does, and drops the autograd graph at once: compiled blocks run a different graph with grad
    (partitioned for the backward, fused and so rounded differently), so only this reproduces
    bit for bit what the trainer's first forward computes (and what a compiled sampler stores,
    `TrajectorySampler._trained_slices`). Eager kernels are the same either way.
    `steps_per_forward`: window steps per transformer forward (`replay_groups`, `evaluate_steps`),
    as the update groups them."""
    log_probs, means = [], []
    for start in range(0, len(rollout), micro_batch_size):
        mb = rollout.select(slice(start, start + micro_batch_size))
        steps = []
        for group in replay_groups(range(rollout.window_size), steps_per_forward):
            with torch.enable_grad() if as_trained else torch.no_grad():
                outs = evaluate_steps(adapter, [(mb, j) for j in group])
            steps += [(out.log_prob_B.detach(), out.mean.detach()) for out in outs]
            # Drop this forward's graph before the next forward builds its own: `outs` would
            # otherwise keep it alive through that forward, two graphs at the peak (with grad on
            # and k window steps a forward, twice the update's activations: out of memory on a GPU).
            del outs
        log_probs.append(torch.stack([lp for lp, _ in steps], dim=1))
        means.append(torch.stack([m for _, m in steps], dim=1))
    return torch.cat(log_probs), torch.cat(means)


def evaluate_step(adapter: ModelAdapter, rollout: Rollout, j: int) -> sde.StepOut:
    """Re-evaluate window step j of `rollout`'s samples with the adapter's current weights.

    Recomputes the velocity at the stored x_{k0+j} (CFG as sampled), then the SDE mean, std and the
    log-prob of the stored x_{k0+j+1}. Grad flows when enabled (the trainer's path); which LoRA
    adapters are active is the caller's context.
    """
    return evaluate_steps(adapter, [(rollout, j)])[0]


def _joined(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(tensors)`, without copying a single tensor."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def evaluate_steps(adapter: ModelAdapter, parts: Sequence[tuple[Rollout, int]]) -> list[sde.StepOut]:
    """`evaluate_step` of several (samples, window step j) parts through ONE transformer forward.

    The parts' stored latents, model timesteps and conditioning rows are concatenated into one
    batch of Σ B_i rows (batched replay: the S trained steps of a micro-batch as one forward of
    S·B rows), the velocity is split back per part, and each part's SDE step runs on its own rows
    with its own σ, σ' exactly as `evaluate_step` runs it. Every row's computation is the same
    math as in a forward of its part alone; only the float rounding of the larger matmuls may
    differ. The parts must come from one rollout (slices of it: the same prompt table and
    settings). One part is exactly `evaluate_step`.
    """
    if not parts:
        raise ValueError("evaluate_steps needs at least one (rollout, window step) part")
    first = parts[0][0]
    for rollout, j in parts:
        if not 0 <= j < rollout.window_size:
            raise IndexError(
                f"window step {j} out of range: the rollout has {rollout.window_size} window steps"
            )
        if rollout.prompt_embeds is not first.prompt_embeds or rollout.settings != first.settings:
            raise ValueError(
                "evaluate_steps joins parts of one rollout only (slices sharing its prompt table and "
                "settings): evaluate rollouts of different steps or samplers separately"
            )
    s = first.settings
    device = adapter.device
    latents = [rollout.samples.window_latents[:, j].to(device) for rollout, j in parts]
    table = first.prompt_embeds
    rows = _joined([rollout.samples.prompt_index_B for rollout, _ in parts]).to(table.embeds.device)
    v = adapter.velocity(
        _joined(latents),
        _joined([rollout.timesteps[j].to(device).expand(len(rollout)) for rollout, j in parts]),
        table[rows],  # each sample's conditioning row (`Rollout.sample_cond`)
        s.guidance_scale,
        height=s.height,
        width=s.width,
        num_frames=s.num_frames,
        true_cfg_scale=s.true_cfg_scale,
    )
    velocities = v.split([x_i.shape[0] for x_i in latents])
    return [
        sde.step(
            s.sde_type,
            x_i,
            v_i,
            rollout.sigmas[j].to(device),
            rollout.sigmas[j + 1].to(device),
            s.noise_level,
            sigma_1=s.sigma_1,
            next_latents=rollout.samples.window_latents[:, j + 1].to(device),
        )
        for (rollout, j), x_i, v_i in zip(parts, latents, velocities, strict=True)
    ]
