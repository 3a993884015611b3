"""No LoRA module goes missing silently: the adapter tensors that were trained, compared with those
that arrived (at a replica after a weight sync, in the model after a checkpoint load, in the file of
an export).

A dropped module is the field's most reported LoRA bug (a `to_out.0` that a key filter or a name
conversion skips): nothing fails, the module simply keeps its initial weights (LoRA's B = 0: the
base model's behaviour) and the samples are subtly not the trained policy's. So each hand-over
compares the two sides' {name: shape} maps, and after a sync a digest of each tensor, and stops
with `AdapterMismatchError` naming the modules (`check_adapter_tensors`).

The digest (`tensor_digests`) is (sum, sum of |x|) in float64, computed on each side from the
tensor as it is held, in its own dtype (a sync copies bytes, never casts, so both sides read the
same values). Only the order of the additions can differ (another device, another reduction
tree), which moves a float64 sum by far less than `DIGEST_RTOL` of the sum of |x|; a tensor that
was not written, or written from another tensor, differs by far more. NaN and inf compare equal
to themselves: a diverged trainer is reported by its own checks, not as a lost module.

Here (models/, below train/, rollout/ and workers/) because all three hand-overs use it and the
names it reasons about are peft's, as the families inject them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch

#: peft's adapter layer names: a key `<module>.<layer name>.<adapter>.<param>` is an adapter tensor.
ADAPTER_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
#: The relative difference of two digests (to the sum of |x|) above which they are different tensors.
DIGEST_RTOL = 1e-7
#: How many modules a message names per kind of difference; the rest are counted.
NAMED = 10

Digest = tuple[float, float]


class AdapterMismatchError(ValueError):
    """The adapter tensors that arrived are not the ones trained; the message names the modules.

    A ValueError, so a command reports it in one line (exit 2) and a worker's failure carries it.
    `missing`, `unexpected` and `differing` hold the tensor names of each kind."""

    def __init__(
        self, message: str, missing: Sequence[str], unexpected: Sequence[str], differing: Sequence[str]
    ):
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.differing = list(differing)


def module_of(key: str) -> str:
    """The module a tensor key belongs to: `blocks.0.attn.to_out.0.lora_A.default.weight` ->
    `blocks.0.attn.to_out.0` (a key with no adapter part: the key less its last part)."""
    parts = key.split(".")
    for index, part in enumerate(parts):
        if part in ADAPTER_PARTS:
            return ".".join(parts[:index])
    return ".".join(parts[:-1]) or key


def trainable_names(module: torch.nn.Module) -> list[str]:
    """The names of `module`'s parameters that train (require grad), as its state-dict keys
    (`_orig_mod.` of a compiled submodule dropped)."""
    return [name.replace("_orig_mod.", "") for name, p in module.named_parameters() if p.requires_grad]


def shapes_of(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[int, ...]]:
    """{name: shape} (a DTensor's shape is its global one: no gathering)."""
    return {name: tuple(int(s) for s in tensor.shape) for name, tensor in named}


def _pair(tensor: torch.Tensor) -> torch.Tensor:
    x = tensor.detach()
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = x.to(torch.float64)  # integers, bools, fp8: exact in float64 (or near enough, alike both sides)
    return torch.stack([x.sum(dtype=torch.float64), torch.linalg.vector_norm(x, 1, dtype=torch.float64)])


def digest_table(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor]:
    """(names, float64[n, 2] on the tensors' device) of (sum, sum |x|) per tensor, without moving a
    number to the host per tensor (one transfer when the caller reads the result)."""
    names, pairs = [], []
    for name, tensor in named:
        names.append(name)
        pairs.append(_pair(tensor))
    if not pairs:
        return names, torch.zeros(0, 2, dtype=torch.float64)
    device = pairs[0].device
    return names, torch.stack([p.to(device) for p in pairs])


def tensor_digests(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Digest]:
    """{name: (sum, sum |x|)} in float64, as the module docstring describes."""
    names, table = digest_table(named)
    return {name: (float(s), float(a)) for name, (s, a) in zip(names, table.cpu().tolist(), strict=True)}


def digests_match(a: Digest, b: Digest) -> bool:
    scale = max(abs(a[1]), abs(b[1]))
    for x, y in zip(a, b, strict=True):
        if math.isnan(x) or math.isnan(y) or math.isinf(x) or math.isinf(y):
            if not (x == y or (math.isnan(x) and math.isnan(y))):
                return False
        elif abs(x - y) > DIGEST_RTOL * scale:
            return False
    return True


def _named(keys: Sequence[str], describe=None) -> str:
    modules: list[str] = []
    for key in keys:
        module = module_of(key)
        text = f"{module} ({describe(key)})" if describe else module
        if text not in modules:
            modules.append(text)
    shown = ", ".join(modules[:NAMED])
    return shown + (f" and {len(modules) - NAMED} more" if len(modules) > NAMED else "")


def check_adapter_tensors(
    where: str,
    trained: Mapping[str, Sequence[int]],
    arrived: Mapping[str, Sequence[int]],
    *,
    trained_digests: Mapping[str, Digest] | None = None,
    arrived_digests: Mapping[str, Digest] | None = None,
    side: str = "what arrived",
    fix: str = "",
) -> None:
    """Raise AdapterMismatchError unless `arrived` holds exactly the tensors of `trained`, with the
    same shapes (and, where both digest maps are given, matching digests).

    `where` says which hand-over ("weight sync to replica 1", "export to DIR") and `side` what
    `arrived` is ("the replica's model", "the exported file"); the message names the modules
    missing, unexpected and different (at most `NAMED` of each, then a count), and ends with `fix`.
    """
    missing = sorted(set(trained) - set(arrived))
    unexpected = sorted(set(arrived) - set(trained))
    common = [k for k in trained if k in arrived]
    reshaped = sorted(k for k in common if tuple(trained[k]) != tuple(arrived[k]))
    altered: list[str] = []
    if trained_digests is not None and arrived_digests is not None:
        altered = sorted(
            k
            for k in common
            if k not in reshaped
            and k in trained_digests
            and not (k in arrived_digests and digests_match(trained_digests[k], arrived_digests[k]))
        )
    if not (missing or unexpected or reshaped or altered):
        return
    lines = []
    if missing:
        lines.append(f"{len(missing)} trained tensor(s) missing from {side}, of modules {_named(missing)}")
    if unexpected:
        lines.append(
            f"{len(unexpected)} tensor(s) in {side} that are not trained, of modules {_named(unexpected)}"
        )
    if reshaped:
        shape = lambda k: f"trained {list(trained[k])}, {list(arrived[k])} in {side}"  # noqa: E731
        lines.append(f"{len(reshaped)} tensor(s) of another shape, of modules {_named(reshaped, shape)}")
    if altered:
        lines.append(
            f"{len(altered)} tensor(s) in {side} whose values differ from those sent, of modules {_named(altered)}"
        )
    raise AdapterMismatchError(
        f"{where}: {side} does not hold the {len(trained)} trained tensor(s): "
        + "; ".join(lines)
        + (f". {fix}" if fix else ""),
        missing,
        unexpected,
        reshaped + altered,
    )


def require_trained_covered(
    where: str, trained: Iterable[str], covered: Iterable[str], *, fix: str = ""
) -> None:
    """Raise AdapterMismatchError when a trained (requires-grad) tensor is not among `covered`, the
    tensors a hand-over moves: a key filter that misses a module would leave it behind unseen."""
    left = sorted(set(trained) - set(covered))
    if left:
        raise AdapterMismatchError(
            f"{where}: {len(left)} trained tensor(s) are left out of what is handed over, of modules "
            f"{_named(left)}" + (f". {fix}" if fix else ""),
            left,
            [],
            [],
        )


__all__ = [
    "ADAPTER_PARTS",
    "AdapterMismatchError",
    "check_adapter_tensors",
    "digests_match",
    "module_of",
    "require_trained_covered",
    "shapes_of",
    "tensor_digests",
    "trainable_names",
]
