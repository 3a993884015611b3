"""Where the training engine's memory lives: host or accelerator (`TrainEngine.to` and the offload options).

    actor.optimizer_offload   the AdamW state waits in host memory, on the device only for its step
                              (`optimizer_on_device`)
    actor.activation_offload  what autograd saves for backward waits in pinned host memory
                              (`saved_tensors_offload`: torch's own `save_on_cpu`)
    TrainEngine.to(...)       the model, the AdamW state and the gradients moved by hand

docs/performance.md ("Memory: offload options") has their measured costs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch


def target_device(device: str, accelerator: torch.device) -> torch.device:
    """`TrainEngine.to`'s `device` argument: "cpu", or "device" (the accelerator the engine trains on)."""
    if device == "cpu":
        return torch.device("cpu")
    if device == "device":
        return accelerator
    raise ValueError(f"TrainEngine.to({device!r}): device must be 'cpu' or 'device' (the accelerator)")


def check_gradients_follow(
    modules: Sequence[torch.nn.Module], target: torch.device, *, model: bool, grad: bool
) -> None:
    """torch keeps a gradient on its parameter's device: moving only one of the two is an error
    while gradients exist that would have to part from their parameters."""
    if model == grad:
        return
    stranded = [
        name
        for module in modules
        for name, p in module.named_parameters()
        if p.grad is not None and p.grad.device != target
    ]
    if stranded:
        raise ValueError(
            f"TrainEngine.to(model={model}, grad={grad}): {len(stranded)} gradients (e.g. {stranded[0]!r}) "
            "would have to live apart from their parameters, which torch does not allow: pass "
            "model=True and grad=True together, or call it after optim_step (no gradients then)"
        )


def move_optimizer_state(
    optimizer: torch.optim.Optimizer, target: torch.device, accelerator: torch.device
) -> bool:
    """Move every non-scalar optimizer state tensor to `target`; True when anything moved."""
    moved = False
    for state in optimizer.state.values():
        for key, value in state.items():
            # 0-d tensors are the step counts, which AdamW keeps on the CPU unless fused or
            # capturable (then on the device): leaving them in place suits both.
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != target:
                # to the CPU: into pinned memory, asynchronously (synchronised below); back:
                # from that pinned memory, ordered before the step's kernels on the stream
                state[key] = value.to(target, non_blocking=True)
                moved = True
    if moved and target.type == "cpu" and accelerator.type == "cuda":
        # the host must not read the copies (a checkpoint, the next load) before they land
        torch.cuda.synchronize(accelerator)
    return moved


@contextmanager
def optimizer_on_device(
    optimizer: torch.optim.Optimizer, accelerator: torch.device, *, enabled: bool
) -> Iterator[None]:
    """With `actor.optimizer_offload` (`enabled`): the optimizer state on the accelerator inside,
    in host memory after."""
    if not enabled:
        yield
        return
    move_optimizer_state(optimizer, accelerator, accelerator)
    try:
        yield
    finally:
        if move_optimizer_state(optimizer, torch.device("cpu"), accelerator):
            release_cached_memory(accelerator)


def saved_tensors_offload(enabled: bool) -> AbstractContextManager[None]:
    """The context of one training forward: with `actor.activation_offload` (`enabled`) torch's
    own `save_on_cpu` (what autograd saves goes to pinned host memory until backward)."""
    if not enabled:
        return nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=True)


def release_cached_memory(accelerator: torch.device) -> None:
    """Return the caching allocator's free blocks to the device (after an offload)."""
    if accelerator.type == "cuda":
        torch.cuda.empty_cache()


__all__ = [
    "check_gradients_follow",
    "move_optimizer_state",
    "optimizer_on_device",
    "release_cached_memory",
    "saved_tensors_offload",
    "target_device",
]
