"""Policies of one trained module, and the one log-prob pass that the trainer and the replicas run.

A LoRA-injected transformer holds several policies: `default` (the trained adapter), optionally
`old` (a frozen copy refreshed by copy or EMA, for DiffusionNFT-style methods), and the
`reference`: every adapter disabled, the base model. Full fine-tuning (`model.lora.rank = 0`) has
only the trained weights; its reference, when KL needs one, is a frozen copy of the transformer
swapped in for the pass.

`use_policy` switches the module to a policy for the length of a block; `window_log_probs` is the
pass without gradient over a rollout's SDE window steps under a policy: PPO's old log-probs when
they are recomputed, the reference's SDE means for KL, the `old` policy's. The trainer
(`TrainEngine.log_probs`) and a rollout replica (`RolloutWorker.evaluate`) both call it, so on the
same weights and the same micro-batches their results are equal bit for bit; where the old
log-probs of a run come from (reused from the rollout, recomputed on the trainer, or on the
replicas) is the run plan's rule (diffrl.config.plan.old_log_probs_source).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from diffrl.models.base import ModelAdapter
from diffrl.train.lora import lora_policy
from diffrl.transition import Rollout, evaluate_window

POLICY = "default"
OLD = "old"
REFERENCE = "reference"


@contextmanager
def use_policy(
    adapter: ModelAdapter, name: str, *, lora: bool, reference: torch.nn.Module | None = None
) -> Iterator[None]:
    """Run the adapter's transformer as policy `name` (default, old or reference) inside the block.

    `lora`: whether the transformer has LoRA adapters (`old` is one, the reference disables them
    all); without, `reference` is the frozen copy swapped in for the reference policy (None: there
    is none)."""
    if name == POLICY:
        yield
        return
    if name == OLD:
        if not lora:
            raise ValueError("no `old` policy: it exists only with LoRA adapters (model.lora.rank > 0)")
        with lora_policy(adapter.transformer, OLD, POLICY):
            yield
        return
    if name == REFERENCE:
        if lora:
            with lora_policy(adapter.transformer, None, POLICY):
                yield
            return
        if reference is None:
            raise ValueError(
                "no reference model: full fine-tuning keeps a frozen copy only on the trainer, and "
                "only when KL is on (actor.loss.kl_coef > 0)"
            )
        trained = adapter.pipe.transformer
        adapter.pipe.transformer = reference
        try:
            yield
        finally:
            adapter.pipe.transformer = trained
        return
    raise ValueError(f"unknown policy {name!r}; choose {POLICY}, {OLD} or {REFERENCE}")


def window_log_probs(
    adapter: ModelAdapter,
    rollout: Rollout,
    policy: str,
    *,
    lora: bool,
    micro_batch_size: int,
    steps_per_forward: int = 1,
    as_trained: bool | None = None,
    reference: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_probs_BW, means [B, W, ...]) of the rollout's window steps under `policy`, detached.

    The update's own math, in its own micro-batches: `transition.evaluate_window` over slices of
    `micro_batch_size` (actor.micro_batch_size), `steps_per_forward` window steps a forward
    (actor.replay_steps_per_forward), with the module switched by `use_policy`. `as_trained` None
    is the rule: the trained policy runs with grad on (and its graph dropped) when the module trains
    through compiled blocks (`ModelAdapter.trains_through_compiled_graph`: compiled, the graph
    without grad rounds differently, and the update runs the grad one), every other pass without
    grad."""
    if as_trained is None:
        as_trained = policy == POLICY and adapter.trains_through_compiled_graph
    with use_policy(adapter, policy, lora=lora, reference=reference):
        return evaluate_window(
            adapter, rollout, micro_batch_size, as_trained=as_trained, steps_per_forward=steps_per_forward
        )


def adapter_pairs(
    transformer: torch.nn.Module, src: str, dst: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(src tensor, dst tensor) for every LoRA weight of adapter `src` and its twin in `dst`."""
    params = dict(transformer.named_parameters())
    pairs = [(p, params[n.replace(f".{src}.", f".{dst}.")]) for n, p in params.items() if f".{src}." in n]
    if not pairs:
        raise ValueError(f"no LoRA adapter named {src!r} to copy from")
    return pairs


@torch.no_grad()
def copy_adapter(transformer: torch.nn.Module, src: str = POLICY, dst: str = OLD) -> None:
    """dst ← src on every LoRA tensor."""
    for s, d in adapter_pairs(transformer, src, dst):
        d.copy_(s)


@torch.no_grad()
def ema_adapter(transformer: torch.nn.Module, decay: float, src: str = POLICY, dst: str = OLD) -> None:
    """dst ← decay·dst + (1 − decay)·src on every LoRA tensor (decay 0 = copy)."""
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"EMA decay {decay} must be in [0, 1]")
    for s, d in adapter_pairs(transformer, src, dst):
        d.mul_(decay).add_(s, alpha=1.0 - decay)


def adapters_equal(transformer: torch.nn.Module, a: str, b: str, device: torch.device) -> bool:
    """Whether LoRA adapters `a` and `b` hold identical weights on every rank of the process group
    (False without both): all ranks must agree, since it decides how many forward passes each
    runs. The `old` adapter equals the trained one after a copy or an EMA at decay 0 (until the
    next optimizer step); the old policy's velocity is then the trained one's, detached."""
    if not any(f".{b}." in n for n, _ in transformer.named_parameters()):
        return False
    local = lambda t: getattr(t, "_local_tensor", t)  # noqa: E731  (an FSDP2 rank's own shard)
    # one flag on the device and one host sync, not one per tensor: this runs every optimizer step
    differs = torch.stack(
        [torch.ne(local(x), local(y)).any() for x, y in adapter_pairs(transformer, a, b)]
    ).any()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        flag = differs.to(device=device, dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        differs = flag
    return not bool(differs.item())


__all__ = [
    "OLD",
    "POLICY",
    "REFERENCE",
    "adapter_pairs",
    "adapters_equal",
    "copy_adapter",
    "ema_adapter",
    "use_policy",
    "window_log_probs",
]
