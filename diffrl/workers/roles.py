"""Worker roles: plain classes that a Ray actor (or a test, in-process) hosts, one per GPU.

    RolloutWorker    a sampler on its own copy of the model (weights arrive by `load_weights`)
    ActorWorker      the training engine
    HybridWorker     actor and sampler sharing one module in one process: no weight copy at all
    ReferenceWorker  a frozen copy for the KL term when full fine-tuning (LoRA needs none)

Colocation is the controller's placement decision: it picks HybridWorker, or ActorWorker plus
RolloutWorker on different GPUs; the classes carry no flags about it. Each role builds its model
from the config inside its own process, so nothing large crosses the controller.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from diffrl.config.schema import Config
from diffrl.models import load_model
from diffrl.models.base import ModelAdapter
from diffrl.rollout.sampler import TrajectorySampler
from diffrl.rollout.types import Rollout
from diffrl.train.engine import POLICY, REFERENCE, TrainEngine
from diffrl.train.lora import inject_lora


def worker_device() -> torch.device:
    """This process's device: its local GPU when there is one, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    # Ray gives each GPU actor one visible device (cuda:0); torchrun shows all, indexed by LOCAL_RANK.
    if torch.cuda.device_count() == 1:
        return torch.device("cuda", 0)
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def join_process_group() -> None:
    """Form the workers' torch.distributed group from the env vars the WorkerGroup set."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
        from diffrl.train.distributed import init_distributed

        init_distributed()


class RolloutWorker:
    """Samples trajectories; in the non-colocated placement its weights come from the actor."""

    def __init__(self, cfg: Config, adapter: ModelAdapter | None = None):
        self.cfg = cfg
        if adapter is None:  # its own model: the same LoRA layout as the actor's, to receive its weights
            adapter = load_model(cfg.model.path, cfg.model.dtype, worker_device())
            if cfg.model.lora.rank > 0:
                inject_lora(adapter, cfg.model.lora, [POLICY], seed=cfg.trainer.seed)
        self.adapter = adapter
        self.sampler = TrajectorySampler(self.adapter, cfg.rollout, progress=False)

    def sample(
        self,
        prompts: Sequence[str],
        *,
        seed: int,
        step: int,
        uids: Sequence[str] | None = None,
        metadata: Sequence[dict[str, Any]] | None = None,
    ) -> Rollout:
        return self.sampler.sample(prompts, seed=seed, step=step, uids=uids, metadata=metadata)

    def sample_validation(
        self,
        prompts: Sequence[str],
        *,
        uids: Sequence[str] | None = None,
        metadata: Sequence[dict[str, Any]] | None = None,
    ) -> Rollout:
        return self.sampler.sample_validation(prompts, uids=uids, metadata=metadata)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy streamed (name, tensor) pairs into the transformer; returns how many were loaded.

        Names are the actor's parameter names; an unknown name is an error (a model mismatch must
        not pass silently).
        """
        params = dict(self.adapter.transformer.named_parameters())
        count = 0
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(
                    f"weight {name!r} does not exist in the rollout model: actor and rollout differ"
                )
            params[name].copy_(tensor)
            count += 1
        return count


class ActorWorker:
    """The training engine in a worker process."""

    def __init__(self, cfg: Config, adapter: ModelAdapter | None = None, *, with_old: bool = False):
        join_process_group()
        self.cfg = cfg
        adapter = adapter or load_model(cfg.model.path, cfg.model.dtype, worker_device())
        mini_batches = cfg.images_per_step // cfg.actor.mini_batch_size
        self.engine = TrainEngine(
            adapter,
            cfg.model,
            cfg.actor,
            total_optim_steps=cfg.trainer.total_steps * mini_batches * cfg.actor.epochs,
            with_old=with_old,
            seed=cfg.trainer.seed,
        )

    def forward_backward(self, micro_batches: Sequence[Rollout], window_steps: Sequence[int] | None = None):
        device = self.engine.adapter.device
        return self.engine.forward_backward([mb.to(device) for mb in micro_batches], window_steps)

    def optim_step(self) -> dict[str, float]:
        return self.engine.optim_step()

    def log_probs(self, rollout: Rollout, policy: str = POLICY) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs, means = self.engine.log_probs(rollout.to(self.engine.adapter.device), policy)
        return log_probs.cpu(), means.cpu()

    def copy_adapter(self, src: str, dst: str) -> None:
        self.engine.copy_adapter(src, dst)

    def ema_adapter(self, decay: float, src: str, dst: str) -> None:
        self.engine.ema_adapter(decay, src, dst)

    def save(self, root: str, step: int, extra: dict, keep_last: int) -> str:
        return str(self.engine.save(root, step, extra, keep_last))

    def load(self, path: str) -> dict:
        return self.engine.load(path)

    def export_lora(self, out_dir: str) -> str:
        return str(self.engine.export_lora(Path(out_dir)))

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of what the rollout side needs: the trained adapter, or all weights."""
        from diffrl.train.export import iter_weights

        return iter_weights(self.engine.transformer, adapter_only=self.engine.lora)


class HybridWorker(ActorWorker):
    """Actor and sampler on one module: new weights reach the sampler without any copy."""

    def __init__(self, cfg: Config, adapter: ModelAdapter | None = None, *, with_old: bool = False):
        super().__init__(cfg, adapter, with_old=with_old)
        self.rollout = RolloutWorker(cfg, self.engine.adapter)

    def sample(self, prompts: Sequence[str], **kwargs) -> Rollout:
        with torch.no_grad():
            return self.rollout.sample(prompts, **kwargs)

    def sample_validation(self, prompts: Sequence[str], **kwargs) -> Rollout:
        return self.rollout.sample_validation(prompts, **kwargs)


class ReferenceWorker:
    """The frozen base model, for the KL term of full fine-tuning on its own GPU."""

    def __init__(self, cfg: Config, adapter: ModelAdapter | None = None):
        self.adapter = adapter or load_model(cfg.model.path, cfg.model.dtype, worker_device())
        self.adapter.transformer.requires_grad_(False).eval()
        self.micro_batch_size = cfg.actor.micro_batch_size

    @torch.no_grad()
    def means(self, rollout: Rollout) -> torch.Tensor:
        """The reference SDE means [B, W, ...] of the rollout's window steps."""
        from diffrl.rollout.sampler import evaluate_step

        rollout = rollout.to(self.adapter.device)
        chunks = []
        for start in range(0, len(rollout), self.micro_batch_size):
            mb = rollout.select(slice(start, start + self.micro_batch_size))
            chunks.append(
                torch.stack([evaluate_step(self.adapter, mb, j).mean for j in range(mb.window_size)], 1)
            )
        return torch.cat(chunks).cpu()


__all__ = ["REFERENCE", "ActorWorker", "HybridWorker", "ReferenceWorker", "RolloutWorker", "worker_device"]
