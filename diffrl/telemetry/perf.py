"""Model FLOPs utilisation (MFU), the FLOPs of a step's phases, and peak memory.

MFU of a phase = model FLOPs of the phase (the adapters' analytic count: `flops_per_forward`, a
backward counted as 2× a forward, or 1× when only LoRA weights train) / (phase wall seconds × GPUs ×
the GPU's dense bf16 peak). No peak, no MFU: on CPU and on a GPU missing from `PEAK_BF16_FLOPS`,
`peak_flops` returns None and nothing is logged (set `DIFFRL_PEAK_FLOPS=<FLOP/s per GPU>` to
declare an unlisted GPU's peak).

Memory (GB = 2^30 bytes):
    perf/max_memory_allocated_gb   peak bytes held by tensors on the CUDA device since the last call
    perf/max_memory_reserved_gb    peak bytes the caching allocator held since the last call
    perf/max_rss_gb                peak resident memory of this process since it started (the OS
                                   keeps no resettable peak), logged on every device
With several workers each value is the maximum over them, and `<key>_rank` names the worker that
reached it (`peak_over_workers`): the rank that runs out of memory first is the one to watch.
"""

from __future__ import annotations

import math
import os
import re
import resource
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from diffrl.config.schema import Config
    from diffrl.models.base import ModelAdapter

# Dense (no sparsity) bf16 tensor-core peak per GPU, FLOP/s, from the vendors' datasheets.
# Matched in order against the upper-cased device name (first match wins), so specific
# variants come before the family name.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    (r"GH200", 989e12),
    (r"H200.*NVL", 835e12),
    (r"H200", 989e12),  # SXM
    (r"H100.*PCIE", 756e12),
    (r"H100.*NVL", 835e12),
    (r"H100", 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    (r"H800.*PCIE", 756e12),
    (r"H800", 989e12),
    (r"\bH20\b", 148e12),
    (r"GB200", 2.5e15),
    (r"B200", 2.25e15),
    (r"A100", 312e12),
    (r"A800", 312e12),
    (r"L40S", 362e12),
    (r"\bL40\b", 181e12),
    (r"\bL4\b", 121e12),
    (r"\bA40\b", 149.7e12),
    (r"\bA30\b", 165e12),
    (r"\bA10\b", 125e12),
    (r"MI300X", 1307e12),
)

PEAK_ENV = "DIFFRL_PEAK_FLOPS"


def peak_flops_for_name(name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU by its name (`torch.cuda.get_device_name`), None if unlisted."""
    upper = name.upper()
    for pattern, flops in PEAK_BF16_FLOPS:
        if re.search(pattern, upper):
            return flops
    return None


def peak_flops(device: torch.device | str | int | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of one GPU of `device`; None on CPU, without CUDA, or for an unlisted GPU.

    `DIFFRL_PEAK_FLOPS` (FLOP/s per GPU) overrides the table for CUDA devices.
    """
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    override = os.environ.get(PEAK_ENV)
    if override:
        try:
            value = float(override)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"{PEAK_ENV}={override!r} must be a positive number of FLOP/s per GPU, e.g. 989e12"
            )
        return value
    return peak_flops_for_name(torch.cuda.get_device_name(device))


def mfu_metrics(
    flops_by_phase: Mapping[str, float],
    seconds_by_phase: Mapping[str, float],
    gpus: int,
    peak: float | None,
    *,
    step_seconds: float | None = None,
) -> dict[str, float]:
    """{"perf/mfu/<phase>": flops / (seconds × gpus × peak)} for each phase with FLOPs (a fraction, 0..1).

    flops_by_phase: model FLOPs of each phase, all GPUs together.
    seconds_by_phase: wall seconds of each phase (`PhaseTimer.seconds()`); every phase with FLOPs
        must have been timed.
    step_seconds: also log `perf/mfu/step` = all FLOPs / (step seconds × gpus × peak), the
        end-to-end MFU of the step.
    peak: FLOP/s of one GPU (`peak_flops`); None returns {} (MFU is not logged without a known peak).
    """
    if peak is None:
        return {}
    if not (peak > 0 and gpus >= 1):
        raise ValueError(f"peak must be > 0 FLOP/s and gpus >= 1, got peak={peak}, gpus={gpus}")
    out: dict[str, float] = {}
    for phase, flops in flops_by_phase.items():
        seconds = seconds_by_phase.get(phase)
        if seconds is None or seconds <= 0:
            raise ValueError(
                f"phase {phase!r} has {flops:.3g} FLOPs but {seconds!r} seconds: time it with "
                f"PhaseTimer.phase({phase!r}) (timed phases: {sorted(seconds_by_phase)})"
            )
        out[f"perf/mfu/{phase}"] = flops / (seconds * gpus * peak)
    if step_seconds is not None:
        if step_seconds <= 0:
            raise ValueError(f"step_seconds must be > 0, got {step_seconds}")
        out["perf/mfu/step"] = sum(flops_by_phase.values()) / (step_seconds * gpus * peak)
    return out


def phase_flops(
    adapter: ModelAdapter,
    cfg: Config,
    *,
    images: int,
    window: int,
    text_len: int,
    recompute_old: bool,
    trains_base_weights: bool,
    cond_tokens: int = 0,
) -> dict[str, float]:
    """Model FLOPs of one policy-gradient step's phases for `images` trajectories (all workers).

    gen: every denoising step; old_log_prob / ref: a forward per window step; update_actor: a
    forward and a backward per window step and epoch (2× forward with frozen base weights under
    LoRA, 3× when the base weights train too). CFG doubles every forward when it is on; `text_len`
    is the prompt embeddings' token count, `cond_tokens` the condition-image tokens per sample
    (image-edit families).
    """
    pipe = cfg.rollout.pipeline
    cfg_factor = 2 if adapter.wants_negative(pipe.guidance_scale, pipe.true_cfg_scale) else 1
    forward = adapter.flops_per_forward(
        images * cfg_factor, pipe.height, pipe.width, text_len, pipe.num_frames, cond_tokens=cond_tokens
    )
    backward = 2.0 if trains_base_weights else 1.0
    flops = {
        "gen": forward * pipe.num_inference_steps,
        "update_actor": forward * window * cfg.actor.epochs * (1.0 + backward),
    }
    if recompute_old:
        flops["old_log_prob"] = forward * window
    if cfg.actor.loss.kl_coef > 0:
        flops["ref"] = forward * window
    return flops


def max_rss_gb() -> float:
    """Peak resident set size of this process, GB (2^30 bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return rss * scale / 2**30


def memory_metrics(device: torch.device | str | None = None) -> dict[str, float]:
    """Peak memory since the last call (CUDA: then resets the peaks), plus the process's peak RSS.

    Call it in the process that holds the model (a worker), once per step.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    out: dict[str, float] = {}
    if device.type == "cuda":
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    out["perf/max_rss_gb"] = max_rss_gb()
    return out


def peak_over_workers(per_worker: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Every worker's `memory_metrics`, merged: the maximum of each value and, with more than one
    worker, the rank that reached it (`<key>_rank`; the lowest rank on a tie)."""
    out: dict[str, float] = {}
    for key in per_worker[0]:
        values = [worker[key] for worker in per_worker]
        out[key] = max(values)
        if len(values) > 1:
            out[f"{key}_rank"] = float(values.index(out[key]))
    return out
