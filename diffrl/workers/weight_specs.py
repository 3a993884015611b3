"""What a weight sync streams, described: one `TensorSpec` (name, shape, dtype) per tensor.

The specs are the contract between the trainer and a replica, independent of how the bytes move:
the trainer's weight source builds them from metadata only (`tensor_specs`), the controller hands
them to each replica's `receive`, which checks them against its own model (`check_specs`) before
anything moves, and the stream carries each bucket's spec list as JSON (`_spec_blob`,
`_parse_blob`: nothing received is unpickled) for the replica to compare with that list. After the
stream the source's digests of what it sent meet the replica's of what it wrote into
(`digest_table`, `differing_digests`). They are
apart from `weight_sync` (the process group and its protocol) because the weight source builds and
ships them without being in a group.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"unknown dtype {name!r} in a tensor spec: expected a torch dtype name such as 'float32'"
        )
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver must know about one tensor before its bytes arrive (small, JSON-able).

    `dtype` is torch's name without the `torch.` prefix ("float32", "bfloat16"); `torch_dtype`
    turns it back into the dtype.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(int(s) for s in tensor.shape), _dtype_name(tensor.dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _dtype_from_name(self.dtype)

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.torch_dtype.itemsize

    def to_json(self) -> list:
        return [self.name, list(self.shape), self.dtype]

    @classmethod
    def from_json(cls, item: list) -> TensorSpec:
        name, shape, dtype = item
        return cls(str(name), tuple(int(s) for s in shape), str(dtype))

    def describe(self) -> str:
        return f"shape {list(self.shape)} dtype {self.dtype}"


def tensor_specs(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    """Specs of (name, tensor) pairs, in order: what the controller hands each replica's `receive`.

    Only metadata is read; on FSDP2 a DTensor's `shape` is already the full (global) shape, so pass
    the module's `state_dict()` items (not `iter_weights`, which gathers) to avoid moving data.
    """
    return [TensorSpec.of(name, tensor) for name, tensor in named_tensors]


def check_specs(specs: Sequence[TensorSpec], params: Mapping[str, torch.Tensor]) -> None:
    """Raise ValueError unless every spec names a tensor of `params` with the same shape and dtype.

    All specs are checked before the error is raised, so one message lists every mismatch (a model
    built with a different config usually differs in many tensors at once).
    """
    problems = []
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            problems.append(f"{spec.name!r} appears twice in the spec list")
            continue
        seen.add(spec.name)
        target = params.get(spec.name)
        if target is None:
            problems.append(f"{spec.name!r} ({spec.describe()}) does not exist in the receiving model")
            continue
        have = TensorSpec.of(spec.name, target)
        if have != spec:
            problems.append(
                f"{spec.name!r}: the sender streams {spec.describe()}, the receiver has {have.describe()}"
            )
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ValueError(
            f"weight sync: {len(problems)} tensor(s) do not match the receiving model: {shown}. "
            "Trainer and rollout replicas must build the same model (same config, same LoRA settings)."
        )


def _spec_blob(specs: Sequence[TensorSpec]) -> torch.Tensor:
    raw = json.dumps([spec.to_json() for spec in specs], separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _parse_blob(blob: torch.Tensor) -> list[TensorSpec]:
    # JSON only: nothing received over the network is unpickled or executed.
    return [TensorSpec.from_json(item) for item in json.loads(bytes(blob.cpu().tolist()).decode())]


# -------------------------------------------------------------------------------------- digests
#: The difference of two digests, relative to the sum of |x|, above which they are other tensors.
DIGEST_RTOL = 1e-7


def _digest_pair(tensor: torch.Tensor) -> torch.Tensor:
    x = tensor.detach()
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = x.to(torch.float64)  # integers, bools, fp8: the same values on both sides
    return torch.stack([x.sum(dtype=torch.float64), torch.linalg.vector_norm(x, 1, dtype=torch.float64)])


def digest_table(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor]:
    """(names, float64[n, 2] on the tensors' device): each tensor's (sum, sum |x|).

    Computed on each side of a sync from the tensor as it is held, in its own dtype: a sync copies
    bytes and never casts, so both sides add up the same values, and only the order of the
    additions can differ (another device, another reduction tree). That moves a float64 sum by far
    less than `DIGEST_RTOL` of the sum of |x|, while a tensor that was not written, or written
    from another tensor, differs by far more. No number moves to the host per tensor: the caller
    reads the table once.
    """
    names, pairs = [], []
    for name, tensor in named:
        names.append(name)
        pairs.append(_digest_pair(tensor))
    if not pairs:
        return names, torch.zeros(0, 2, dtype=torch.float64)
    device = pairs[0].device
    return names, torch.stack([pair.to(device) for pair in pairs])


def digests_match(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two (sum, sum |x|) digests are the same tensor's. NaN and inf equal themselves: a
    diverged trainer is reported by its own checks, not as a tensor lost on the way."""
    scale = max((abs(x) for x in (a[1], b[1]) if math.isfinite(x)), default=0.0)
    for x, y in zip(a, b, strict=True):
        if not (math.isfinite(x) and math.isfinite(y)):
            if not (x == y or (math.isnan(x) and math.isnan(y))):
                return False
        elif abs(x - y) > DIGEST_RTOL * scale:
            return False
    return True


def differing_digests(names: Sequence[str], sent: torch.Tensor, held: torch.Tensor) -> list[str]:
    """The names whose digest rows in `sent` and `held` (float64[n, 2] tables) differ."""
    rows = zip(names, sent.cpu().tolist(), held.cpu().tolist(), strict=True)
    return [name for name, a, b in rows if not digests_match(a, b)]
