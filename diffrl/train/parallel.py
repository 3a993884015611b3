"""How the trainer's workers share one model: replicated (`ddp`), sharded (`fsdp2`), or alone (`none`).

The cheapest parallelism that fits wins:

    ddp    every worker holds the whole model; only the trained parameters' gradients cross the
           network, averaged over the workers once per optimizer step (`average_gradients`). For a
           LoRA run of a model that fits one device this is all the communication there is: no
           sampling step and no trained step gathers weights, so each worker samples and trains at
           one device's speed (what the reference Flow-GRPO loop does, through accelerate's DDP).
    fsdp2  parameters, gradients and AdamW state are sharded over the workers (`diffrl.train.fsdp`):
           every forward all-gathers each block. Needed when the optimizer state of a full
           fine-tuning, or the model itself, does not fit one device. On one worker FSDP2 runs on
           a one-rank group of its own (`join_one_rank_group`), for `actor.param_offload`.
    none   one worker: nothing to share.

`actor.strategy=auto` (the default) is resolved once, in the run plan (diffrl.config.plan,
`choose_strategy`), from the world size, LoRA or full fine-tuning, and the pipeline's weight bytes
against one device's memory; the run prints the choice and the reason in its plan block, and any
other value of `actor.strategy` is taken as given.

Why ddp is one all-reduce here rather than torch's `DistributedDataParallel` wrapper: an optimizer
step accumulates tens of backward passes (micro-batches × trained steps), and DDP would sync only in
the last one anyway (`no_sync` around the others); the adapters call the transformer module
directly and swap it for a frozen reference, which a wrapper's forward would have to intercept;
and the LoRA gradients are small (SD3.5-M r32: 37.6 MB) next to one backward. So the engine
averages them itself right before the optimizer step, in a few flat buckets.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

# The choice is the run plan's (one rule for the run and for an engine built alone); re-exported here.
from diffrl.config.plan import REPLICATE_MAX_WEIGHT_SHARE, STRATEGIES, StrategyChoice, choose_strategy
from diffrl.files import read_json_file
from diffrl.models.base import MODEL_DIR_FIX
from diffrl.train.distributed import join_one_rank_group

#: Gradients are averaged in flat buckets of at most this many elements (1 GiB of fp32 gradients):
#: one collective per bucket instead of one per tensor, and a bounded extra buffer for full models.
BUCKET_ELEMENTS = 1 << 28


def pipeline_weight_bytes(model_dir: str | Path, dtype: torch.dtype) -> int:
    """Bytes the pipeline's parameters take in `dtype`: element counts from the headers of every
    component's safetensors files (nothing is loaded)."""
    from safetensors import safe_open

    root = Path(model_dir)
    index = read_json_file(root / "model_index.json", "model index", MODEL_DIR_FIX)
    elements = 0
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or spec[0] is None:
            continue
        for file in sorted((root / name).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118  (safe_open is no mapping)
                    elements += math.prod(f.get_slice(key).get_shape())
    return elements * torch.empty((), dtype=dtype).element_size()


#: Under FSDP2, a transformer whose gathered weights take at most this share of one device's
#: memory keeps each unit gathered from its first forward to the end of a pass (sampling, a
#: log-prob pass, an optimizer step's backwards) instead of all-gathering it on every forward and
#: backward. Sharding for memory (weights past REPLICATE_MAX_WEIGHT_SHARE) never does.
KEEP_GATHERED_FRACTION = 0.2


def device_memory_bytes(cpu_workers_per_node: int) -> int | None:
    """One device's memory as this (driver) process sees it: the first GPU's, or without CUDA this
    host's memory split over its CPU workers. None when the host does not say."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // cpu_workers_per_node
    except (ValueError, OSError, AttributeError):
        return None


@torch.no_grad()
def average_gradients(params: Sequence[torch.Tensor], group=None) -> None:
    """Replace each parameter's gradient by its mean over the process group (ddp), in flat buckets.

    Call it on every rank, after the last backward of an optimizer step and before clipping. A
    parameter without a gradient on this rank (no term reached it) contributes zeros, so every
    rank makes the same collectives and ends with the same gradients.
    """
    world = dist.get_world_size(group)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        by_kind.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in by_kind.values():
        for bucket in _buckets(grads):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat.div_(world)
            for g, part in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
                g.copy_(part.view_as(g))


def _buckets(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for g in grads:
        if buckets[-1] and size + g.numel() > BUCKET_ELEMENTS:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.numel()
    return buckets


@dataclass(frozen=True)
class Parallel:
    """How a `TrainEngine`'s transformer is shared (`prepare`): replicated (gradients averaged by
    `average_gradients` before each optimizer step) or sharded with FSDP2, kept gathered through
    a pass or not."""

    replicated: bool = False
    keep_gathered: bool = False


def prepare(adapter, strategy: str, *, param_offload: bool) -> Parallel:
    """Set up the adapter's transformer for `strategy` (the run plan's: ddp, fsdp2 or none), after
    LoRA injection and before the optimizer is built over its parameters.

    fsdp2 shards it (`diffrl.train.fsdp.shard_transformer`) over the process group, or over a
    one-rank group of this process when it is in none (`join_one_rank_group`). The FSDP2 units
    stay gathered through a pass when the whole gathered model is small next to the device (full
    fine-tuning or sequence parallelism of a model that fits, not sharding for memory, and never
    under param_offload): fewer all-gathers. ddp replicates only inside a group of several."""
    if strategy == "ddp":
        return Parallel(replicated=dist.is_initialized())
    if strategy != "fsdp2":
        return Parallel()
    from diffrl.train.fsdp import gathered_bytes, shard_transformer

    join_one_rank_group(torch.device(adapter.device))
    transformer = adapter.transformer
    memory = device_memory_bytes(dist.get_world_size())
    keep_gathered = (
        memory is not None
        and not param_offload
        and gathered_bytes(transformer, adapter.dtype) <= KEEP_GATHERED_FRACTION * memory
    )
    shard_transformer(
        transformer,
        adapter.block_class_names,
        param_dtype=adapter.dtype,
        reshard_after_forward=not keep_gathered,
        cpu_offload=param_offload,
    )
    return Parallel(keep_gathered=keep_gathered)


__all__ = [
    "REPLICATE_MAX_WEIGHT_SHARE",
    "STRATEGIES",
    "Parallel",
    "StrategyChoice",
    "average_gradients",
    "choose_strategy",
    "device_memory_bytes",
    "pipeline_weight_bytes",
    "prepare",
]
