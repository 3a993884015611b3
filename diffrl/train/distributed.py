"""Process-group helpers: join the group from the launcher's environment, ask where we are, reduce metrics.

Every launcher diffrl uses (torchrun, the Ray `WorkerGroup`, the tests' `mp.spawn`) describes a
process by the same environment variables: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
`MASTER_PORT`. `init_distributed` reads them through torch's own `env://` rendezvous, so there
is one way in. NCCL is the backend when CUDA is available (GPU tensors, the fast path), gloo
otherwise (CPU tests, CPU runs).

Outside a process group the query helpers answer as a group of one (`rank() == 0`,
`world_size() == 1`, `barrier()` and `all_reduce_mean` do nothing), so single-device code needs
no branches.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

#: The variables `init_distributed` needs (torch's `env://` rendezvous reads them).
ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
BACKENDS = ("nccl", "gloo")


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def device_for_rank() -> torch.device:
    """This process's compute device: its GPU when CUDA is available, else the CPU.

    Two launch styles are covered: one process per GPU with every GPU visible (torchrun: the GPU
    is `cuda:LOCAL_RANK`), and one visible GPU per process (Ray with `num_gpus=1` sets
    `CUDA_VISIBLE_DEVICES`, so the GPU is `cuda:0` whatever `LOCAL_RANK` says).
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0)
    if "LOCAL_RANK" not in os.environ:
        if is_distributed():
            raise ValueError(
                f"{count} GPUs are visible but LOCAL_RANK is not set: launch with torchrun (which sets it), "
                "or set LOCAL_RANK, or make one GPU visible per process (CUDA_VISIBLE_DEVICES)"
            )
        return torch.device("cuda", torch.cuda.current_device())
    local_rank = _env_int("LOCAL_RANK")
    if not 0 <= local_rank < count:
        raise ValueError(
            f"LOCAL_RANK={local_rank} but only {count} GPUs are visible (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): start at most {count} processes per node"
        )
    return torch.device("cuda", local_rank)


def init_distributed(backend: str | None = None, timeout: timedelta = timedelta(minutes=10)) -> torch.device:
    """Join the default process group from `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR/PORT`.

    `backend`: "nccl" or "gloo"; None picks nccl when CUDA is available, else gloo. With NCCL the
    process's GPU is made current and bound to the group (`device_id`), which creates the
    communicator eagerly so a missing peer fails here rather than at the first collective.
    Returns this process's device (`device_for_rank()`). Calling it again in a process that has
    already joined with the same backend returns the device; a different backend is an error.
    """
    if not dist.is_available():
        raise RuntimeError(
            "this PyTorch build has no torch.distributed: install a build with distributed support"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise ValueError(
            f"backend={backend!r} is not one of {', '.join(BACKENDS)} (or None to choose by device)"
        )
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "backend='nccl' needs CUDA, which is not available here: use backend='gloo' (or None)"
        )
    if dist.is_initialized():
        current = dist.get_backend()
        if current != backend:
            raise ValueError(
                f"the process group is already initialized with backend {current!r}, not {backend!r}: "
                "call init_distributed once per process, with one backend"
            )
        return device_for_rank()

    missing = [name for name in ENV_VARS if name not in os.environ]
    if missing:
        raise ValueError(
            f"init_distributed needs the environment variables {', '.join(missing)} (all of {', '.join(ENV_VARS)}): "
            "launch with torchrun or diffrl's WorkerGroup, which set them, or set them yourself"
        )
    rank_, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if world < 1 or not 0 <= rank_ < world:
        raise ValueError(f"RANK={rank_} and WORLD_SIZE={world} are inconsistent: need 0 <= RANK < WORLD_SIZE")

    device = device_for_rank()
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(
        backend, init_method="env://", rank=rank_, world_size=world, timeout=timeout, **kwargs
    )
    return device


def join_one_rank_group(device: torch.device) -> None:
    """Form a process group of this process alone, for FSDP2 on one worker (a one-rank mesh).

    A one-worker run forms no group of workers, but FSDP2's `fully_shard` needs one: its units
    all-gather and reduce-scatter over the mesh, which on one rank copy the whole parameters and
    gradients through the same code as on several, so `actor.param_offload` (FSDP2's
    `CPUOffloadPolicy`) keeps the parameters in host memory between uses as it does with two
    ranks. The group's store is its own (`HashStore`: no port, no rendezvous); NCCL on a GPU,
    gloo on the CPU. A no-op inside a group (a process of a WorkerGroup has joined its own)."""
    if dist.is_initialized():
        return
    kwargs = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)


def shutdown_distributed() -> None:
    """Leave the default process group (a no-op outside one); call it at the end of a worker."""
    if is_distributed():
        dist.destroy_process_group()


def is_distributed() -> bool:
    """True inside an initialized default process group."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the default group (0 outside a group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Processes in the default group (1 outside a group)."""
    return dist.get_world_size() if is_distributed() else 1


def barrier() -> None:
    """Wait for every rank (a no-op outside a group)."""
    if is_distributed():
        dist.barrier()


def _collective_device() -> torch.device:
    """Where a tensor must live for the default group's backend: NCCL reduces CUDA tensors only."""
    return device_for_rank() if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_mean(values: dict[str, float]) -> dict[str, float]:
    """The mean over ranks of each value, with one collective for the whole dict.

    Every rank must pass the same keys (the order does not matter: they are sorted). A value that
    only some ranks have cannot be averaged this way; give it a neutral value on the others or
    reduce it separately. Computed in float64, so counters stay exact. Outside a group the values
    come back unchanged (as floats).
    """
    names = sorted(values)
    for name in names:
        value = values[name]
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"metric {name!r} is a tensor of shape {tuple(value.shape)}: pass a scalar")
        elif not isinstance(value, (int, float)):
            raise ValueError(f"metric {name!r} is {type(value).__name__}: pass a float")
    if not is_distributed():
        return {name: float(values[name]) for name in names}
    if not names:
        return {}
    packed = torch.tensor(
        [float(values[name]) for name in names], dtype=torch.float64, device=_collective_device()
    )
    dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    packed /= dist.get_world_size()
    return dict(zip(names, packed.tolist(), strict=True))


__all__ = [
    "all_reduce_mean",
    "barrier",
    "device_for_rank",
    "init_distributed",
    "is_distributed",
    "join_one_rank_group",
    "rank",
    "shutdown_distributed",
    "world_size",
]
