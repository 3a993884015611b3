"""Weights out of a training engine: LoRA in the diffusers format, full safetensors, and a stream.

Three consumers, three shapes:

- `export_lora` writes one named adapter the way diffusers writes LoRAs (peft's
  `get_peft_model_state_dict` + the pipeline class's own `save_lora_weights`, with the adapter's
  `LoraConfig` as metadata), so `pipe.load_lora_weights(out_dir)` restores it, scale included.
- `export_full` writes the whole transformer with diffusers' `save_pretrained` (safetensors), with
  one adapter merged in by peft when asked, so `<TransformerClass>.from_pretrained(out_dir)` loads it
  without peft.
- `iter_weights` yields (name, tensor) pairs one at a time for rollout workers that hold the same
  module structure (names are the module's state-dict keys).

On top of them, `export_pipeline` writes a whole diffusers pipeline directory. Exports of a run
(`diffrl export`, the end of `diffrl train`) use these from `diffrl.train.export_run`.

All three work on plain modules and on FSDP2-sharded ones (DTensor parameters). Under an initialised
process group they are collectives: every rank must call them (in the same order), because
gathering a shard is an all-gather; only rank 0 writes files.
"""

from __future__ import annotations

import copy
import itertools
import json
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from diffrl.files import naming, umask_mode
from diffrl.models.experts import expert_lora_file, trained_components
from diffrl.models.lora_check import diffusers_lora_key
from diffrl.train.distributed import barrier, rank


# ---------------------------------------------------------------------------------- adapters
def lora_adapter_names(module: nn.Module) -> list[str]:
    """Names of the peft adapters injected into `module` (diffusers' PEFT integration), sorted."""
    return sorted(getattr(module, "peft_config", None) or {})


def adapter_key_predicate(module: nn.Module, adapter_name: str | None = None) -> Callable[[str], bool]:
    """A test "is this state-dict key an adapter weight?" for `module`'s peft adapters (or just one).

    peft stores adapter weights as `<layer>.<adapter layer name>.<adapter name>.<param>`, e.g.
    `transformer_blocks.0.attn.to_q.lora_A.default.weight`. A key is an adapter weight when two
    consecutive name parts are one of the tuner layers' `adapter_layer_names` (lora_A, lora_B,
    lora_embedding_*, lora_magnitude_vector) followed by an adapter name. Matching on name parts
    rather than module paths keeps the test valid for keys that torch's state-dict utilities have
    cleaned of wrapper prefixes (activation-checkpoint wrappers, compile).
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapters = set(lora_adapter_names(module)) if adapter_name is None else {adapter_name}
    layer_names = {
        name for m in module.modules() if isinstance(m, BaseTunerLayer) for name in m.adapter_layer_names
    }

    def is_adapter_key(key: str) -> bool:
        parts = key.split(".")
        return any(a in layer_names and b in adapters for a, b in itertools.pairwise(parts))

    return is_adapter_key


def _require_adapters(module: nn.Module, what: str) -> list[str]:
    names = lora_adapter_names(module)
    if not names:
        raise ValueError(
            f"{what} needs LoRA adapters, but {type(module).__name__} has none (full fine-tuning, "
            "model.lora.rank=0): use the full-weight path instead (adapter_only=False / export_full / "
            "trainable_only=False)"
        )
    return names


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor shard is all-gathered (a collective), a plain tensor is detached."""
    if isinstance(tensor, DTensor):
        return tensor.full_tensor().detach()
    return tensor.detach()


# ---------------------------------------------------------------------------------- streaming
def iter_weights(
    module: nn.Module, *, adapter_only: bool, adapter_name: str | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (state-dict key, full tensor) for `module`'s weights, one tensor at a time.

    `adapter_only=True` yields the LoRA adapter weights only (every named adapter, e.g. `default`
    and a frozen `old`; or just `adapter_name`), with their module keys such as
    `transformer_blocks.0.attn.to_q.lora_A.default.weight`; `adapter_only=False` yields every entry
    of `module.state_dict()` (parameters and persistent buffers), in its order.

    Why one at a time: under FSDP2 each parameter is a DTensor shard; `.full_tensor()` gathers it,
    and the consumer (a broadcast to rollout workers) sends it before the next one is gathered, so
    peak extra memory is one full parameter, not the model. Collective under a process group: every
    rank must consume the generator to the end in the same order. Plain tensors are yielded detached
    and share storage with the module: copy them, do not modify them.
    """
    if adapter_name is not None and not adapter_only:
        raise ValueError(f"adapter_name={adapter_name!r} selects an adapter: it needs adapter_only=True")
    keep: Callable[[str], bool] = lambda key: True  # noqa: E731
    if adapter_only:
        names = _require_adapters(module, "iter_weights(adapter_only=True)")
        if adapter_name is not None and adapter_name not in names:
            raise ValueError(f"adapter_name={adapter_name!r} is not one of the module's adapters {names}")
        keep = adapter_key_predicate(module, adapter_name)
    for key, tensor in module.state_dict().items():
        if keep(key):
            yield key, _full(tensor)


# ---------------------------------------------------------------------------------- LoRA export
def _lora_metadata(module: nn.Module, adapter_name: str) -> dict:
    """The adapter's `LoraConfig` as a JSON-able dict (diffusers stores it in the safetensors header)."""
    config = module.peft_config[adapter_name].to_dict()
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def export_lora(
    transformer: nn.Module, out_dir: str | Path, *, pipeline_class: type, adapter_name: str = "default"
) -> Path:
    """Write adapter `adapter_name` in the diffusers LoRA format; `pipe.load_lora_weights(out_dir)` loads it.

    The weights come from peft's `get_peft_model_state_dict(transformer, adapter_name=...)` (keys
    without the adapter name, e.g. `transformer_blocks.0.attn.to_q.lora_A.weight`), gathered to full
    tensors under FSDP2, and are written by the pipeline class's own `save_lora_weights` (e.g.
    `StableDiffusion3Pipeline.save_lora_weights`), which adds the `transformer.` prefix and writes
    `pytorch_lora_weights.safetensors`. The adapter's `LoraConfig` goes in as
    `transformer_lora_adapter_metadata`: without it a loader would infer alpha = rank and scale the
    update wrongly whenever lora_alpha != r. Collective under a process group; rank 0 writes.
    """
    from peft.utils import get_peft_model_state_dict

    names = _require_adapters(transformer, "export_lora")
    if adapter_name not in names:
        raise ValueError(f"adapter_name={adapter_name!r} is not one of the transformer's adapters {names}")
    if not hasattr(pipeline_class, "save_lora_weights"):
        raise ValueError(
            f"pipeline_class={pipeline_class!r} has no save_lora_weights: pass the diffusers pipeline class "
            "the model belongs to (e.g. StableDiffusion3Pipeline; adapter.pipe.__class__)"
        )
    layers = {
        key: _full(value)
        for key, value in get_peft_model_state_dict(transformer, adapter_name=adapter_name).items()
    }
    out = Path(out_dir)
    if rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        metadata = _lora_metadata(transformer, adapter_name)
        # one file per trained component: Wan2.2 A14B's experts each get their own, as diffusers loads them
        for component, module in trained_components(transformer):
            prefix = "" if module is transformer else f"{component}."
            own = {k[len(prefix) :]: v for k, v in layers.items() if k.startswith(prefix)}
            file = out / expert_lora_file(component)
            with naming(file):  # safetensors reports a full disk in its own error type, naming no file
                pipeline_class.save_lora_weights(
                    str(out),
                    transformer_lora_layers=own,
                    transformer_lora_adapter_metadata=metadata,
                    is_main_process=True,
                    weight_name=file.name,
                )
            umask_mode(file)  # written 0600 through a temporary file; 0644 like every other file
            check_lora_file(module, file, adapter_name)
    barrier()
    return out


def check_lora_file(transformer: nn.Module, file: Path, adapter_name: str) -> None:
    """Raise AdapterMismatchError unless the LoRA file written holds every tensor of adapter
    `adapter_name` (and every trained one), by the diffusers names and shapes, and nothing else.

    The file is read back by safetensors' own header reader (no tensor is loaded): what a loader
    will find, not what was handed to the writer. peft's state-dict filter and the pipeline's
    writer both stand between the module and the file, and either dropping a module (as one
    dropped Qwen-Image's `to_out.0`) would leave an export that loads without a word and samples
    as the base model there."""
    from diffrl.models.lora_check import (
        check_adapter_tensors,
        file_shapes,
        require_trained_covered,
        trainable_names,
    )

    written = file_shapes(file)
    is_adapter = adapter_key_predicate(transformer, adapter_name)
    trained = {
        diffusers_lora_key(key, adapter_name): tuple(value.shape)
        for key, value in transformer.state_dict().items()
        if is_adapter(key)
    }
    where = f"the LoRA export {str(file)!r}"
    fix = (
        "A module of the adapter was lost between peft and the file: please report it with the modules named"
    )
    active = [name for name in trainable_names(transformer) if f".{adapter_name}." in f".{name}."]
    require_trained_covered(where, [diffusers_lora_key(n, adapter_name) for n in active], trained, fix=fix)
    check_adapter_tensors(where, trained, written, side="the exported file", fix=fix)


# ---------------------------------------------------------------------------------- full export
def _model_class(module: nn.Module) -> type:
    """The module's own class: FSDP2 swaps in a subclass (`FSDP<Name>`); export the original."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def export_full(
    transformer: nn.Module,
    out_dir: str | Path,
    *,
    merge: bool = False,
    adapter_name: str = "default",
    peft_of: nn.Module | None = None,
) -> Path:
    """Write the full transformer with diffusers' `save_pretrained` (safetensors + config.json).

    Behaviour:
    - No LoRA adapters (full fine-tuning): the weights as they are; `merge` changes nothing.
    - LoRA adapters and `merge=True`: adapter `adapter_name` is merged into the base weights of a
      copy by peft (diffusers' `fuse_lora` then `unload_lora`); the training module is untouched and
      other adapters (e.g. `old`) are dropped. The result loads with `<Class>.from_pretrained(out_dir)`
      and no peft; it matches the LoRA-injected transformer up to the rounding of the merge.
    - LoRA adapters and `merge=False`: a ValueError, because a transformer file with peft's wrapper
      keys loads nowhere; use `export_lora` for the adapter alone.

    The copy is built on rank 0 from the gathered full state dict (`get_model_state_dict` with
    `full_state_dict=True, cpu_offload=True`, which gathers FSDP2 shards): its parameters are
    created on the meta device and take cloned CPU tensors by assignment (never the training
    module's own storage, which the merge would overwrite), so the export costs one copy of the
    weights in CPU memory and no random initialisation. Weights keep their training dtype. Collective under a process group; rank 0 writes.
    A merge that passes over a module carrying the adapter raises, naming it (`check_merged`).
    """
    owner = transformer if peft_of is None else peft_of  # an expert's adapters are its container's
    names = lora_adapter_names(owner)
    if names and not merge:
        raise ValueError(
            f"the transformer carries LoRA adapters {names}: export_full(merge=True, adapter_name=...) "
            "writes the base weights with one adapter merged in; export_lora(...) writes the adapter alone"
        )
    if names and adapter_name not in names:
        raise ValueError(f"adapter_name={adapter_name!r} is not one of the transformer's adapters {names}")
    state = get_model_state_dict(
        transformer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    out = Path(out_dir)
    if rank() == 0:
        # Without sharding the state dict's tensors are the module's own; the merge writes into the
        # copy's weights, so give the copy its own storage (one tensor at a time: bounded peak).
        for key in list(state):
            state[key] = state[key].clone()
        cls = _model_class(transformer)
        with torch.device("meta"), warnings.catch_warnings():
            # peft warns at each adapter after the first; the clone takes the trained module's
            # named adapters (default, old, ...) on purpose, to load its state dict as it is
            warnings.filterwarnings("ignore", message="Already found a `peft_config`", category=UserWarning)
            clone = cls.from_config(transformer.config)
            for name in names:
                clone.add_adapter(copy.deepcopy(owner.peft_config[name]), adapter_name=name)
        # strict: every parameter and persistent buffer is replaced. Non-persistent buffers and plain
        # tensor attributes (rotary tables) stay on the meta device: the merge and save_pretrained
        # never read them, and the loader of the exported directory computes them afresh.
        clone.load_state_dict(state, strict=True, assign=True)
        if names:
            is_trained = adapter_key_predicate(transformer, adapter_name)
            trained = {key: tuple(value.shape) for key, value in state.items() if is_trained(key)}
            clone.fuse_lora(adapter_names=[adapter_name])
            check_merged(clone, trained, adapter_name, out)
            clone.unload_lora()
        out.mkdir(parents=True, exist_ok=True)
        with naming(out):  # safetensors' errors name no file
            clone.save_pretrained(str(out), safe_serialization=True)
        del clone, state
    barrier()
    return out


def check_merged(clone: nn.Module, trained: dict[str, tuple[int, ...]], adapter_name: str, out: Path) -> None:
    """Raise AdapterMismatchError unless diffusers' `fuse_lora` merged adapter `adapter_name` into
    every module that carries it: `trained` holds the training module's adapter tensors, the
    merged modules' tensors (peft lists the adapter in a layer's `merged_adapters` once merged)
    must be the same. A layer the merge passed over would be exported as the base weight."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from diffrl.models.lora_check import check_adapter_tensors, module_of

    merged = {
        name
        for name, module in clone.named_modules()
        if isinstance(module, BaseTunerLayer) and adapter_name in module.merged_adapters
    }
    is_adapter = adapter_key_predicate(clone, adapter_name)
    arrived = {
        key: tuple(value.shape)
        for key, value in clone.state_dict().items()
        if is_adapter(key) and module_of(key) in merged
    }
    check_adapter_tensors(
        f"the merged export {str(out)!r}",
        trained,
        arrived,
        side="the merged weights",
        fix="The merge passed over these modules: please report it with the modules named",
    )


# ---------------------------------------------------------------------------------- pipelines
def export_pipeline(adapter, out_dir: str | Path, *, model_path: str | Path, merge: bool) -> Path:
    """Write the adapter's whole pipeline as a diffusers directory: `DiffusionPipeline.from_pretrained(out)`.

    The transformer goes through `export_full` (LoRA adapter `default` merged in when `merge`; it
    gathers FSDP shards, so call it on every rank); rank 0 writes the other components as loaded
    and the model directory's own model_index.json (`model_path`: `model.path`, `toy:`/`tiny:` names
    included). `out_dir` is a staging folder (`export_folder.begin_staging`): the caller publishes
    it when whole, so a crash never leaves a half-written pipeline under the final name.
    """
    from diffrl.models import resolve_model_path

    out = Path(out_dir)
    trained = trained_components(adapter.transformer)
    for name, module in trained:  # Wan2.2 A14B: each expert to its own component folder
        export_full(module, out / name, merge=merge, peft_of=adapter.transformer)
    if rank() == 0:
        for name, component in adapter.pipe.components.items():
            if name not in dict(trained) and component is not None and hasattr(component, "save_pretrained"):
                with naming(out / name):
                    component.save_pretrained(out / name)
        with naming(out / "model_index.json"):
            shutil.copy(resolve_model_path(model_path) / "model_index.json", out / "model_index.json")
        for file in out.rglob("*"):
            if file.is_file():
                umask_mode(file)  # safetensors files come out 0600; 0644 like every other file
    barrier()
    return out
