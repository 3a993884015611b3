"""No LoRA module goes missing silently: the adapter tensors that were trained, compared with those
that arrived (at a replica after a weight sync, in the model after a checkpoint load, in the file of
an export).

A dropped module is the field's most reported LoRA bug (a `to_out.0` that a key filter or a name
conversion skips): nothing fails, the module simply keeps its initial weights (LoRA's B = 0: the
base model's behaviour) and the samples are subtly not the trained policy's. So each hand-over
compares the two sides' {name: shape} maps (after a sync also each tensor's digest, compared by
`diffrl.workers.weight_specs`, which passes the tensors that differ), and stops with
`AdapterMismatchError` naming the modules (`check_adapter_tensors`).

Here (models/, below train/, rollout/ and workers/) because all three hand-overs use it and the
names it reasons about are peft's, as the families inject them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch

#: peft's adapter layer names: a key `<module>.<layer name>.<adapter>.<param>` is an adapter tensor.
ADAPTER_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
#: How many modules a message names per kind of difference; the rest are counted.
NAMED = 10


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

    def __reduce__(self):  # picklable: a worker's error crosses to the controller (Ray)
        return (AdapterMismatchError, (str(self), self.missing, self.unexpected, self.differing))


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
    differing: Iterable[str] = (),
    side: str = "what arrived",
    fix: str = "",
) -> None:
    """Raise AdapterMismatchError unless `arrived` holds exactly the tensors of `trained`, with the
    same shapes, and none of them among `differing` (the tensors whose values a caller found to
    differ from those sent: a sync's digests).

    `where` says which hand-over ("weight sync to replica 1", "export to DIR") and `side` what
    `arrived` is ("the replica's model", "the exported file"); the message names the modules
    missing, unexpected and different (at most `NAMED` of each, then a count), and ends with `fix`.
    """
    missing = sorted(set(trained) - set(arrived))
    unexpected = sorted(set(arrived) - set(trained))
    common = [k for k in trained if k in arrived]
    reshaped = sorted(k for k in common if tuple(trained[k]) != tuple(arrived[k]))
    altered = sorted(set(differing) & set(common) - set(reshaped))
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
        f"{where}: {side} does not match the {len(trained)} trained tensor(s) ({len(common) - len(reshaped) - len(altered)} match): "
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


def diffusers_lora_key(key: str, adapter_name: str, prefix: str = "transformer") -> str:
    """A module's adapter key as the diffusers LoRA file names it: the adapter name dropped (peft's
    `get_peft_model_state_dict`), the component prefixed (`save_lora_weights`):
    `blocks.0.to_q.lora_A.default.weight` -> `transformer.blocks.0.to_q.lora_A.weight`."""
    parts = key.split(".")
    kept = [
        part
        for index, part in enumerate(parts)
        if not (part == adapter_name and index > 0 and parts[index - 1] in ADAPTER_PARTS)
    ]
    return ".".join([prefix, *kept])


def file_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of a safetensors file, from its header (no tensor is read)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118


def check_lora_file_bound(pipe, lora_file: str | Path, adapter_name: str, *, into: str | None = None) -> int:
    """After `pipe.load_lora_weights(..., adapter_name=adapter_name)`: raise AdapterMismatchError
    unless every adapter tensor of `lora_file` is bound in the pipeline under `adapter_name`, with
    its shape, and nothing else is; returns the number of tensors bound. `into`: the component the
    file's `transformer.` keys were loaded into (Wan2.2's `load_into_transformer_2`), else None.

    diffusers warns about keys it cannot place and may drop a module whose name it does not
    convert, then samples on: the base model's behaviour for that module. A file in diffusers' own
    key form (`<component>.<module>.lora_A.weight`, what `diffrl export` and `save_lora_weights`
    write) is compared name by name; a file in another form (kohya's `lora_unet_*`, `lora_down`,
    which diffusers converts) cannot be mapped back, so for it only "at least one module bound" is
    required. Only the safetensors header is read (shapes), no tensor."""
    shapes = file_shapes(lora_file)
    components = {}
    for name in [into] if into is not None else list(getattr(pipe, "components", {})):
        component = getattr(pipe, name, None)
        if isinstance(component, torch.nn.Module):
            components["transformer" if into is not None else name] = component
    bound: dict[str, tuple[int, ...]] = {}
    for name, component in components.items():
        for key, value in component.state_dict().items():
            parts = key.split(".")
            if any(a in ADAPTER_PARTS and b == adapter_name for a, b in itertools.pairwise(parts)):
                bound[diffusers_lora_key(key, adapter_name, name)] = tuple(value.shape)
    where = f"loading {lora_file} into {type(pipe).__name__}" + (f".{into}" if into else "")
    fix = "the LoRA does not fit this model (another base model or family?), or diffusers does not convert its key format"
    if not bound:
        raise AdapterMismatchError(
            f"{where}: no module of the LoRA was bound ({len(shapes)} tensor(s) in the file). {fix}",
            sorted(shapes),
            [],
            [],
        )
    diffusers_form = all(
        key.split(".", 1)[0] in components and any(part in ADAPTER_PARTS for part in key.split("."))
        for key in shapes
    )
    if diffusers_form:
        check_adapter_tensors(where, shapes, bound, side="the pipeline", fix=fix)
    return len(bound)


__all__ = [
    "ADAPTER_PARTS",
    "AdapterMismatchError",
    "check_adapter_tensors",
    "check_lora_file_bound",
    "diffusers_lora_key",
    "file_shapes",
    "module_of",
    "require_trained_covered",
    "shapes_of",
    "trainable_names",
]
