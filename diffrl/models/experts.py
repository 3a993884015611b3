"""Timestep experts: transformers of one architecture that each denoise a range of noise levels, as
one module (Wan2.2 A14B: a high-noise `transformer` and a low-noise `transformer_2`).

`WanPipeline` picks the expert per denoising step: `transformer` while the step's timestep t is at
or above `boundary_ratio · num_train_timesteps`, `transformer_2` below it. `TimestepExperts` is
that rule as an `nn.Module` whose children are the experts under the pipeline's component names,
so everything diffrl does to "the transformer" (LoRA injection through diffusers' PEFT
integration, FSDP2 by block class, compile, activation checkpointing, checkpoints, weight sync by
state-dict key, digests) covers both experts at once: an adapter named `default` spans the
modules of both, and the keys are `transformer.<module>` and `transformer_2.<module>`. Each
forward routes each sample by its own timestep, so a batch that mixes noise levels (the
forward-process losses draw t per sample) runs each part on its expert.

Under FSDP2 over several ranks each expert's forward is a collective (its parameters are
all-gathered), so every rank must run the same experts in the same order: the ranks agree on
which experts a forward needs (one all-reduce of two flags), and a rank whose samples need none
of an expert others need runs it on one sample and adds 0 × that output (so its backward's
gradient reduction takes part too). The sampler and the policy-gradient window steps have one
timestep per call, the same on every rank, so they never pay this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers.loaders.peft import PeftAdapterMixin


class TimestepExperts(torch.nn.Module, PeftAdapterMixin):
    """`experts`: (component name, module) pairs from the highest noise level down; `boundaries`:
    the timesteps that separate them, descending (one fewer than experts). Sample i runs on the
    first expert whose boundary its timestep reaches (t >= boundary), else on the last."""

    def __init__(self, experts: Sequence[tuple[str, torch.nn.Module]], boundaries: Sequence[float]):
        super().__init__()
        if len(experts) < 2 or len(boundaries) != len(experts) - 1:
            raise ValueError(
                f"TimestepExperts needs at least two experts and one boundary between each pair "
                f"(got {len(experts)} experts, {len(boundaries)} boundaries)"
            )
        if list(boundaries) != sorted(boundaries, reverse=True):
            raise ValueError(
                f"boundaries {list(boundaries)} must be in descending order (highest noise first)"
            )
        self.names = [name for name, _ in experts]
        for name, module in experts:
            self.add_module(name, module)
        self.boundaries = [float(b) for b in boundaries]

    # ------------------------------------------------------------------------ what callers ask of a transformer
    @property
    def experts(self) -> list[torch.nn.Module]:
        return [getattr(self, name) for name in self.names]

    @property
    def config(self):
        """The first expert's config: the experts share one architecture (checked by the family)."""
        return self.experts[0].config

    @property
    def dtype(self) -> torch.dtype:
        return self.experts[0].dtype

    @property
    def device(self) -> torch.device:
        return self.experts[0].device

    def set_attention_backend(self, backend: str) -> None:
        for expert in self.experts:
            expert.set_attention_backend(backend)

    def enable_gradient_checkpointing(self) -> None:
        for expert in self.experts:
            expert.enable_gradient_checkpointing()

    @property
    def _supports_gradient_checkpointing(self) -> bool:
        return all(getattr(e, "_supports_gradient_checkpointing", False) for e in self.experts)

    # ------------------------------------------------------------------------ routing
    def expert_index(self, timestep: torch.Tensor) -> torch.Tensor:
        """[B] index of the expert for each sample's timestep ([B], or [B, tokens]: the first)."""
        t = timestep.reshape(timestep.shape[0], -1)[:, 0].float() if timestep.dim() else timestep.reshape(1)
        index = torch.full(t.shape, len(self.boundaries), dtype=torch.long, device=t.device)
        for i, boundary in reversed(list(enumerate(self.boundaries))):
            index = torch.where(t >= boundary, torch.full_like(index, i), index)
        return index

    def forward(
        self, *, hidden_states: torch.Tensor, timestep: torch.Tensor, return_dict: bool = False, **kwargs
    ):
        if return_dict:
            raise ValueError(
                "TimestepExperts returns a tuple (return_dict=False), as diffrl calls transformers"
            )
        batch = hidden_states.shape[0]
        index = self.expert_index(timestep.expand(batch) if timestep.dim() == 0 else timestep)
        here = torch.bincount(index, minlength=len(self.names))  # this rank's samples per expert
        needed = here.clamp(max=1).to(torch.int32)
        if self._sharded_ranks():  # the experts every rank runs: the union of what each needs
            torch.distributed.all_reduce(needed, op=torch.distributed.ReduceOp.MAX)
        here_list, needed_list = here.tolist(), needed.tolist()  # the forward's one host sync
        inputs = {"hidden_states": hidden_states, "timestep": timestep, **kwargs}
        if sum(needed_list) == 1:  # one expert for the whole batch, on every rank
            return self.experts[needed_list.index(1)](**inputs, return_dict=False)
        out: torch.Tensor | None = None
        idle: list[torch.Tensor] = []
        for i, expert in enumerate(self.experts):
            if not needed_list[i]:
                continue
            if not here_list[i]:  # another rank needs this expert: run it on one sample, add 0 x it
                one = torch.zeros(1, dtype=torch.long)
                idle.append(expert(**_rows(inputs, one, batch), return_dict=False)[0])
                continue
            rows = (index == i).nonzero().flatten()
            part = expert(**_rows(inputs, rows, batch), return_dict=False)[0]
            if out is None:
                out = part.new_zeros((batch, *part.shape[1:]))
            out = out.index_copy(0, rows.to(out.device), part)
        assert out is not None
        for unused in idle:
            out = out + 0.0 * unused.sum().to(out.dtype)
        return (out,)

    def _sharded_ranks(self) -> bool:
        """Whether the experts are FSDP2-sharded over several ranks (each forward a collective):
        the engine shards the root, so its class (FSDP2 swaps in a subclass) says it."""
        from torch.distributed.fsdp import FSDPModule

        return (
            isinstance(self, FSDPModule)
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1
        )


def expert_lora_file(component: str) -> str:
    """The LoRA file of one expert in an export folder: diffusers' own name for `transformer`
    (what `pipe.load_lora_weights(DIR)` reads), `pytorch_lora_weights_<component>.safetensors`
    for the others (`load_lora_weights(DIR, weight_name=..., load_into_transformer_2=True)`)."""
    from diffusers.loaders.lora_base import LORA_WEIGHT_NAME_SAFE

    return (
        LORA_WEIGHT_NAME_SAFE
        if component == "transformer"
        else f"pytorch_lora_weights_{component}.safetensors"
    )


def trained_components(transformer: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(pipeline component name, module) of what diffrl trains: the experts, or the one transformer."""
    if isinstance(transformer, TimestepExperts):
        return list(zip(transformer.names, transformer.experts, strict=True))
    return [("transformer", transformer)]


def load_lora_kwargs(component: str) -> dict[str, Any]:
    """What `pipe.load_lora_weights` needs besides the folder to load `component`'s file of an export."""
    kwargs: dict[str, Any] = {"weight_name": expert_lora_file(component)}
    if component != "transformer":
        kwargs[f"load_into_{component}"] = True
    return kwargs


def _rows(inputs: dict[str, Any], rows: torch.Tensor, batch: int) -> dict[str, Any]:
    """`inputs` with every per-sample tensor (first dimension `batch`) cut to `rows`."""
    return {
        key: value.index_select(0, rows.to(value.device))
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch
        else value
        for key, value in inputs.items()
    }


__all__ = ["TimestepExperts", "expert_lora_file", "load_lora_kwargs", "trained_components"]
