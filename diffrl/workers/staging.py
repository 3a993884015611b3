"""A step's trajectories on the trainer ranks: how they travel, and the rows each rank holds.

Sampled rollouts and the SDE means computed from them are latent-sized (SD3.5-M at 512², 9 trained
steps: about 5 MB per trajectory). They never pass through the controller:

- handed over (`handed_over` / `fetched`): in a Ray worker the producer puts the object in Ray's
  object store and returns the reference; whichever rank needs it fetches it (a copy through the
  object store, serialised and deserialised). In process the object itself travels.
- kept (`LocalStore.keep`): colocated, when the mini-batch schedule deals every rank the groups
  it sampled itself (diffrl.controller.minibatches), the producer keeps the object and returns a
  `Kept` marker, which the controller hands back to the same rank: no copy at all.

`StagedRows` is what a rank holds of one step: the contiguous rows [first, first + len) of the
step's rollout (all of them when trajectories are handed over), addressed by the step's row
numbers, and their training targets. `StagedStep` is the worker's part (diffrl.workers.roles) that
holds them and runs the policy-gradient passes over them: log-probs and forward/backward.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch

from diffrl.telemetry.profiling import profiled_call
from diffrl.train.batch import PolicyGradientBatch, TrainingTargets
from diffrl.train.engine import POLICY, TrainEngine
from diffrl.transition import Rollout, concat_rollouts


def handed_over(value: Any) -> Any:
    """`value` for another process: in a Ray worker an object reference to it (it stays in Ray's
    object store until a rank fetches it), in process the object itself."""
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
            return ray.put(value)
    return value


def fetched(parts: Sequence[Any]) -> list[Any]:
    """`handed_over`'s results as values, in order (object references fetched in one call)."""
    if "ray" not in sys.modules:
        return list(parts)
    import ray

    refs = [part for part in parts if isinstance(part, ray.ObjectRef)]
    values = iter(ray.get(refs)) if refs else iter(())
    return [next(values) if isinstance(part, ray.ObjectRef) else part for part in parts]


@dataclass(frozen=True)
class Kept:
    """Stands for a value its producer kept (`LocalStore`): only that worker can resolve it."""

    name: str


class LocalStore:
    """Values a worker kept for itself, each resolved once (`resolve`)."""

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}

    def keep(self, name: str, value: Any) -> Kept:
        self._values[name] = value
        return Kept(name)

    def resolve(self, parts: Sequence[Any]) -> list[Any]:
        """`parts` as values: `Kept` markers from this store (each taken out), the rest `fetched`."""
        missing = [p.name for p in parts if isinstance(p, Kept) and p.name not in self._values]
        if missing:
            raise RuntimeError(
                f"kept values {missing} are not on this worker: a Kept marker went to another rank "
                "than the one that made it"
            )
        local = {i: self._values.pop(p.name) for i, p in enumerate(parts) if isinstance(p, Kept)}
        rest = iter(fetched([p for p in parts if not isinstance(p, Kept)]))
        return [local[i] if i in local else next(rest) for i in range(len(parts))]


class StagedRows:
    """Rows [first, first + len(rollout)) of a step's rollout, and (once set) their targets."""

    def __init__(self, rollout: Rollout, first: int):
        self.rollout = rollout
        self.first = first
        self.targets: TrainingTargets | None = None

    def local(self, rows: slice | torch.Tensor) -> slice | torch.Tensor:
        """The step's row numbers `rows` as indices into this rank's rows (they must be held here)."""
        end = self.first + len(self.rollout)
        if isinstance(rows, slice):
            start, stop = rows.start or 0, len(self.rollout) + self.first if rows.stop is None else rows.stop
            if not self.first <= start <= stop <= end:
                raise RuntimeError(
                    f"rows {start}:{stop} are not staged on this rank (it holds {self.first}:{end})"
                )
            return slice(start - self.first, stop - self.first)
        if len(rows) and not (self.first <= int(rows.min()) and int(rows.max()) < end):
            raise RuntimeError(
                f"rows {rows.tolist()} are not staged on this rank (it holds {self.first}:{end})"
            )
        return rows - self.first

    def set_targets(self, targets: TrainingTargets, means: dict[str, list[torch.Tensor]]) -> None:
        """The step's targets (all rows: cut to the ones held here) and the SDE means of the held
        rows (`means`: pieces in row order, together exactly the held rows)."""
        targets = targets[self.first : self.first + len(self.rollout)]
        for name, pieces in means.items():
            value = torch.cat(pieces)
            if len(value) != len(self.rollout):
                raise RuntimeError(f"{name}: {len(value)} rows of means for {len(self.rollout)} staged rows")
            setattr(targets, name, value)
        self.targets = targets

    def batch(self, rows: torch.Tensor) -> PolicyGradientBatch:
        if self.targets is None:
            raise RuntimeError(
                "staged_forward_backward before stage_targets: the controller sets the targets first"
            )
        return PolicyGradientBatch(self.rollout, self.targets).select(self.local(rows)).compact()


class StagedStep:
    """The step's rollout held on this rank, and the engine's policy-gradient passes over it.

    The controller stages this rank's rows (`stage`), asks for their log-probs (`staged_log_probs`),
    sets their targets (`stage_targets`) and trains on micro-batches of them
    (`staged_forward_backward`); the worker's methods of those names call these. `kept` holds what
    this worker sampled or computed for its own rows (colocated, `Kept` markers)."""

    def __init__(self, engine: TrainEngine, sequence_parallel: Any = None):
        self.engine = engine
        self.sequence_parallel = sequence_parallel  # Ulysses SP, attached only while training
        self.kept = LocalStore()
        self.staged: StagedRows | None = None
        # the prompt length (and condition tokens) of the last trained micro-batch (phase FLOPs)
        self.text_len = 0
        self.cond_tokens = 0

    @profiled_call
    def stage(self, parts: Sequence[Any], first_row: int = 0) -> None:
        """Take this rank's rows of the step's rollout: the samplers' pieces in order, starting at
        row `first_row` (object references fetched here, `Kept` markers resolved from `kept`).
        Later calls name samples by the step's row numbers; the tensors never pass through the
        controller."""
        self.staged = StagedRows(concat_rollouts(self.kept.resolve(parts)), first_row)

    @profiled_call
    def staged_log_probs(
        self, rows: slice, policy: str = POLICY, keep: bool = False
    ) -> tuple[torch.Tensor, Any]:
        """(log-probs [R, W] on the CPU, the SDE means) of the staged rows under `policy`. The means
        are latent-sized: handed over (an object reference in a Ray worker) for `stage_targets` on
        whichever ranks train those rows, or with `keep` kept here for this rank's own."""
        staged = self.staged.rollout.select(self.staged.local(rows)).compact()
        log_probs, means = self.log_probs(staged, policy)
        return log_probs, self.kept.keep(f"means/{policy}", means) if keep else handed_over(means)

    @profiled_call
    def stage_targets(self, targets: TrainingTargets, means: Mapping[str, Sequence[Any]]) -> None:
        """The step's per-sample training targets: the controller's (advantages, old log-probs,
        weights, step mask; all rows) plus the SDE means `staged_log_probs` computed, by field name
        (`old_means`, `ref_means`), each the pieces that cover this rank's rows, in row order."""
        self.staged.set_targets(targets, {name: self.kept.resolve(p) for name, p in means.items()})

    @profiled_call
    def staged_forward_backward(self, micro_rows: Sequence[torch.Tensor]) -> dict[str, float]:
        """`forward_backward` of the staged rows, one micro-batch per entry of `micro_rows`."""
        return self.forward_backward([self.staged.batch(rows) for rows in micro_rows])

    # ------------------------------------------------------------------------ the engine's passes
    @profiled_call
    def forward_backward(
        self, micro_batches: Sequence[PolicyGradientBatch], window_steps: Sequence[int] | None = None
    ):
        """Accumulate the policy-gradient loss's gradient of `micro_batches` (`TrainEngine`)."""
        if micro_batches:  # the prompt length (and condition tokens) this step trains with
            self.text_len = micro_batches[0].rollout.prompt_embeds.embeds.shape[1]
            self.cond_tokens = micro_batches[0].rollout.prompt_embeds.cond_tokens
        sp = self.sequence_parallel
        with sp.active() if sp is not None else nullcontext():
            return self.engine.forward_backward(
                _to_device(micro_batches, self.engine.adapter.device), window_steps
            )

    @profiled_call
    def log_probs(
        self, rollout: Rollout, policy: str = POLICY, as_trained: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, SDE means) on the CPU of the rollout's window steps under `policy`.

        `as_trained` None: the trained policy's through the update's own graph when the blocks
        are compiled (the old log-probs PPO's ratio divides by are then the update's first
        forward bit for bit: compiled, no-grad is another graph), no grad otherwise."""
        if as_trained is None:
            as_trained = policy == POLICY and self.engine.adapter.trains_through_compiled_graph
        rollout = rollout.to(self.engine.adapter.device)
        log_probs, means = self.engine.log_probs(rollout, policy, as_trained=as_trained)
        return log_probs.cpu(), means.cpu()


def _to_device(
    micro_batches: Sequence[PolicyGradientBatch], device: torch.device
) -> list[PolicyGradientBatch]:
    """Move micro-batches to `device`, copying a prompt table they share only once."""
    tables: dict[int, Any] = {}
    moved = []
    for mb in micro_batches:
        key = id(mb.rollout.prompt_embeds)
        if key not in tables:
            tables[key] = mb.rollout.prompt_embeds.to(device)
        rollout = replace(mb.rollout.to_samples_device(device), prompt_embeds=tables[key])
        moved.append(PolicyGradientBatch(rollout, mb.targets.to(device)))
    return moved


__all__ = ["Kept", "LocalStore", "StagedRows", "StagedStep", "fetched", "handed_over"]
