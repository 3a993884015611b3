"""The state a checkpoint holds, as state dicts, and their tensors' per-rank safetensors I/O (DCP).

Both directions of a checkpoint need the same view of the live objects: which of the model's
tensors are stored (`_model_state`: the adapters, or everything), how an optimizer's state splits
into tensors and JSON values (`_split_optimizer_state`), and the DCP calls that write and read
this rank's shards (`_save_tensors`, `_load_tensors`; the module docstring of
`diffrl.train.checkpoint` says why DCP with per-rank safetensors). Apart from `checkpoint` (saving:
the files, the manifest, the atomic publication) and `checkpoint_load` (loading and its fit
checks) because both use it and neither should import the other.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from diffrl.files import named_os_error
from diffrl.models.lora_check import require_trained_covered, trainable_names
from diffrl.train.distributed import is_distributed
from diffrl.train.export import adapter_key_predicate, lora_adapter_names


@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group DCP warns that it assumes a single process, which is the intent here."""
    with warnings.catch_warnings():
        if not is_distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _model_state(model: nn.Module, trainable_only: bool) -> dict[str, Any]:
    """The model's DCP state dict: every adapter weight (LoRA), or everything (full fine-tuning).

    "trainable_only" means the part training changes: all named adapters, including frozen copies
    such as `old` (their values come from training too), never the frozen base weights. Filtering
    keys (rather than `ignore_frozen_params`) is what keeps the frozen adapters in. The tensors are
    the module's own (DTensor shards under FSDP2), not copies. Every tensor that requires grad
    must be among them (an AdapterMismatchError names the modules otherwise).
    """
    state = get_model_state_dict(model)
    if not trainable_only:
        return state
    if not lora_adapter_names(model):
        raise ValueError(
            f"trainable_only=True saves LoRA adapters, but {type(model).__name__} has none (full fine-tuning, "
            "model.lora.rank=0): pass trainable_only=False"
        )
    is_adapter = adapter_key_predicate(model)
    adapters = {key: value for key, value in state.items() if is_adapter(key)}
    # A trained tensor the filter misses would be neither saved nor restored, without a word.
    require_trained_covered(
        f"the LoRA state of {type(model).__name__}",
        trainable_names(model),
        adapters,
        fix="diffrl.train.export.adapter_key_predicate must recognise every adapter tensor: please report it",
    )
    return adapters


def _split_optimizer_state(state: dict[str, dict[str, Any]]) -> tuple[dict, dict, dict]:
    """(tensors, description, scalars) of an optimizer state {fqn: {key: tensor or number}}.

    Tensors (moments, Adam's `step`) go to safetensors; numbers and flags stay JSON. The
    description lists each parameter's tensor keys, so a load asks for exactly those.
    """
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    description: dict[str, list[str]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, values in state.items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors.setdefault(fqn, {})[key] = value
                description.setdefault(fqn, []).append(key)
            elif value is None or isinstance(value, bool | int | float | str):
                scalars.setdefault(fqn, {})[key] = value
            else:
                raise ValueError(
                    f"optimizer state {fqn!r}[{key!r}] is a {type(value).__name__}: checkpoints store tensors "
                    "and numbers only; use an optimizer whose state is tensors and numbers (torch.optim's are)"
                )
    return tensors, {fqn: sorted(keys) for fqn, keys in description.items()}, scalars


def _save_tensors(state: dict[str, Any], directory: Path) -> None:
    """Every rank writes its own shards of `state` as safetensors (see the module docstring).

    DCP wraps a rank's write error (a full disk) in its CheckpointException, a BaseException that
    an `except Exception` misses: the first OSError inside is raised as itself (the CLI names a full
    disk), naming `directory` when it names no file (DCP writes to an open stream), anything else
    as a RuntimeError carrying DCP's report."""
    try:
        with _single_process_quiet():
            dcp.save(
                state,
                storage_writer=HuggingFaceStorageWriter(str(directory), save_distributed=True),
                no_dist=not is_distributed(),
            )
    except CheckpointException as err:
        causes = [failure[0] if isinstance(failure, tuple) else failure for failure in err.failures.values()]
        for cause in causes:
            if isinstance(cause, OSError):
                raise named_os_error(cause, directory) or cause from None
        raise RuntimeError(f"writing the checkpoint's tensors to {directory} failed: {err}") from None


def _load_tensors(state: dict[str, Any], directory: Path) -> None:
    """Fill `state`'s tensors (this rank's shards) in place from a per-rank safetensors directory."""
    with _single_process_quiet():
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=not is_distributed())
