"""Flow-matching sigma schedules of SD3 / FLUX / Qwen-Image / Wan, computed by diffusers.

diffrl does not re-implement schedules: `flow_match_schedule` builds a fresh diffusers
`FlowMatchEulerDiscreteScheduler` from the model's scheduler config (so no shared scheduler state
is ever mutated) and calls `set_timesteps` exactly as the family's diffusers pipeline does:

- "sd3" (`StableDiffusion3Pipeline`) and "wan" (`WanPipeline`): `set_timesteps(N)`, plus
  `mu = calculate_shift(image_seq_len, ...)` when the config uses dynamic shifting. The scheduler
  spaces N timesteps linearly between its *training* sigma_max and sigma_min, which for a static
  shift are already shifted, and then shifts again: with shift s, σ_i = f(u_i) where
  u = linspace(1, f(1/1000), N), f(σ) = s·σ/(1 + (s − 1)·σ). So SD3's last nonzero sigma is
  f(f(0.001)), not f(0.001). (With dynamic shifting the training sigmas are unshifted:
  u = linspace(1, 1/1000, N), then the time shift below.)
- "flux" (`FluxPipeline`) and "qwen_image" (`QwenImagePipeline`): `set_timesteps(sigmas=
  linspace(1, 1/N, N), mu=calculate_shift(image_seq_len, base_image_seq_len, max_image_seq_len,
  base_shift, max_shift))`; with dynamic shifting the scheduler maps σ -> e^μ/(e^μ + (1/σ − 1))
  ("exponential" time shift) or μ/(μ + (1/σ − 1)) ("linear"), otherwise it applies the static
  shift f. `shift_terminal` (Qwen-Image: 0.02) then stretches the schedule so that its last
  nonzero sigma equals shift_terminal: σ -> 1 − (1 − σ)·(1 − shift_terminal)/(1 − σ_{N−1}).

Every schedule then gets a final σ = 0 appended, and model timesteps are
num_train_timesteps·σ (1000·σ for all four families).

Wan: the diffusers Wan checkpoints ship a `UniPCMultistepScheduler` config with
`use_flow_sigmas=True` and `flow_shift`, and `WanPipeline` samples with that multistep solver.
RL needs one Gaussian transition per step, so diffrl samples Wan as the RL recipes do (Flow-GRPO's
Wan training): flow-match Euler with the checkpoint's shift, i.e. the "wan" convention turns such a
UniPC config into `FlowMatchEulerDiscreteScheduler(shift=flow_shift)` and calls `set_timesteps(N)`
like the SD3 pipeline. A `FlowMatchEulerDiscreteScheduler` config is used as is.
"""

from __future__ import annotations

import inspect
import itertools
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import diffusers
import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

PIPELINE_CONVENTIONS = ("sd3", "flux", "qwen_image", "wan")

_EULER = FlowMatchEulerDiscreteScheduler.__name__
# Convention -> how the diffusers pipeline calls set_timesteps: its scheduler's own spacing, or
# the explicit linear sigmas linspace(1, 1/N, N).
_LINEAR_SIGMAS = {"sd3": False, "wan": False, "flux": True, "qwen_image": True}
# Multistep solvers whose flow-sigma configs the "wan" convention samples as flow-match Euler.
_WAN_FLOW_SOLVERS = ("UniPCMultistepScheduler", "DPMSolverMultistepScheduler")


@dataclass(frozen=True)
class Schedule:
    """A denoising schedule of N steps.

    sigmas: fp32 [N + 1], decreasing from σ_0 (1 for these families) to σ_N = 0; step k goes
        σ_k -> σ_{k+1}.
    timesteps: fp32 [N], the timestep the transformer is called with at step k
        (num_train_timesteps·σ_k, i.e. 1000·σ_k).
    """

    sigmas: torch.Tensor
    timesteps: torch.Tensor

    @property
    def num_steps(self) -> int:
        return self.timesteps.shape[0]

    @property
    def sigma_1(self) -> float:
        """The second sigma σ_1, which `diffrl.sde.step(kind="sde")` uses in place of σ == 1."""
        return float(self.sigmas[1])


def flow_match_schedule(
    scheduler_config: Mapping[str, Any],
    num_steps: int,
    image_seq_len: int | None = None,
    *,
    pipeline_convention: str,
) -> Schedule:
    """The sigmas and timesteps the family's diffusers pipeline would sample with.

    Args:
        scheduler_config: the model's scheduler config (`pipe.scheduler.config`, or the dict of
            `scheduler/scheduler_config.json`): a `FlowMatchEulerDiscreteScheduler` config (with
            that `_class_name`, or no `_class_name` and only its keys); for "wan" also a
            UniPC/DPM-Solver config with `use_flow_sigmas=True` (sampled as Euler with its
            `flow_shift`, see the module docstring). It is read, never modified.
        num_steps: N >= 1 denoising steps.
        image_seq_len: number of image tokens the transformer sees
            ((latent_h / patch)·(latent_w / patch), times latent frames for video); required
            when the config has `use_dynamic_shifting`, ignored otherwise.
        pipeline_convention: one of `PIPELINE_CONVENTIONS`; how the family's pipeline calls
            `set_timesteps` (module docstring). Required: the conventions differ for the same
            config, and a wrong default would shift the schedule silently.
    """
    if pipeline_convention not in PIPELINE_CONVENTIONS:
        raise ValueError(
            f"unknown pipeline_convention {pipeline_convention!r}; expected one of {PIPELINE_CONVENTIONS}"
        )
    if isinstance(num_steps, bool) or not isinstance(num_steps, numbers.Integral) or num_steps < 1:
        raise ValueError(f"num_steps must be an int >= 1; got {num_steps!r}")

    num_steps = int(num_steps)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        euler_config(scheduler_config, pipeline_convention)
    )
    config = scheduler.config
    if config.invert_sigmas:
        raise ValueError(
            "scheduler config has invert_sigmas=True (Mochi's convention, sigmas rising to 1); "
            "diffrl's schedules denoise towards sigma 0"
        )

    kwargs: dict[str, Any] = {}
    if config.use_dynamic_shifting:
        if (
            isinstance(image_seq_len, bool)
            or not isinstance(image_seq_len, numbers.Integral)
            or image_seq_len < 1
        ):
            raise ValueError(
                f"the scheduler config uses dynamic shifting (use_dynamic_shifting=True), so the schedule "
                f"depends on resolution: pass image_seq_len >= 1, the number of image tokens; got "
                f"{image_seq_len!r}"
            )
        # The pipelines' own helper (identical copies in the SD3, FLUX and Qwen-Image pipelines);
        # imported here because the pipeline module pulls in transformers.
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        kwargs["mu"] = calculate_shift(
            image_seq_len,
            config.base_image_seq_len,
            config.max_image_seq_len,
            config.base_shift,
            config.max_shift,
        )
        _check_shift(kwargs["mu"], image_seq_len, config)
    # A degenerate result (NaN) is reported below as a ValueError rather than a numpy warning.
    with np.errstate(divide="ignore", invalid="ignore"):
        if _LINEAR_SIGMAS[pipeline_convention]:
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), **kwargs)
        else:
            scheduler.set_timesteps(num_steps, **kwargs)

    sigmas = scheduler.sigmas.detach().to("cpu", torch.float32).clone()
    timesteps = scheduler.timesteps.detach().to("cpu", torch.float32).clone()
    assert sigmas.shape == (num_steps + 1,) and timesteps.shape == (num_steps,), (sigmas, timesteps)
    # e.g. shift_terminal with one step: the stretch divides 0 by 0 inside diffusers
    if not (
        bool(torch.isfinite(sigmas).all()) and bool((sigmas[1:] < sigmas[:-1]).all()) and sigmas[-1] == 0
    ):
        size = (
            f", or a smaller image: with dynamic shifting this one's {image_seq_len} tokens shift every "
            f"sigma to {sigmas[0].item():.4g} in float32 (mu = {kwargs['mu']:.1f})"
            if "mu" in kwargs
            else ""
        )
        raise ValueError(
            f"this scheduler config gives no usable schedule for num_steps={num_steps} (sigmas must be "
            f"finite and decrease to 0; got {sigmas.tolist()}); use more steps"
            + (" (shift_terminal needs num_steps >= 2)" if config.shift_terminal else "")
            + size
        )
    return Schedule(sigmas=sigmas, timesteps=timesteps)


def fixed_schedule(sigmas: Sequence[float], num_train_timesteps: int = 1000) -> Schedule:
    """The schedule of N given sigmas σ_0 > ... > σ_{N−1} > 0, used as they are (no shift: these
    are the sigmas sampled at, e.g. a distilled few-step student's own), with σ_N = 0 appended and
    timesteps num_train_timesteps·σ_k (`rollout.pipeline.sigmas`)."""
    values = [float(s) for s in sigmas]
    if (
        not values
        or not all(0.0 < s <= 1.0 for s in values)
        or any(b >= a for a, b in itertools.pairwise(values))
    ):
        raise ValueError(f"sigmas must be decreasing values in (0, 1], at least one; got {values}")
    table = torch.tensor([*values, 0.0], dtype=torch.float32)
    return Schedule(sigmas=table, timesteps=table[:-1] * num_train_timesteps)


def euler_config(scheduler_config: Mapping[str, Any], pipeline_convention: str) -> dict[str, Any]:
    """The config as FlowMatchEulerDiscreteScheduler kwargs, or a ValueError saying why it isn't one."""
    config = dict(scheduler_config)
    class_name = config.get("_class_name")
    if class_name == _EULER:
        return config
    if class_name is None:
        accepted = inspect.signature(FlowMatchEulerDiscreteScheduler.__init__).parameters
        unknown = sorted(key for key in config if not key.startswith("_") and key not in accepted)
        if unknown:
            raise ValueError(
                f"scheduler config has no _class_name and keys that {_EULER} does not take: {unknown}; "
                f"diffrl needs a flow-matching {_EULER} config"
            )
        return config
    if pipeline_convention == "wan" and class_name in _WAN_FLOW_SOLVERS:
        # The solver class fills in its own defaults for keys the config leaves out.
        solver = getattr(diffusers, class_name).from_config(config).config
        if solver.use_flow_sigmas:
            for key in ("use_dynamic_shifting", "shift_terminal"):
                if solver[key]:
                    raise ValueError(
                        f"cannot sample this Wan {class_name} config as flow-match Euler: "
                        f"{key}={solver[key]!r} has no Euler equivalent here; pass a {_EULER} config"
                    )
            return {"num_train_timesteps": solver.num_train_timesteps, "shift": solver.flow_shift}
    hint = (
        " (a Wan UniPC/DPM-Solver config needs use_flow_sigmas=True)"
        if pipeline_convention == "wan" and class_name in _WAN_FLOW_SOLVERS
        else ""
    )
    raise ValueError(
        f"scheduler config is a {class_name}, not a flow-matching {_EULER} config{hint}; "
        f"diffrl's SDE steps need the flow-matching sigmas of {_EULER}"
    )


#: The largest x with a finite exp(x): diffusers' exponential time shift takes math.exp(mu).
_MAX_EXP = math.log(float(np.finfo(np.float64).max))


def _check_shift(mu: float, image_seq_len: int, config: Any) -> None:
    """A ValueError when an image's token count puts the dynamic shift beyond float range: `mu`
    grows linearly with the tokens (through (base_image_seq_len, base_shift) and
    (max_image_seq_len, max_shift)) and the exponential shift takes exp(mu), which overflows
    (a 32768² FLUX image: OverflowError from inside diffusers)."""
    if config.time_shift_type != "exponential" or mu < _MAX_EXP:
        return
    slope = (config.max_shift - config.base_shift) / (config.max_image_seq_len - config.base_image_seq_len)
    largest = int((_MAX_EXP - (config.base_shift - slope * config.base_image_seq_len)) / slope)
    raise ValueError(
        f"an image of {image_seq_len} tokens is beyond this scheduler's dynamic shift (mu = {mu:.0f}; "
        f"exp(mu) overflows above {_MAX_EXP:.1f}): at most {largest} image tokens; use a smaller height "
        "and width"
    )
