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
numbers, and their training targets.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diffrl.train.batch import PolicyGradientBatch, TrainingTargets
from diffrl.transition import Rollout


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


__all__ = ["Kept", "LocalStore", "StagedRows", "fetched", "handed_over"]
