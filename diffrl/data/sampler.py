"""The seeded, resumable prompt sampler: batches of (index, record), epoch after epoch, forever.

Order. Epoch e visits every record exactly once, in the order

    numpy.random.default_rng(derive_seed(DATA_STREAM, seed, e)).permutation(len(records))

(file order when shuffle=False). The order of an epoch is a pure function of (seed, e), so nothing
but the position in the stream, (epoch, position), needs saving to resume.

Batches. The stream is cut into consecutive batches of `batch_size`. With drop_last=False (the
default) a batch that reaches the end of an epoch continues into the next epoch's order, so no
record is skipped and every batch is full; such a batch may hold a record more than once (the end of one
epoch, the start of the next), and a batch_size above len(records) wraps over several epochs.
With drop_last=True every batch lies inside one epoch: the last len(records) % batch_size records
of each epoch's order are skipped (a different few each epoch when shuffling), and batch_size must
be <= len(records).

Resume. `state_dict()` is {"epoch", "position", "num_records"} (JSON-able): the next batch starts at
`position` in epoch `epoch`'s order. A sampler built with the same records, seed and shuffle that
loads it yields exactly the batches the uninterrupted sampler would have yielded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from diffrl.seeding import DATA_STREAM, derive_seed

T = TypeVar("T")

_STATE_KEYS = ("epoch", "position", "num_records")


def _is_count(value: Any, low: int = 0) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | np.integer) and value >= low


def state_problem(state: Any) -> str | None:
    """What makes `state` no `state_dict()` of any sampler, as a sentence, or None: checked before
    it is used (a checkpoint's extra.json stores it), without the records it will be loaded with."""
    if not isinstance(state, Mapping):
        return f"the sampler state is a {type(state).__name__}, not a mapping of {list(_STATE_KEYS)}"
    unknown = sorted(set(state) - set(_STATE_KEYS))
    if unknown:
        return f"unknown sampler state keys {unknown}: expected {list(_STATE_KEYS)}"
    for key in ("epoch", "position"):
        if not _is_count(state.get(key)):
            return f"sampler state {key}={state.get(key)!r} is invalid: must be an integer >= 0"
    if "num_records" in state:
        n = state["num_records"]
        if not _is_count(n, low=1):
            return f"sampler state num_records={n!r} is invalid: must be an integer >= 1"
        if state["position"] >= n:
            return f"sampler state position={state['position']!r} is invalid: must be < its num_records={n!r}"
    return None


class PromptSampler(Generic[T]):
    """Endless batches of `batch_size` (index into `records`, record) pairs; see the module docstring."""

    def __init__(
        self,
        records: Sequence[T],
        batch_size: int,
        *,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        self.records = list(records)
        n = len(self.records)
        if n == 0:
            raise ValueError("PromptSampler needs at least one record; the prompt files gave none")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} is invalid: must be an integer >= 1")
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"seed={seed!r} is invalid: must be an integer >= 0")
        if drop_last and batch_size > n:
            raise ValueError(
                f"batch_size={batch_size} is larger than the {n} records, so drop_last=True would drop "
                "every record: use drop_last=False (batches wrap into the next epoch) or more prompts"
            )
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self._epoch = 0
        self._position = 0
        self._order_epoch = -1
        self._order: np.ndarray = np.arange(0)

    @property
    def num_records(self) -> int:
        return len(self.records)

    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in (0-based)."""
        return self._epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The record indices of `epoch`, in the order they are drawn."""
        n = len(self.records)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng(derive_seed(DATA_STREAM, self.seed, epoch)).permutation(n)

    def next_batch(self) -> list[tuple[int, T]]:
        """The next `batch_size` (index, record) pairs."""
        n, size = len(self.records), self.batch_size
        self._skip_remainder()
        batch: list[tuple[int, T]] = []
        while len(batch) < size:
            order = self._current_order()
            take = min(size - len(batch), n - self._position)
            for index in order[self._position : self._position + take].tolist():
                batch.append((index, self.records[index]))
            self._position += take
            if self._position == n:
                self._epoch, self._position = self._epoch + 1, 0
        self._skip_remainder()
        return batch

    def __iter__(self) -> Iterator[list[tuple[int, T]]]:
        return self

    def __next__(self) -> list[tuple[int, T]]:
        return self.next_batch()

    # --------------------------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, int]:
        """Where the next batch starts; JSON-able. `num_records` guards against changed prompt files."""
        return {"epoch": self._epoch, "position": self._position, "num_records": len(self.records)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state_dict()`; raises ValueError for a malformed state or other records."""
        n = len(self.records)
        problem = state_problem(state)
        if problem is not None:
            raise ValueError(problem)
        if "num_records" in state and state["num_records"] != n:
            raise ValueError(
                f"the sampler state was saved with {state['num_records']} prompts but {n} are loaded now: "
                "the prompt files changed since the checkpoint; restore them to resume exactly, or start "
                "a new run (trainer.resume=off)"
            )
        if state["position"] >= n:
            raise ValueError(f"sampler state position={state['position']} is invalid: must be < {n} records")
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        self._skip_remainder()

    # ------------------------------------------------------------------------------- internals
    def _current_order(self) -> np.ndarray:
        if self._order_epoch != self._epoch:
            self._order, self._order_epoch = self.epoch_order(self._epoch), self._epoch
        return self._order

    def _skip_remainder(self) -> None:
        """drop_last: move to the next epoch when the rest of this one cannot fill a batch."""
        if self.drop_last and self._position + self.batch_size > len(self.records):
            self._epoch, self._position = self._epoch + 1, 0
