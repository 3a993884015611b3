"""FSDP2 sharding and activation checkpointing of a model adapter's transformer.

Sharding (`shard_transformer`) follows the FSDP2 recipe: `fully_shard` each repeated block (the
classes the adapter declares in `block_class_names`), bottom-up, then the root, so each block is
one communication unit (one all-gather in forward, one reduce-scatter of its gradients in
backward) and the root unit holds the rest (embeddings, final norm and projection). Parameters
become DTensors sharded on dim 0 over the mesh; the module is changed in place.

Mixed precision is FSDP2's own `MixedPrecisionPolicy`: the sharded parameters keep their loaded
dtype (the optimizer's "master" weights), each unit's all-gather casts them to `param_dtype` for
compute, and gradients are reduced in `reduce_dtype` (fp32) and handed back in the parameters'
own dtype.

LoRA (peft, through diffusers' `add_adapter`) must be injected BEFORE sharding: `fully_shard`
takes the parameters a module has at that moment; an adapter added later would be neither
sharded nor reduced. A LoRA-adapted block then mixes frozen base weights and trainable LoRA
weights in one unit, which FSDP2 supports: only the trainable parameters get gradients reduced,
and parameters of different dtypes are all-gathered together (cast to `param_dtype`, or as bytes
when it is None). FSDP2 does require the TRAINABLE parameters of a unit to share one dtype,
which `shard_transformer` checks up front with a clear error.

Note on LoRA dtypes: diffusers' `add_adapter` creates the LoRA weights in the base weights' dtype
(bf16 for a bf16 model; peft's fp32 up-cast only happens in `get_peft_model`). The GPU recipe is
bf16 base weights, LoRA weights cast to fp32 after injection
(`diffusers.training_utils.cast_training_params(transformer, torch.float32)`, as diffusers'
training scripts do), `param_dtype=torch.bfloat16`, `reduce_dtype=torch.float32`: compute in
bf16, gradients averaged in fp32, AdamW on fp32 LoRA weights.

FSDP2 decides a unit's gradient dtypes once, at the root's first forward, from the parameters
that require grad at that moment (torch 2.13 `FSDPParamGroup._init_mp_dtypes`). A first forward
with every adapter disabled (peft's `disable_adapters()` sets `requires_grad=False` on the LoRA
weights; an engine computing reference log-probs first does exactly that) records "no trainable
parameters", and the first backward then reduces in the compute dtype and fails to assign a bf16
gradient to an fp32 parameter (pytorch/pytorch#186998; its fix does not cover a unit of mixed
dtypes like ours). `shard_transformer` therefore finishes FSDP's lazy initialization itself,
right after sharding, while the trainable set is the one the caller prepared (the workaround the
issue gives; see `_finish_lazy_init`). After that, toggling adapters is safe: each unshard
re-reads `requires_grad` from the sharded parameter.

A frozen reference transformer (full fine-tuning with a KL term) can be sharded with the same
call: with no trainable parameter FSDP2 only all-gathers for forward. Under `torch.no_grad()`
the root keeps its (small) parameters gathered after forward, as FSDP2 does for any root.

Moving a sharded module between host and accelerator (`TrainEngine.to`) is `module.to(device)`:
FSDP2's `FSDPModule._apply` reshards first, moves each DTensor parameter's local shard (and its
gradient) keeping the parameter object, so an optimizer built over them stays valid, and then
re-registers the moved shards. The mesh keeps its device; gather the module back before its next
forward. Under `cpu_offload` the offload policy decides where the shards live instead.

Activation checkpointing (`enable_activation_checkpointing`) uses the transformer's own
mechanism: diffusers models have `enable_gradient_checkpointing()`, which makes the model's
forward loop call each block through `torch.utils.checkpoint` (non-reentrant). It needs no
module wrapping, so parameter names stay those of the model (the names peft, diffusers' LoRA
export and DCP checkpoints rely on), and it composes with `fully_shard` in either order. For a
module without that mechanism the blocks are checkpointed with torch's composable
`checkpoint(module)` API, which also keeps names; apply it before sharding.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from diffrl.models.blocks import find_blocks


def _unit_trainable_dtypes(module: nn.Module, blocks: list[nn.Module]) -> dict[str, set[torch.dtype]]:
    """For each future FSDP unit (the blocks, bottom-up, then the root): its trainable parameters' dtypes."""
    names = {m: n for n, m in module.named_modules()}
    taken: set[int] = set()
    units: dict[str, set[torch.dtype]] = {}
    for unit in [*reversed(blocks), module]:
        dtypes = set()
        for p in unit.parameters():
            if id(p) in taken:
                continue
            taken.add(id(p))
            if p.requires_grad:
                dtypes.add(p.dtype)
        units[names[unit] or "<root>"] = dtypes
    return units


def _finish_lazy_init(module: FSDPModule) -> None:
    """Run FSDP2's root lazy initialization now instead of at the first forward.

    It fixes the root, the prefetch order and each unit's gradient dtypes from the parameters
    that require grad now (see the module docstring for why the first forward is the wrong
    moment when adapters are toggled). FSDP2 has no public call for this in torch 2.13; the
    root's own `_lazy_init` is idempotent and is exactly what its first forward would run.
    """
    state = module._get_fsdp_state()
    state._lazy_init()


def shard_transformer(
    transformer: nn.Module,
    block_class_names: tuple[str, ...],
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    cast_forward_inputs: bool = False,
    mesh=None,
) -> nn.Module:
    """Shard `transformer` in place with FSDP2: each declared block, then the root. Returns it.

    - `cast_forward_inputs`: off by default: the model adapters hand the network its inputs in the
      dtypes the diffusers pipeline uses, and FSDP's casting would also turn the fp32 timesteps
      into bf16 (1000·σ rounded to 8 mantissa bits), so sharded and unsharded runs would compute
      different models. Turn it on only for callers that pass fp32 inputs to a bf16-compute model.

    - `param_dtype`: the compute dtype the all-gather casts parameters to (bf16 on GPU); None
      computes in the parameters' own dtype. The sharded parameters keep their own dtype, which
      is what the optimizer updates: for full fine-tuning load the transformer in fp32 and pass
      `param_dtype=torch.bfloat16` to get fp32 master weights with bf16 compute. With LoRA, cast
      the LoRA weights to fp32 after injection (module docstring); the frozen base may stay bf16.
    - `reduce_dtype`: gradients are reduce-scattered in this dtype (fp32 by default, so the
      average over ranks does not lose bits).
    - `reshard_after_forward`: for the blocks; True frees each block's gathered parameters after
      its forward and gathers them again in backward (less memory, one more all-gather per block),
      False keeps them until backward. The root follows FSDP2's default (kept gathered: backward
      needs it first).
    - `cpu_offload`: FSDP2's `CPUOffloadPolicy` keeps sharded parameters, gradients, and so the
      optimizer step and its state, in (pinned) host memory; on a CPU mesh, where everything
      already lives there, it moves nothing and computes as without it.
    - `mesh`: a 1-D `DeviceMesh` (FSDP) or 2-D (HSDP); None = FSDP2's default, all ranks of the
      default process group on this process's CUDA device, or the CPU without CUDA.

    Call it after LoRA injection and `set_adapter` (the trainable set must be final), after
    `enable_activation_checkpointing`, on every rank, and build the optimizer afterwards over
    the (now DTensor) parameters. Raises ValueError when no block matches, when the module is
    already sharded, or when a unit's trainable parameters mix dtypes.
    """
    if isinstance(transformer, FSDPModule):
        raise ValueError(f"{type(transformer).__name__} is already sharded with fully_shard: shard it once")
    blocks = find_blocks(transformer, block_class_names)
    if mesh is None and not dist.is_initialized():
        raise ValueError(
            "shard_transformer needs a process group: call diffrl.train.distributed.init_distributed() "
            "first (or pass a DeviceMesh), or use actor.strategy=none on one device"
        )
    for unit, dtypes in _unit_trainable_dtypes(transformer, blocks).items():
        if len(dtypes) > 1:
            raise ValueError(
                f"FSDP unit {unit!r} has trainable parameters of several dtypes ({sorted(map(str, dtypes))}); "
                "FSDP2 needs one dtype per unit: cast the trainable parameters to one dtype before sharding"
            )
    offload: OffloadPolicy = OffloadPolicy()
    if cpu_offload:
        mesh_device = (
            mesh.device_type if mesh is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        # On a CPU mesh the shards already live in host memory: the policy moves nothing there
        # (pinned memory needs an accelerator) and runs the step as on a GPU mesh.
        offload = CPUOffloadPolicy(pin_memory=mesh_device != "cpu")
    mp_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=cast_forward_inputs
    )
    # Bottom-up: a block nested in another block must be its own unit before its parent takes the rest.
    for block in reversed(blocks):
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload,
        )
    fully_shard(transformer, mesh=mesh, mp_policy=mp_policy, offload_policy=offload)
    _finish_lazy_init(transformer)
    return transformer


def gathered_bytes(module: nn.Module, dtype: torch.dtype | None) -> int:
    """Bytes the module's parameters take gathered in `dtype` (None: their own dtypes): what one
    rank holds when every unit keeps its parameters gathered."""
    return sum(p.numel() * (dtype or p.dtype).itemsize for p in module.parameters())


def fsdp_units(module: nn.Module) -> list[FSDPModule]:
    """The module's FSDP2 units (its blocks, then the root), or [] for a module not sharded."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


@contextmanager
def resharded_after(module: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Reshard every FSDP2 unit of `module` when the block ends.

    For a model sharded with `reshard_after_forward=False`: a no-grad pass (sampling's denoising
    loop, a log-prob pass) then all-gathers each unit once, at its first forward, and keeps it for
    the pass's other forwards instead of gathering it on every one; the gathered copies are freed
    at the end, so no copy outlives a change of the sharded weights (an optimizer step, a loaded
    checkpoint, a weight sync). A no-op for a module that is not sharded or when not `enabled`."""
    try:
        yield
    finally:
        if enabled:
            for unit in fsdp_units(module):
                unit.reshard()


def enable_activation_checkpointing(transformer: nn.Module, block_class_names: tuple[str, ...]) -> int:
    """Recompute each block's activations in backward instead of storing them. Returns the block count.

    Uses the model's own switch when it has one (diffusers `enable_gradient_checkpointing()`):
    the model's forward loop then checkpoints exactly its blocks, through `torch.utils.checkpoint`
    non-reentrant, only while grad is enabled (sampling and `no_grad` log-probs pay nothing).
    Otherwise every module of a class in `block_class_names` gets torch's composable
    `checkpoint`, which keeps parameter names (no `_checkpoint_wrapped_module` prefix in state
    dicts); call it before `shard_transformer` in that case.

    Either way gradients equal those without checkpointing: only the memory/compute trade changes.
    """
    blocks = find_blocks(transformer, block_class_names)
    if getattr(transformer, "_supports_gradient_checkpointing", False) and hasattr(
        transformer, "enable_gradient_checkpointing"
    ):
        transformer.enable_gradient_checkpointing()
        return len(blocks)
    if isinstance(transformer, FSDPModule):
        raise ValueError(
            f"{type(transformer).__name__} has no enable_gradient_checkpointing() and is already sharded: "
            "call enable_activation_checkpointing before shard_transformer"
        )
    from torch.distributed._composable import checkpoint

    for block in blocks:
        checkpoint(block)
    return len(blocks)


__all__ = ["enable_activation_checkpointing", "shard_transformer"]
