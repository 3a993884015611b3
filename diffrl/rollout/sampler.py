"""Batched trajectory sampler: prompts -> `Rollout` (diffrl.transition) with log-probabilities.

For B prompts × n samples the sampler encodes each unique prompt once, then denoises micro-batches
of (prompt, sample) pairs: one batched transformer call per step (CFG inside it), SDE steps inside
the window and ODE steps elsewhere, all step math through `diffrl.sde.step`. Sample i of step s
draws its initial noise and its SDE noise from its own generator seeded by (seed, s, i), so a
rollout is identical whatever the micro-batch size. With `rollout.same_group_noise` (DanceGRPO)
the initial noise comes from the prompt group's own generator instead, the same for all n samples.

The trainer re-evaluates the stored steps with `diffrl.transition.evaluate_step`, through the same
adapter call and the same step function.

Image-edit families take each prompt's condition images (`images`, one row per prompt): they are
encoded with the prompt, once per distinct (prompt, negative, images), into the conditioning table
(`PromptEmbeds.cond_latents`), which the rollout carries to the trainer: its recomputation sees the
very latents the sampler saw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from diffrl import sde
from diffrl.config.schema import RolloutConfig
from diffrl.data.images import ConditionImage
from diffrl.models.base import ModelAdapter, PromptEmbeds
from diffrl.rollout.window import window_start
from diffrl.schedules import fixed_schedule
from diffrl.seeding import GROUP_NOISE_STREAM, NOISE_STREAM, generator
from diffrl.transition import Rollout, RolloutSettings, Trajectories

OnDecoded = Callable[[Trajectories], None]
#: Each prompt's condition images (image-edit families), one row per prompt.
ImageRows = Sequence[Sequence[ConditionImage]]


class TrajectorySampler:
    """Samples training and validation rollouts from a model adapter with `rollout.*` settings."""

    def __init__(
        self,
        adapter: ModelAdapter,
        cfg: RolloutConfig,
        *,
        progress: bool | Callable[[], Any] = True,
        log_probs_reused: bool = False,
    ):
        self.adapter = adapter
        self.cfg = cfg
        self.progress = progress
        # the trainer takes the training rollouts' log-probs as its old ones
        # (`Config.reuses_rollout_log_probs`): window steps then run as it recomputes them (`_trained_slices`)
        self.log_probs_reused = log_probs_reused
        self.encode_calls = 0  # prompts sent to the text encoders (observable: once per unique prompt)

    # ------------------------------------------------------------------------------ public
    def window(self, seed: int, step: int) -> tuple[int, int]:
        """(k0, W) of training step `step`: the same for every sample of the step."""
        lo, hi = self.cfg.sde_window_range
        size = self.cfg.sde_window_size
        k0 = window_start(
            self.cfg.sde.window_strategy,
            lo,
            hi,
            size,
            seed=seed,
            step=step,
            iters_per_group=self.cfg.sde.iters_per_group,
        )
        return k0, size

    def sample(
        self,
        prompts: Sequence[str],
        *,
        seed: int,
        step: int,
        uids: Sequence[str] | None = None,
        metadata: Sequence[dict[str, Any]] | None = None,
        negative_prompts: Sequence[str] | None = None,
        on_decoded: OnDecoded | None = None,
        sample_offset: int = 0,
        images: ImageRows | None = None,
    ) -> Rollout:
        """A training rollout: `rollout.n` SDE-window trajectories per prompt.

        `on_decoded` is called with each micro-batch's trajectories as soon as its pixels exist,
        so rewards can score them while the next micro-batch samples. `sample_offset` is the index
        of this call's first sample within the whole step, when workers share a step's prompts:
        sample indices key the noise, so they must be global. `images`: each prompt's condition
        images (image-edit families; module docstring).
        """
        pipe = self.cfg.pipeline
        return self._run(
            prompts,
            n=self.cfg.n,
            seed=seed,
            step=step,
            num_steps=pipe.num_inference_steps,
            sde_type=self.cfg.sde.type,
            noise_level=self.cfg.sde.noise_level,
            window=self.window(seed, step),
            uids=uids,
            metadata=metadata,
            negative_prompts=negative_prompts,
            on_decoded=on_decoded,
            sample_offset=sample_offset,
            same_group_noise=self.cfg.same_group_noise,
            as_trained=True,
            images=images,
        )

    def sample_validation(
        self,
        prompts: Sequence[str],
        *,
        uids: Sequence[str] | None = None,
        metadata: Sequence[dict[str, Any]] | None = None,
        negative_prompts: Sequence[str] | None = None,
        sample_offset: int = 0,
        images: ImageRows | None = None,
    ) -> Rollout:
        """A validation rollout: `rollout.val.n` samples per prompt with the fixed validation seed.

        noise_level 0 (the default) is the deterministic ODE sampler.
        """
        val = self.cfg.val
        num_steps = val.num_inference_steps or self.cfg.pipeline.num_inference_steps
        stochastic = val.noise_level > 0
        return self._run(
            prompts,
            n=val.n,
            seed=val.seed,
            step=0,
            num_steps=num_steps,
            sde_type=self.cfg.sde.type if stochastic else "ode",
            noise_level=val.noise_level,
            window=(0, num_steps) if stochastic else (0, 0),
            uids=uids,
            metadata=metadata,
            negative_prompts=negative_prompts,
            on_decoded=None,
            sample_offset=sample_offset,
            same_group_noise=False,  # validation samples of a prompt stay independent
            as_trained=False,  # nothing re-evaluates validation log-probs
            images=images,
        )

    # ------------------------------------------------------------------------------ internals
    def encode(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None,
        chunk: int | None = None,
        images: ImageRows | None = None,
    ) -> PromptEmbeds:
        """Encode each distinct (prompt, negative[, condition images]) once; rows follow `prompts`.

        `chunk`: encode the new pairs of `chunk` consecutive prompts at a time (the groups of one
        sampler micro-batch), so a prompt's conditioning is computed in the same batch however a
        step's prompts are split among workers or replicas (the batch size changes float rounding).
        `images` (image-edit families): each prompt's condition images, opened here and encoded
        with it (`ModelAdapter.encode_conditioned`); an image is keyed by its file or its bytes.
        """
        negatives = list(negative_prompts) if negative_prompts is not None else [None] * len(prompts)
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"got {len(images)} rows of condition images for {len(prompts)} prompts")
        rows = [tuple(r) for r in images] if images is not None else [()] * len(prompts)
        keys = [
            (p, n, tuple(image.key for image in r)) for p, n, r in zip(prompts, negatives, rows, strict=True)
        ]
        by_key = {key: r for key, r in zip(keys, rows, strict=True)}
        chunk = chunk or max(1, len(keys))
        row: dict[tuple, int] = {}
        loaded: dict[str, Any] = {}  # each image opened once: an adapter encodes one image object once
        tables = []
        for start in range(0, len(keys), chunk):
            new = list(dict.fromkeys(k for k in keys[start : start + chunk] if k not in row))
            if not new:
                continue
            for key in new:
                row[key] = len(row)
            self.encode_calls += len(new)
            texts = [p for p, _, _ in new]
            negative_texts = [n for _, n, _ in new] if negative_prompts is not None else None
            max_length = self.cfg.pipeline.max_sequence_length
            if images is None:
                tables.append(self.adapter.encode_prompts(texts, negative_texts, max_length))
            else:
                opened = [[_opened(image, loaded) for image in by_key[key]] for key in new]
                tables.append(self.adapter.encode_conditioned(texts, negative_texts, max_length, opened))
        embeds = tables[0] if len(tables) == 1 else PromptEmbeds.cat_padded(tables)
        order = [row[k] for k in keys]
        if order == list(range(len(order))):
            return embeds
        return embeds[torch.tensor(order, device=embeds.embeds.device)]

    def _run(
        self,
        prompts: Sequence[str],
        *,
        n: int,
        seed: int,
        step: int,
        num_steps: int,
        sde_type: str,
        noise_level: float,
        window: tuple[int, int],
        uids: Sequence[str] | None,
        metadata: Sequence[dict[str, Any]] | None,
        negative_prompts: Sequence[str] | None,
        on_decoded: OnDecoded | None,
        sample_offset: int,
        same_group_noise: bool,
        as_trained: bool,
        images: ImageRows | None = None,
    ) -> Rollout:
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts to sample")
        uids = [str(u) for u in uids] if uids is not None else [str(i) for i in range(len(prompts))]
        metadata = list(metadata) if metadata is not None else [{} for _ in prompts]
        if not len(uids) == len(metadata) == len(prompts):
            raise ValueError(
                f"got {len(prompts)} prompts but {len(uids)} uids and {len(metadata)} metadata rows"
            )
        adapter, pipe = self.adapter, self.cfg.pipeline
        size = dict(height=pipe.height, width=pipe.width, num_frames=pipe.num_frames)
        guidance, true_cfg = pipe.guidance_scale, pipe.true_cfg_scale
        if negative_prompts is None and adapter.wants_negative(guidance, true_cfg):
            negative_prompts = [pipe.negative_prompt] * len(prompts)
        micro = self.cfg.micro_batch_size
        with torch.no_grad():
            prompt_embeds = self.encode(prompts, negative_prompts, chunk=max(1, micro // n), images=images)
        if pipe.sigmas is not None and len(pipe.sigmas) == num_steps:  # its own (few-step) schedule
            schedule = fixed_schedule(pipe.sigmas)
        else:
            schedule = adapter.schedule(num_steps, **size)
        sigmas = schedule.sigmas.to(adapter.device)
        timesteps = schedule.timesteps.to(adapter.device)
        k0, w = window

        total = len(prompts) * n
        prompt_index_B = torch.arange(len(prompts)).repeat_interleave(n)
        sample_index_B = torch.arange(sample_offset, sample_offset + total)
        group_index_B = sample_index_B // n  # global, like the sample index: it keys the group's noise
        chunks: list[Trajectories] = []
        # compiled: the window steps run the training graph only where the trainer reuses their
        # log-probs; a run that recomputes them samples through the faster no-grad graph
        through_training_graph = (
            as_trained and self.log_probs_reused and adapter.trains_through_compiled_graph
        )
        with self._progress_bar() as bar, torch.no_grad():
            task = bar.add_task(f"sampling step {step}", total=total * num_steps)
            for start in range(0, total, micro):
                rows = slice(start, min(start + micro, total))
                gens = [
                    generator(adapter.device, NOISE_STREAM, seed, step, int(i)) for i in sample_index_B[rows]
                ]
                cond = prompt_embeds[prompt_index_B[rows].to(adapter.device)]
                init_gens = (
                    [
                        generator(adapter.device, GROUP_NOISE_STREAM, seed, step, int(g))
                        for g in group_index_B[rows]
                    ]
                    if same_group_noise  # its own stream: never a repeat of a sample's SDE noise
                    else gens
                )
                x = adapter.init_noise(init_gens, **size)
                kept, log_probs, means, stds = [x], [], [], []
                window_slices = self._trained_slices(x.shape[0]) if as_trained else [slice(None)]
                for k in range(num_steps):
                    in_window = k0 <= k < k0 + w
                    slices = window_slices if in_window else [slice(None)]
                    with_grad = in_window and through_training_graph
                    parts = []
                    for r in slices:
                        with torch.enable_grad() if with_grad else torch.no_grad():
                            v = adapter.velocity(
                                x[r],
                                timesteps[k].expand(x[r].shape[0]),
                                cond[r],
                                guidance,
                                **size,
                                true_cfg_scale=true_cfg,
                            ).detach()
                        parts.append(
                            sde.step(
                                sde_type if in_window else "ode",
                                x[r],
                                v,
                                sigmas[k],
                                sigmas[k + 1],
                                noise_level,
                                sigma_1=schedule.sigma_1,
                                generator=gens[r] if in_window else None,
                            )
                        )
                    out = _cat_steps(parts)
                    x = out.next_latents
                    if in_window:
                        kept.append(x)
                        log_probs.append(out.log_prob_B)
                        means.append(out.mean)
                        stds.append(out.std_B)
                    elif k < k0:
                        kept[0] = x  # the window starts from the latents of step k0
                    bar.advance(task, x.shape[0])
                chunk = Trajectories(
                    window_latents=torch.stack(kept, dim=1),
                    log_probs_BW=_stack_or_empty(log_probs, x.shape[0]),
                    means=torch.stack(means, dim=1) if means else x.new_zeros((x.shape[0], 0, *x.shape[1:])),
                    stds_BW=_stack_or_empty(stds, x.shape[0]),
                    final_latents=x,
                    pixels=adapter.decode(x, **size),
                    prompt_index_B=prompt_index_B[rows],
                    sample_index_B=sample_index_B[rows],
                    batch_size=[x.shape[0]],
                )
                if on_decoded is not None:
                    on_decoded(chunk)
                chunks.append(chunk)

        return Rollout(
            samples=torch.cat(chunks, dim=0),
            prompt_embeds=prompt_embeds,
            prompts=prompts,
            uids=uids,
            metadata=metadata,
            step_indices=torch.arange(k0, k0 + w),
            sigmas=sigmas[k0 : k0 + w + 1].float().cpu(),
            timesteps=timesteps[k0 : k0 + w].float().cpu(),
            settings=RolloutSettings(
                num_inference_steps=num_steps,
                guidance_scale=guidance,
                true_cfg_scale=true_cfg,
                sde_type=sde_type,
                noise_level=noise_level,
                sigma_1=schedule.sigma_1,
                seed=seed,
                step=step,
                **size,
            ),
        )

    def _trained_slices(self, batch: int) -> list[slice]:
        """How an SDE window step of `batch` samples is computed: as the trainer will recompute it.

        Kernels round by batch size: eager CPU matmuls over a few rows (the per-sample timestep
        and modulation projections) block their reductions by the number of rows, compiled graphs
        are specialised to their batch size, and on a GPU even the fp32 log-prob reductions round
        by tensor size. So where the
        trainer reuses this rollout's log-probs as its old ones (`log_probs_reused`), each window
        step runs, velocity and step math, on slices of the trainer's micro-batch size: the stored
        log-probs are then bit-identical to the trainer's re-evaluation before its first update,
        and it reuses them instead of a recompute pass (a forward per window step and sample).
        Eager kernels are the same with and without grad, so eager slices run without it.
        Compiled blocks are not: the training graph (grad on, trainable LoRA weights) is
        partitioned for the backward and fuses, and so rounds, differently from the no-grad graph,
        so compiled slices run with grad on (the autograd graph is dropped at once;
        `trains_through_compiled_graph`). A run that recomputes them (with
        `actor.replay_steps_per_forward` > 1, `model.lora.merge_inference`, or
        `algorithm.old_log_probs=recompute`), eager or compiled, samples its window at the rollout
        micro-batch without grad ([slice(None)]): slices and the training graph would only slow it
        down.
        """
        micro = self.adapter.train_micro_batch_size
        if not micro or not self.log_probs_reused:
            return [slice(None)]
        return [slice(s, min(s + micro, batch)) for s in range(0, batch, micro)]

    def _progress_bar(self) -> Any:
        """rich's live bar (off with progress=False), or what `progress` makes when it is a callable:
        an object with rich.progress.Progress's context manager, `add_task` and `advance` (`diffrl
        sample` prints plain lines where its output is no terminal, `diffrl.rollout.line_progress`)."""
        if callable(self.progress):
            return self.progress()
        return Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            transient=True,
            disable=not self.progress,
        )


def _opened(image: ConditionImage, loaded: dict[str, Any]) -> Any:
    """`image` decoded, once per key into `loaded`."""
    if image.key not in loaded:
        loaded[image.key] = image.load()
    return loaded[image.key]


def _cat_steps(parts: list[sde.StepOut]) -> sde.StepOut:
    """One StepOut of the samples of `parts`, in order."""
    if len(parts) == 1:
        return parts[0]
    return sde.StepOut(
        **{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(sde.StepOut)}
    )


def _stack_or_empty(values: list[torch.Tensor], batch: int) -> torch.Tensor:
    return torch.stack(values, dim=1) if values else torch.zeros(batch, 0)
