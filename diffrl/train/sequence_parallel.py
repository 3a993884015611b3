"""Ulysses sequence parallelism for video transformers: one sample's tokens split over P ranks.

A video's token sequence is long (Wan2.1 at 480p, 81 frames: 21·30·52 = 32,760 tokens) and a
transformer block's activations grow with it. With sequence parallelism (SP) the P ranks of an SP
group run the same micro-batch, each holding L/P of its video tokens through every block; only
self-attention needs the whole sequence, and gets it DeepSpeed-Ulysses' way:

    q, k, v  [B, L/P, H, D]  --all-to-all-->  [B, L, H/P, D]   (every token, a subset of heads)
    attention over the whole sequence for those heads
    out      [B, L, H/P, D]  --all-to-all-->  [B, L/P, H, D]

Cross-attention to the text needs no communication (every rank has all the text tokens). After the
last block `proj_out`'s output is all-gathered, so every rank returns the full velocity and the
loss that follows is the ordinary one, identical on the P ranks.

What does it: diffusers' own context parallelism (0.36+), used as it is. Its
`TemplatedUlyssesAttention` is an autograd Function with a backward (the all-to-alls of the
gradients, the attention backward in between) for the native, cuDNN, flash and sage backends;
`WanTransformer3DModel._cp_plan` says where to split (the input of `blocks.0`, the rotary
embedding's outputs, per-token timesteps) and where to gather (`proj_out`'s output), and
`apply_context_parallel` installs that plan as module hooks; Wan's attention processor sends only
self-attention (attn1) through the Ulysses path. diffrl adds the parts a trainer needs:

- the mesh: `sequence_parallel_mesh` lays the world out as (dp, sp) with the SP ranks consecutive
  (on one node, where all-to-all is fast), in the 3-D (dp, ring, ulysses) shape diffusers' config
  expects;
- installation without `ModelMixin.enable_parallelism`, whose device lookup divides by the
  accelerator count (zero on a CPU-only host, so it cannot run in CPU CI):
  `UlyssesSequenceParallel.attach` does its context-parallel part (the backend check, each
  processor's parallel config, the model's `_cp_plan` hooks) with the same diffusers objects, and
  `detach` removes them, so the module that trains with SP can sample without it;
- errors a user can act on: heads and token counts not divisible by P are ValueErrors naming the
  shape and the fix (diffusers' own check is an assert inside the split);
- the gradient reduction (below).

Gradients. Every SP rank computes the same loss L on the same micro-batch. In backward the gather
hands each rank the slice of ∂L/∂output for its own tokens (diffusers' `AllGatherFunction`), the
all-to-alls return to each rank the gradients of its own tokens' q, k, v (from every rank's
attention), and the split of the block input routes gradient only to the rank's own tokens. So a
parameter's gradient on SP rank r is the part of ∂L/∂θ that flows through rank r's tokens, and
the true gradient is the SUM over the SP group; parameters used by every rank (the text and time
embedders, the output modulation) are covered too, each rank contributing its tokens' share.
Where the sum happens:

- FSDP2 over the whole world (`diffrl.train.fsdp.shard_transformer` with its default mesh, the DP
  and SP ranks together): its reduce-scatter sums over all dp·sp ranks and divides by the
  gradient divide factor; `UlyssesSequenceParallel.reduce_gradients_with_fsdp` sets it to dp, the
  number of distinct micro-batch streams, which turns the mean over ranks into the mean over DP
  replicas of each group's summed gradient (sum-then-divide, so gloo can run it too).
- no FSDP (one SP group, `actor.strategy=none`): `UlyssesSequenceParallel.all_reduce_gradients` sums
  the gradients over the SP group after the last backward and before the optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

#: Mesh dimension names: data parallel, then diffusers' context-parallel pair (ring unused, size 1).
MESH_DIMS = ("dp", "ring", "ulysses")


def sequence_parallel_mesh(sp_size: int, device_type: str | None = None) -> DeviceMesh:
    """The world as a (dp, ring=1, ulysses=sp) mesh: ranks r·sp .. r·sp + sp − 1 form SP group r.

    Needs the default process group (`diffrl.train.distributed.init_distributed`). `device_type`
    defaults to cuda when CUDA is available, else cpu (gloo).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "sequence parallelism needs a process group: call diffrl.train.distributed.init_distributed() first"
        )
    world = dist.get_world_size()
    if sp_size < 1 or world % sp_size:
        raise ValueError(
            f"actor.sequence_parallel_size={sp_size} must divide the number of trainer ranks ({world}): "
            f"choose one of {[d for d in range(1, world + 1) if world % d == 0]}"
        )
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (world // sp_size, 1, sp_size), mesh_dim_names=MESH_DIMS)


def _attention_modules(transformer: nn.Module) -> list[nn.Module]:
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return [m for m in transformer.modules() if isinstance(m, (Attention, AttentionModuleMixin))]


def check_ulysses_supported(transformer: nn.Module, sp_size: int) -> None:
    """ValueError unless `transformer` can run Ulysses over `sp_size` ranks (heads divisible, a
    context-parallel plan, an attention backend with a context-parallel path)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    name = type(transformer).__name__
    plan = getattr(transformer, "_cp_plan", None)
    if plan is None:
        raise ValueError(
            f"{name} has no context-parallel plan (`_cp_plan`) in this diffusers version: sequence "
            "parallelism is supported for Wan (WanTransformer3DModel); set actor.sequence_parallel_size=1"
        )
    heads = transformer.config.num_attention_heads
    if heads % sp_size:
        raise ValueError(
            f"{name} has {heads} attention heads, not divisible by actor.sequence_parallel_size={sp_size}: "
            f"Ulysses gives each SP rank heads/size heads; choose a size that divides {heads}"
        )
    for module in _attention_modules(transformer):
        processor = module.processor
        if not hasattr(processor, "_parallel_config"):
            raise ValueError(
                f"attention processor {type(processor).__name__} of {name} has no context-parallel path: "
                "use the model's default processor (diffusers' own) with sequence parallelism"
            )
        backend = processor._attention_backend
        backend = (
            _AttentionBackendRegistry.get_active_backend()[0]
            if backend is None
            else AttentionBackendName(backend)
        )
        if not _AttentionBackendRegistry._is_context_parallel_available(backend):
            supported = sorted(_AttentionBackendRegistry._supports_context_parallel)
            raise ValueError(
                f"model.attn_backend={backend.value!r} has no sequence-parallel (context-parallel) path in "
                f"diffusers; use one of {supported}"
            )


def _video_tokens(transformer: nn.Module, hidden_states: torch.Tensor) -> int:
    """Tokens after patch embedding of latents [B, C, T, H, W]."""
    p_t, p_h, p_w = transformer.config.patch_size
    _, _, frames, height, width = hidden_states.shape
    return (frames // p_t) * (height // p_h) * (width // p_w)


def _token_check_hook(sp_size: int):
    def check(module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        tokens = _video_tokens(module, hidden)
        if tokens % sp_size:
            p_t, p_h, p_w = module.config.patch_size
            raise ValueError(
                f"latents of shape {tuple(hidden.shape)} make {tokens} video tokens (frames/{p_t} · "
                f"height/{p_h} · width/{p_w}), not divisible by actor.sequence_parallel_size={sp_size}: "
                "choose rollout.pipeline num_frames/height/width whose token count the size divides, "
                "or a size that divides it"
            )

    return check


class UlyssesSequenceParallel:
    """Ulysses over the mesh's `ulysses` dimension for one transformer, switched on and off.

    Built once, on every rank (it forms the flattened context-parallel group, a collective);
    `attach()` installs the context-parallel hooks and `detach()` removes them, both local and
    cheap, so one module can sample without SP (each rank its own prompts) and train with it
    (`active()`, around the training forwards and backwards). While attached, every rank of an
    SP group must call the transformer with the same inputs (the same micro-batch, the same
    text) in the same order: each forward is a collective. The output is the full one on every rank.
    """

    def __init__(self, transformer: nn.Module, mesh: DeviceMesh):
        from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

        if tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
            raise ValueError(
                f"mesh dims {mesh.mesh_dim_names} are not {MESH_DIMS}: use sequence_parallel_mesh()"
            )
        if getattr(transformer, "_parallel_config", None) is not None:
            raise ValueError(f"{type(transformer).__name__} already runs in parallel: set up Ulysses once")
        self.transformer, self.mesh = transformer, mesh
        self.sp_size, self.dp_size = mesh["ulysses"].size(), mesh["dp"].size()
        check_ulysses_supported(transformer, self.sp_size)
        self.config = ParallelConfig(
            context_parallel_config=ContextParallelConfig(ulysses_degree=self.sp_size, mesh=mesh)
        )
        device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else None
        self.config.setup(dist.get_rank(), dist.get_world_size(), device or torch.device("cpu"), mesh=mesh)
        self._check: torch.utils.hooks.RemovableHandle | None = None

    @property
    def attached(self) -> bool:
        return self._check is not None

    def attach(self) -> None:
        """Install the split/gather hooks and the processors' parallel config (no communication)."""
        from diffusers.hooks.context_parallel import apply_context_parallel

        if self.attached:
            raise ValueError("Ulysses is already attached to this transformer")
        transformer = self.transformer
        # re-checked: the attention backend may have changed since construction
        check_ulysses_supported(transformer, self.sp_size)
        for module in _attention_modules(transformer):
            module.processor._parallel_config = self.config
        apply_context_parallel(transformer, self.config.context_parallel_config, transformer._cp_plan)
        transformer._parallel_config = self.config
        self._check = transformer.register_forward_pre_hook(_token_check_hook(self.sp_size), with_kwargs=True)

    def detach(self) -> None:
        """Undo `attach`: the transformer runs on this rank's inputs alone again."""
        from diffusers.hooks.context_parallel import remove_context_parallel

        if not self.attached:
            raise ValueError("Ulysses is not attached to this transformer: nothing to detach")
        transformer = self.transformer
        remove_context_parallel(transformer, transformer._cp_plan)
        for module in _attention_modules(transformer):
            module.processor._parallel_config = None
        transformer._parallel_config = None
        self._check.remove()
        self._check = None

    @contextmanager
    def active(self) -> Iterator[None]:
        """Attached for the body (training forwards and backwards), detached after."""
        self.attach()
        try:
            yield
        finally:
            self.detach()

    def reduce_gradients_with_fsdp(self) -> int:
        """Make FSDP2's gradient reduction sum within each SP group and average over DP replicas.

        For a transformer sharded with FSDP2 over all dp·sp ranks (`shard_transformer`'s default
        mesh): every FSDP module divides its summed gradients by dp instead of dp·sp. Returns the
        number of FSDP modules set. Call after sharding, on every rank.
        """
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        modules = [m for m in self.transformer.modules() if isinstance(m, FSDPModule)]
        if not modules:
            raise ValueError(
                f"{type(self.transformer).__name__} is not sharded with FSDP2: shard it first, or sum the "
                "gradients with all_reduce_gradients"
            )
        world = self.dp_size * self.sp_size
        for module in modules:
            # The mesh from the module's sharded parameters (DTensors), not FSDP's private state,
            # whose layout differs between torch releases (2.11 has one param group, later lists).
            fsdp_ranks = next(p for p in module.parameters() if isinstance(p, DTensor)).device_mesh.size()
            if fsdp_ranks != world:
                raise ValueError(
                    f"FSDP shards over {fsdp_ranks} ranks but the SP mesh has dp·sp = {self.dp_size}·"
                    f"{self.sp_size}: shard over the whole world (shard_transformer's default mesh)"
                )
            # A plain SUM, then the division by dp (a pre-multiplied sum is NCCL-only; gloo lacks it).
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(float(self.dp_size))
        return len(modules)

    @torch.no_grad()
    def all_reduce_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Sum each parameter's gradient over its SP group (no FSDP; after the last backward,
        before the optimizer step)."""
        group = self.mesh["ulysses"].get_group()
        for param in params:
            if param.grad is not None:
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)


def for_training(adapter, cfg, strategy: str | None = None) -> UlyssesSequenceParallel | None:
    """The training engine's SP (None for `actor.sequence_parallel_size` 1), set up on every rank;
    `strategy`: the engine's (the run plan's), actor.strategy when not given.

    Call after the `TrainEngine` is built (LoRA injected, transformer sharded). Sets FSDP2's
    reduction to sum over each SP group; the caller attaches it (`active()`) around the training
    forwards and backwards only, and the controller hands the ranks of one SP group the same
    micro-batches (`diffrl.controller.policy_gradient`).
    """
    from diffrl.config.schema import POLICY_GRADIENT

    size = cfg.actor.sequence_parallel_size
    if size == 1:
        return None
    if cfg.algorithm.trainer_type != POLICY_GRADIENT:
        raise ValueError(
            f"actor.sequence_parallel_size={size} is wired for the policy-gradient loop only, not "
            f"algorithm.trainer_type={cfg.algorithm.trainer_type}: set actor.sequence_parallel_size=1"
        )
    if not adapter.is_video:
        raise ValueError(
            f"actor.sequence_parallel_size={size} splits video tokens; {type(adapter).__name__} is an "
            "image model: set actor.sequence_parallel_size=1"
        )
    if (strategy or cfg.actor.strategy) != "fsdp2" or not dist.is_initialized():
        raise ValueError(
            f"actor.sequence_parallel_size={size} needs actor.strategy=fsdp2 over several workers "
            f"(trainer.n_gpus_per_node × trainer.nnodes a multiple of {size})"
        )
    sp = UlyssesSequenceParallel(adapter.transformer, sequence_parallel_mesh(size))
    sp.reduce_gradients_with_fsdp()
    return sp


__all__ = [
    "MESH_DIMS",
    "UlyssesSequenceParallel",
    "check_ulysses_supported",
    "for_training",
    "sequence_parallel_mesh",
]
