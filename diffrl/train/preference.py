"""The direct-preference trainer's backward passes: forward-process losses on clean samples.

DiffusionNFT (`diffusion_nft`), AWM (`awm`) and Diffusion-DPO (`dpo`) do not score SDE transitions:
they noise clean samples x₀ afresh, x_t = (1 − t)·x₀ + t·ε (`diffrl.algos.flow_matching.interpolate`),
and compare the network's velocity at (x_t, t) with the old policy's, the reference's or the
flow-matching target ε − x₀. These functions run one worker's share of one optimizer step on a
`TrainEngine` (its adapter, its policies), as gradient terms that the engine's `accumulate`
backpropagates (normalisation and gradient sync live there); `optim_step` then applies them.

    forward_process_backward   NFT / AWM: micro-batches of clean samples (`CleanBatch`), each sample
                               at K noise levels of the rollout's schedule (a random
                               `timestep_fraction` of them, its own per sample), fresh noise per
                               (sample, level); gradient = mean over samples and levels
    dpo_backward               DPO: micro-batches of preference pairs (`PairBatch`), one logit-normal
                               t and one ε per pair shared by its two samples; gradient = the mean
                               over the optimizer step's pairs (each micro-batch carries its weight)

Every random draw comes from a generator keyed (PREFERENCE_STREAM, seed, step, epoch, sample or
pair), so the noise of a sample does not depend on the micro-batch or worker it lands in. The
policies are evaluated without grad first (old adapter, reference) and the trained one last:
switching peft adapters changes which tensors require grad, which must not happen while the
trained velocity's graph is alive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

import torch

from diffrl.algos import PAIRS, SAMPLES, DirectPreferenceSpec, algorithm
from diffrl.algos.dpo import sample_logit_normal_sigmas
from diffrl.algos.nft import timestep_subset
from diffrl.models.base import PromptEmbeds
from diffrl.seeding import PREFERENCE_STREAM, generator
from diffrl.train.engine import NUM_TRAIN_TIMESTEPS, OLD, POLICY, REFERENCE, GradientTerm, TrainEngine

WEIGHT_KEY = "samples"  # the number of samples (NFT, AWM) or pairs (DPO) a worker's metrics average


@dataclass(frozen=True)
class VelocityCall:
    """How the network is called: the rollout's image size and guidance (CFG as when sampling)."""

    height: int
    width: int
    num_frames: int = 1
    guidance_scale: float = 1.0
    true_cfg_scale: float | None = None


@dataclass
class CleanBatch:
    """A micro-batch of B clean samples for NFT or AWM.

    latents:        fp32 [B, ...] the clean final latents x₀ of the rollout
    cond:           [B] one conditioning row per sample (negatives included when sampling used CFG)
    advantages_B:   fp32 (B,) each sample's advantage
    sample_index_B: long (B,) the sample's index within its training step (keys its noise)
    """

    latents: torch.Tensor
    cond: PromptEmbeds
    advantages_B: torch.Tensor
    sample_index_B: torch.Tensor

    def __len__(self) -> int:
        return self.latents.shape[0]

    def to(self, device: torch.device | str) -> CleanBatch:
        return replace(self, latents=self.latents.to(device), cond=self.cond.to(device))


@dataclass
class PairBatch:
    """A micro-batch of P preference pairs for DPO.

    chosen_latents / rejected_latents: fp32 [P, ...] clean latents of the preferred / dispreferred sample
    cond:         [P] the pair's prompt, without negatives (DPO compares conditional velocities)
    pair_index_P: long (P,) the pair's key within its training step (keys its noise level and noise)
    weight:       this micro-batch's share of the optimizer step's mean loss, times the number of
                  workers (FSDP averages gradients over them); 0 for padding that only keeps every
                  worker running the same number of forwards
    """

    chosen_latents: torch.Tensor
    rejected_latents: torch.Tensor
    cond: PromptEmbeds
    pair_index_P: torch.Tensor
    weight: float

    def __len__(self) -> int:
        return self.chosen_latents.shape[0]

    def to(self, device: torch.device | str) -> PairBatch:
        return replace(
            self,
            chosen_latents=self.chosen_latents.to(device),
            rejected_latents=self.rejected_latents.to(device),
            cond=self.cond.to(device),
        )


def conditional(cond: PromptEmbeds) -> PromptEmbeds:
    """The rows without their CFG negatives: the velocity is then the conditional one (an edit
    family's condition latents stay: they are the conditioning, not a CFG side)."""
    return PromptEmbeds(
        embeds=cond.embeds,
        mask=cond.mask,
        pooled=cond.pooled,
        cond_latents=cond.cond_latents,
        cond_shapes=cond.cond_shapes,
        batch_size=cond.batch_size,
    )


# ------------------------------------------------------------------------------------ network
def velocity(
    engine: TrainEngine,
    policy: str,
    latents: torch.Tensor,
    sigmas_B: torch.Tensor,
    cond: PromptEmbeds,
    call: VelocityCall,
    *,
    grad: bool,
) -> torch.Tensor:
    """fp32 velocity of `policy` (trained, old or reference) at (latents, σ); with grad or not
    (without: `engine.inference_policy`, merged when model.lora.merge_inference asks)."""
    policy_context = engine.use_policy(policy) if grad else engine.inference_policy(policy)
    with torch.set_grad_enabled(grad), policy_context:
        return engine.adapter.velocity(
            latents,
            sigmas_B.to(latents.device) * NUM_TRAIN_TIMESTEPS,
            cond,
            call.guidance_scale,
            call.height,
            call.width,
            call.num_frames,
            true_cfg_scale=call.true_cfg_scale,
        )


@dataclass(frozen=True)
class EngineVelocities:
    """The engine's policies as an algorithm's term sees them (`diffrl.algos.Velocities`), each
    called the way the rollout called the network. `old_is_trained`: the `old` adapter holds the
    trained one's weights (`TrainEngine.adapters_equal`, checked once per optimizer step), so its
    velocity is the trained velocity, detached, without a forward pass of its own."""

    engine: TrainEngine
    call: VelocityCall
    old_is_trained: bool = False

    def trained(self, x_t: torch.Tensor, sigmas_B: torch.Tensor, cond: PromptEmbeds) -> torch.Tensor:
        return velocity(self.engine, POLICY, x_t, sigmas_B, cond, self.call, grad=True)

    def old(
        self,
        x_t: torch.Tensor,
        sigmas_B: torch.Tensor,
        cond: PromptEmbeds,
        trained: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if trained is not None and self.old_is_trained:
            return trained.detach()
        return velocity(self.engine, OLD, x_t, sigmas_B, cond, self.call, grad=False)

    def reference(self, x_t: torch.Tensor, sigmas_B: torch.Tensor, cond: PromptEmbeds) -> torch.Tensor:
        return velocity(self.engine, REFERENCE, x_t, sigmas_B, cond, self.call, grad=False)


# ------------------------------------------------------------------------------------ noise
def forward_noise(
    sample_index_B: torch.Tensor,
    latent_shape: Sequence[int],
    sigma_table: torch.Tensor,
    fraction: float,
    *,
    seed: int,
    step: int,
    epoch: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmas_BK, noise [B, K, ...]) on the CPU for NFT/AWM: each sample's K noise levels (a
    random `fraction` of `sigma_table`, via `timestep_subset`) and K fresh noises, all drawn from
    the sample's own generator (PREFERENCE_STREAM, seed, step, epoch, sample)."""
    gens = [generator("cpu", PREFERENCE_STREAM, seed, step, epoch, int(i)) for i in sample_index_B]
    index_BK = timestep_subset(len(sigma_table), fraction, gens)
    k = index_BK.shape[1]
    noise = torch.stack([torch.randn((k, *latent_shape), generator=g, dtype=torch.float32) for g in gens])
    return sigma_table.float().cpu()[index_BK], noise


def pair_noise(
    pair_index_P: torch.Tensor, latent_shape: Sequence[int], *, seed: int, step: int, epoch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmas_P, noise [P, ...]) on the CPU for DPO: one logit-normal σ and one ε per pair, from the
    pair's own generator (PREFERENCE_STREAM, seed, step, epoch, pair)."""
    gens = [generator("cpu", PREFERENCE_STREAM, seed, step, epoch, int(i)) for i in pair_index_P]
    sigmas_P = sample_logit_normal_sigmas(gens)
    noise = torch.cat([torch.randn((1, *latent_shape), generator=g, dtype=torch.float32) for g in gens])
    return sigmas_P, noise


# ------------------------------------------------------------------------------------ one step
def forward_process_backward(
    engine: TrainEngine,
    micro_batches: Sequence[CleanBatch],
    *,
    call: VelocityCall,
    sigma_table: torch.Tensor,
    fraction: float,
    adv_mode: str,
    seed: int,
    step: int,
    epoch: int,
) -> dict[str, float]:
    """Accumulate this worker's NFT or AWM gradient of one optimizer step (`engine.cfg.loss.mode`).

    Every sample trains K = max(1, ⌊len(sigma_table)·fraction⌋) noise levels; the gradient is the
    mean of the per-(micro-batch, level) losses weighted by micro-batch size, i.e. the mean over
    this worker's samples and their K levels (FSDP then averages the equal-sized workers). Returns
    the metrics averaged the same way, plus `samples` (their weight when joining workers).
    """
    loss_cfg = engine.cfg.loss
    spec = _direct_preference_spec(loss_cfg.mode, SAMPLES)
    if not micro_batches:
        raise ValueError("forward_process_backward needs at least one micro-batch")
    net = EngineVelocities(engine, call, old_is_trained=engine.adapters_equal(POLICY, OLD))
    device = engine.adapter.device
    total = sum(len(mb) for mb in micro_batches)
    terms = []
    for mb in micro_batches:
        mb = mb.to(device)
        sigmas_BK, noise_BK = forward_noise(
            mb.sample_index_B,
            mb.latents.shape[1:],
            sigma_table,
            fraction,
            seed=seed,
            step=step,
            epoch=epoch,
        )
        levels = sigmas_BK.shape[1]
        share = len(mb) / (total * levels)
        for k in range(levels):
            noise, sigmas_B = noise_BK[:, k].to(device), sigmas_BK[:, k].to(device)
            forward = partial(spec.term, mb, noise, sigmas_B, loss_cfg, net, adv_mode)
            terms.append(GradientTerm(forward, share, metric_weight=share))
    out = engine.accumulate(terms)
    out["noise_levels"] = float(levels)
    out[WEIGHT_KEY] = float(total)
    return out


def dpo_backward(
    engine: TrainEngine,
    micro_batches: Sequence[PairBatch],
    *,
    call: VelocityCall,
    seed: int,
    step: int,
    epoch: int,
) -> dict[str, float]:
    """Accumulate this worker's Diffusion-DPO gradient of one optimizer step.

    Each micro-batch's mean loss is scaled by its `weight` (its pairs' share of the step, times the
    workers); padding micro-batches (weight 0) run forward and backward so that every worker makes
    the same collective calls, and count in neither gradient nor metrics. Returns the metrics
    averaged over this worker's real pairs, plus `samples` (their number, 0 for padding only).
    """
    loss_cfg = engine.cfg.loss
    spec = _direct_preference_spec(loss_cfg.mode, PAIRS)
    if not micro_batches:
        raise ValueError("dpo_backward needs at least one micro-batch")
    device = engine.adapter.device
    call = replace(call, true_cfg_scale=None)  # the conditional velocity: no true CFG either
    net = EngineVelocities(engine, call)
    real = sum(len(mb) for mb in micro_batches if mb.weight > 0)
    terms = []
    for mb in micro_batches:
        mb = mb.to(device)
        sigmas_P, noise = pair_noise(
            mb.pair_index_P, mb.chosen_latents.shape[1:], seed=seed, step=step, epoch=epoch
        )
        forward = partial(
            spec.term,
            replace(mb, cond=conditional(mb.cond)),
            noise.to(device),
            sigmas_P.to(device),
            loss_cfg,
            net,
        )
        terms.append(GradientTerm(forward, mb.weight, len(mb) / real if mb.weight > 0 else None))
    out = engine.accumulate(terms)
    out[WEIGHT_KEY] = float(real)
    return out


def _direct_preference_spec(mode: str, trains_on: str) -> DirectPreferenceSpec:
    """The declaration of `mode`, which must train on `trains_on` (samples or pairs)."""
    spec = algorithm(mode)
    if not (isinstance(spec, DirectPreferenceSpec) and spec.trains_on == trains_on):
        raise ValueError(
            f"this backward trains the direct-preference algorithms on {trains_on}, not "
            f"actor.loss.mode={mode!r} (forward_process_backward trains on samples, dpo_backward on pairs)"
        )
    return spec


def join_worker_metrics(results: Sequence[dict[str, float]]) -> dict[str, float]:
    """The workers' metrics averaged by their `samples` weights (workers with none are left out)."""
    total = sum(r[WEIGHT_KEY] for r in results)
    if total == 0:
        return {}
    keys = {k for r in results if r[WEIGHT_KEY] > 0 for k in r if k != WEIGHT_KEY}
    return {k: sum(r.get(k, 0.0) * r[WEIGHT_KEY] for r in results) / total for k in sorted(keys)}


__all__ = [
    "CleanBatch",
    "EngineVelocities",
    "PairBatch",
    "VelocityCall",
    "conditional",
    "dpo_backward",
    "forward_noise",
    "forward_process_backward",
    "join_worker_metrics",
    "pair_noise",
    "velocity",
]
