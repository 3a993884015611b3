"""`diffrl check`: what the sampler computes, against independent references and the trainer.

- `sampler_vs_pipeline`: the run's ODE sampler (`TrajectorySampler.sample_validation` on the
  worker's module, LoRA injected as the run has it) against the family's own diffusers pipeline
  (`ModelAdapter.pipeline_call` / `pipeline_latents`) from the same initial noise; and every
  pipeline setting read back from what the transformer actually received in both runs (a forward
  pre-hook): the timesteps (the shift), the CFG passes per sample and the guidance embedding, the
  latent shape (resolution, frames) and the text length; plus the decoded pixels' size.
- `log_probs_vs_trainer`: the log-probs a training rollout stored against the trainer's
  recomputation (`StagedStep.log_probs` -> `TrainEngine.log_probs` -> `transition.evaluate_window`)
  on unchanged weights, per trained step: bitwise where the run reuses them
  (`Config.reuses_rollout_log_probs`: then against the update's first forward, grad on, the
  graph a compiled sampler computes its window steps with), otherwise the gap the run recomputes
  away.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from diffrl.config.schema import Config
from diffrl.controller.check_report import CheckRow, fmt, fmt_list, row, skipped
from diffrl.models.base import ModelAdapter
from diffrl.models.experts import trained_components
from diffrl.rollout.sampler import TrajectorySampler
from diffrl.transition import Rollout

#: Relative error ‖sampler − pipeline‖ / ‖pipeline‖ of the final latents, by the network's dtype.
#: The pipelines keep their latents in the network's dtype between steps (bf16 rounds each step)
#: where diffrl keeps fp32; a dropped shift or guidance moves the result by tens of percent.
LATENT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 2e-2}
#: Relative tolerance on the timesteps the transformer received (the schedule, with its shift).
TIMESTEP_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Call:
    """What one transformer forward received."""

    rows: int
    sample_shape: tuple[int, ...]
    timestep: float
    text_tokens: tuple[int, ...]  # per row: the text tokens attended to (unmasked ones with a mask)
    guidance: float | None  # FLUX's distilled guidance embedding


@contextmanager
def recorded_calls(transformer: torch.nn.Module) -> Iterator[list[Call]]:
    """Record the inputs of every forward of `transformer` (of each of its experts) while the context is open."""
    calls: list[Call] = []

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if "hidden_states" not in kwargs and isinstance(kwargs.get("x", args[0] if args else None), list):
            calls.append(_list_call(args, kwargs))
            return
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        text, mask = kwargs.get("encoder_hidden_states"), kwargs.get("encoder_hidden_states_mask")
        guidance, timestep = kwargs.get("guidance"), kwargs.get("timestep")
        calls.append(
            Call(
                rows=int(hidden.shape[0]),
                sample_shape=tuple(hidden.shape[1:]),
                timestep=float(torch.as_tensor(timestep).flatten()[0]),
                text_tokens=_text_tokens(text, mask, int(hidden.shape[0])),
                guidance=float(guidance.flatten()[0]) if guidance is not None else None,
            )
        )

    # on each expert (Wan2.2 A14B): the family's pipeline calls them itself, not diffrl's module of the two
    handles = [
        m.register_forward_pre_hook(hook, with_kwargs=True) for _, m in trained_components(transformer)
    ]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _list_call(args: tuple, kwargs: dict) -> Call:
    """A forward that takes one tensor per row (Z-Image: `transformer(x, t, cap_feats)`, positional
    from its pipeline, by name from diffrl): the rows' latents, timesteps and captions as lists."""
    names = ("x", "t", "cap_feats")
    x, t, captions = (kwargs[n] if n in kwargs else args[i] for i, n in enumerate(names))
    return Call(
        rows=len(x),
        sample_shape=tuple(x[0].shape),
        timestep=float(torch.as_tensor(t).flatten()[0]),
        text_tokens=tuple(int(c.shape[0]) for c in captions),
        guidance=None,
    )


def _text_tokens(text: torch.Tensor | None, mask: torch.Tensor | None, rows: int) -> tuple[int, ...]:
    if mask is not None:
        return tuple(int(n) for n in mask.sum(dim=1).tolist())
    return (int(text.shape[1]) if text is not None else 0,) * rows


def _distinct(per_step: set[tuple[int, ...]]) -> list[int]:
    return sorted({n for step in per_step for n in step})


def _steps(calls: Sequence[Call]) -> list[list[Call]]:
    """Calls grouped by denoising step, in order: the calls at one timestep (a pipeline may run the
    two CFG halves as two calls, and the edit pipelines one prompt per call: each prompt's loop
    comes back to the same timesteps)."""
    steps: dict[float, list[Call]] = {}
    for call in calls:
        steps.setdefault(call.timestep, []).append(call)
    return list(steps.values())


def sampler_vs_pipeline(
    adapter: ModelAdapter,
    cfg: Config,
    prompts: Sequence[str],
    use_policy: Callable[[], AbstractContextManager],
    metadata: Sequence[dict[str, Any]] | None = None,
    images: Sequence[Sequence[Any]] | None = None,
) -> tuple[list[CheckRow], Rollout]:
    """Rows for the ODE sampler against the family's pipeline and for every pipeline setting;
    returns the sampler's rollout too (its pixels feed the reward check). `use_policy` is the
    context the run samples in (peft's active adapter, or merged weights); `metadata` goes with
    the prompts to the rewards; `images` are the prompts' condition images (`ConditionImage` rows,
    image-edit families), which both the sampler and the pipeline get."""
    pipe = cfg.rollout.pipeline
    steps = pipe.num_inference_steps
    # The run's own validation sampler, made deterministic (ODE), one sample per prompt, the run's
    # step count: initial noise from the run's seed derivation, CFG and negatives as the run has them.
    rollout_cfg = replace(
        cfg.rollout, val=replace(cfg.rollout.val, n=1, num_inference_steps=steps, noise_level=0.0)
    )
    sampler = TrajectorySampler(adapter, rollout_cfg, progress=False)
    with torch.no_grad(), use_policy(), recorded_calls(adapter.transformer) as ours:
        rollout = sampler.sample_validation(list(prompts), metadata=metadata, images=images)
    if adapter.no_pipeline_reference:
        return [skipped("sampler = pipeline", adapter.no_pipeline_reference)], rollout
    if pipe.sigmas is not None:
        # diffusers' pipelines shift the sigmas they are given, the sampler uses them as given: no
        # like-for-like reference (tests/controller/test_distillation_schedule.py checks the steps)
        reason = f"rollout.pipeline.sigmas={list(pipe.sigmas)}: the sampler's own schedule, used unshifted"
        return [skipped("sampler = pipeline", reason)], rollout
    noise = rollout.samples.window_latents[:, 0]  # a validation rollout keeps its initial noise
    negatives = (
        [pipe.negative_prompt] * len(prompts)
        if adapter.wants_negative(pipe.guidance_scale, pipe.true_cfg_scale)
        else None
    )
    call = adapter.pipeline_call(
        prompts,
        negatives,
        num_inference_steps=steps,
        guidance_scale=pipe.guidance_scale,
        true_cfg_scale=pipe.true_cfg_scale,
        height=pipe.height,
        width=pipe.width,
        num_frames=pipe.num_frames,
        max_sequence_length=pipe.max_sequence_length,
        images=None if images is None else [[image.load() for image in row] for row in images],
    )
    with torch.no_grad(), use_policy(), recorded_calls(adapter.transformer) as theirs:
        reference = adapter.pipeline_latents(noise.clone(), call).float()
    final = rollout.samples.final_latents.to(reference.device)
    rel = float((final - reference).norm() / reference.norm().clamp_min(1e-12))
    tol = LATENT_TOLERANCE[adapter.dtype]
    family = type(adapter.reference_pipeline()).__name__
    rows = [
        row(
            "sampler = pipeline",
            f"rel. error {fmt(rel)}",
            f"<= {fmt(tol)} ({str(adapter.dtype).removeprefix('torch.')})",
            rel <= tol,
            f"diffrl's ODE sampler and {family} disagree from the same initial noise at "
            f"num_inference_steps={steps}: see the setting rows for the cause (a shift, guidance or "
            "text setting that did not reach one of them), or a model modified outside its pipeline",
        )
    ]
    rows += _setting_rows(cfg, adapter, rollout, _steps(ours), _steps(theirs), len(prompts), family)
    return rows, rollout


def _setting_rows(
    cfg: Config,
    adapter: ModelAdapter,
    rollout: Rollout,
    ours: list[list[Call]],
    theirs: list[list[Call]],
    batch: int,
    family: str,
) -> list[CheckRow]:
    """Each pipeline setting read back from the transformer's inputs in both runs."""
    pipe = cfg.rollout.pipeline
    rows = []
    # shift: the timesteps of every step, which the schedule's shift sets
    t_ours = [s[0].timestep for s in ours]
    t_theirs = [s[0].timestep for s in theirs]
    if len(t_ours) != len(t_theirs):
        rows.append(
            row(
                "shift (timesteps)",
                f"{len(t_ours)} steps vs {len(t_theirs)}",
                "equal",
                False,
                f"the sampler ran {len(t_ours)} steps, {family} {len(t_theirs)}: "
                f"rollout.pipeline.num_inference_steps={pipe.num_inference_steps} did not reach one of them",
            )
        )
    else:
        scale = max(abs(t) for t in t_theirs) or 1.0
        gap = max(abs(a - b) for a, b in zip(t_ours, t_theirs, strict=True)) / scale
        rows.append(
            row(
                "shift (timesteps)",
                f"max rel. gap {fmt(gap)}; first {fmt_list(t_ours[:3])}",
                f"<= {fmt(TIMESTEP_TOLERANCE)}",
                gap <= TIMESTEP_TOLERANCE,
                f"the sampler's timesteps {fmt_list(t_ours)} differ from {family}'s {fmt_list(t_theirs)}: "
                "its schedule (shift, dynamic shift mu, shift_terminal) is not the model's "
                "scheduler/scheduler_config.json",
            )
        )
    # guidance: CFG passes per sample, the guidance embedding, and the settings the rollout recorded
    passes_ours = {sum(c.rows for c in s) // batch for s in ours}
    passes_theirs = {sum(c.rows for c in s) // batch for s in theirs}
    g_ours = {c.guidance for s in ours for c in s}
    g_theirs = {c.guidance for s in theirs for c in s}
    recorded = (rollout.settings.guidance_scale, rollout.settings.true_cfg_scale)
    configured = (pipe.guidance_scale, pipe.true_cfg_scale)
    ok = passes_ours == passes_theirs and g_ours == g_theirs and recorded == configured
    rows.append(
        row(
            "guidance / true CFG",
            f"passes/sample {sorted(passes_ours)} vs {sorted(passes_theirs)}; recorded g={recorded[0]:g} "
            f"true_cfg={recorded[1]}",
            "equal; recorded = config",
            ok,
            f"CFG passes per sample: sampler {sorted(passes_ours)}, {family} {sorted(passes_theirs)}; guidance "
            f"embedding {sorted(g_ours, key=str)} vs {sorted(g_theirs, key=str)}; the rollout recorded "
            f"guidance_scale={recorded[0]}, true_cfg_scale={recorded[1]} for rollout.pipeline."
            f"guidance_scale={configured[0]}, true_cfg_scale={configured[1]}",
        )
    )
    # resolution and frames: the latent shape the transformer saw, and the decoded pixels
    shapes_ours = {c.sample_shape for s in ours for c in s}
    shapes_theirs = {c.sample_shape for s in theirs for c in s}
    pixels = tuple(rollout.samples.pixels.shape[1:])
    expected = (
        (pipe.num_frames, 3, pipe.height, pipe.width) if adapter.is_video else (3, pipe.height, pipe.width)
    )
    rows.append(
        row(
            "resolution / frames",
            f"pixels {'x'.join(map(str, pixels))}; latents {sorted(shapes_ours)}",
            f"pixels {'x'.join(map(str, expected))}; latents = {family}'s",
            pixels == expected and shapes_ours == shapes_theirs,
            f"decoded {pixels} for rollout.pipeline height={pipe.height} width={pipe.width} "
            f"num_frames={pipe.num_frames} ({expected}); transformer inputs {sorted(shapes_ours)} vs "
            f"{family}'s {sorted(shapes_theirs)}",
        )
    )
    # text length: per step, the tokens each row attended to (the unmasked ones where there is a
    # mask), CFG halves included, whether a pipeline runs them as one call or two
    text_ours = {tuple(sorted(n for c in s for n in c.text_tokens)) for s in ours}
    text_theirs = {tuple(sorted(n for c in s for n in c.text_tokens)) for s in theirs}
    rows.append(
        row(
            "text length",
            f"{_distinct(text_ours)} tokens/row vs {_distinct(text_theirs)}",
            f"equal (max_sequence_length={pipe.max_sequence_length})",
            text_ours == text_theirs,
            f"the transformer's rows had {sorted(text_ours)} text tokens per step from the sampler, "
            f"{sorted(text_theirs)} from {family}: rollout.pipeline.max_sequence_length="
            f"{pipe.max_sequence_length} did not reach one of them",
        )
    )
    return rows


def log_probs_vs_trainer(
    cfg: Config,
    sampled_BW: torch.Tensor | None,
    recomputed_BW: torch.Tensor | None,
    steps: Sequence[int] = (),
) -> list[CheckRow]:
    """One row per trained (window) step `steps[j]`: the sampled log-probs [B, W] against the
    trainer's recomputation on the same weights. None: the config trains on no SDE log-probs."""
    if sampled_BW is None or recomputed_BW is None:
        return [
            skipped(
                "log-probs = trainer",
                f"actor.loss.mode={cfg.actor.loss.mode} (algorithm.trainer_type={cfg.algorithm.trainer_type}) "
                "trains on clean samples, not on the sampler's log-probs",
            )
        ]
    sampled = sampled_BW.to(recomputed_BW.device)
    reuse = cfg.reuses_rollout_log_probs
    rows = []
    for j, k in enumerate(steps):
        gap = (recomputed_BW[:, j] - sampled[:, j]).abs()
        finite = bool(torch.isfinite(recomputed_BW[:, j]).all() and torch.isfinite(sampled[:, j]).all())
        worst = float(gap.max()) if finite else float("nan")
        if reuse:
            rows.append(
                row(
                    f"log-probs = trainer, step {k}",
                    f"max |gap| {fmt(worst)}",
                    "0 (reused: bitwise)",
                    finite and worst == 0.0,
                    f"the run reuses the sampler's log-probs as the old ones (algorithm.old_log_probs="
                    f"{cfg.algorithm.old_log_probs}), but the trainer computes step {k} differently "
                    f"(max |gap| {fmt(worst)}: a dtype, kernel or weight difference between sampler and "
                    "trainer); PPO's ratio would start off 1. Set algorithm.old_log_probs=recompute, or "
                    "find what differs",
                )
            )
        else:
            rows.append(
                row(
                    f"log-probs = trainer, step {k}",
                    f"max |gap| {fmt(worst)}",
                    "finite (recomputed by the run)",
                    finite,
                    f"non-finite log-probs at step {k}: the sampler or the trainer produced NaN/inf "
                    "(check model.dtype and the SDE noise level)",
                )
            )
    return rows


__all__ = ["Call", "log_probs_vs_trainer", "recorded_calls", "sampler_vs_pipeline"]
