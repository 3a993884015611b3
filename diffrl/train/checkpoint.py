"""Training checkpoints: weights, optimizer, scheduler, counters and RNG, with torch.distributed.checkpoint.

Layout of one checkpoint, `<root>/step_<step:08d>/`:

    .metadata, *.distcp   DCP: "model" (adapter weights or the full model), "optim", "scheduler"
    meta.json             how it was saved: trainable_only, adapters (rank, alpha, targets), world size
    extra.json            the caller's counters (rank 0's `extra`: step, data sampler position, ...)
    rng/rank_<r>.pt       python `random`, numpy, torch CPU (and this rank's CUDA device) RNG states
    complete              written last: the checkpoint is whole

Why DCP: each rank writes only its own shards (FSDP2 DTensors) and a load reshards to the loading
run's layout, with or without a process group. The model and optimizer state dicts come from
`torch.distributed.checkpoint.state_dict.get_state_dict` (its FQN keys do not depend on FSDP or
activation-checkpoint wrappers) and go back through `set_state_dict`.

Crash safety: a save writes into `<root>/.tmp-step_<step>/` and rank 0 renames it to
`step_<step>/` only after every rank has finished and the `complete` marker is in place, so a crash
mid-save leaves the previous checkpoints untouched; `latest_checkpoint` only ever returns a
complete one, and the next save removes leftover temporary directories. Old checkpoints beyond
`keep_last` are removed after the rename (renamed aside first, then deleted, so a half-deleted
directory never looks like a checkpoint).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from diffrl.train.distributed import barrier, is_distributed, world_size
from diffrl.train.distributed import rank as process_rank
from diffrl.train.export import adapter_key_predicate, lora_adapter_names

FORMAT_VERSION = 1
COMPLETE_MARKER = "complete"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
# The LoraConfig fields that decide which tensors an adapter has and how they scale.
_LORA_FIELDS = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora")


# ---------------------------------------------------------------------------------- process group
@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group DCP warns that it assumes a single process, which is the intent here."""
    with warnings.catch_warnings():
        if not is_distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _write_durable(path: Path, data: bytes) -> None:
    """Write `data` to `path` and flush it to the disk before the `complete` marker can vouch for it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (the directory entry itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dir(root: str | Path, step: int) -> Path:
    """`<root>/step_<step:08d>`: the name sorts by step as text too."""
    return Path(root) / f"step_{step:08d}"


# ---------------------------------------------------------------------------------- state dicts
def _model_state(model: nn.Module, trainable_only: bool) -> dict[str, Any]:
    """The model's DCP state dict: every adapter weight (LoRA), or everything (full fine-tuning).

    "trainable_only" means the part training changes: all named adapters, including frozen copies
    such as `old` (their values come from training too), never the frozen base weights. Filtering
    keys (rather than `ignore_frozen_params`) is what keeps the frozen adapters in. The tensors are
    the module's own (DTensor shards under FSDP2), not copies.
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
    return {key: value for key, value in state.items() if is_adapter(key)}


def _lora_summary(model: nn.Module) -> dict[str, dict[str, Any]]:
    summary = {}
    for name in lora_adapter_names(model):
        config = model.peft_config[name]
        fields = {field: getattr(config, field, None) for field in _LORA_FIELDS}
        if isinstance(fields["target_modules"], set | frozenset | list | tuple):
            fields["target_modules"] = sorted(fields["target_modules"])
        summary[name] = fields
    return summary


# ---------------------------------------------------------------------------------- RNG
def _rng_state() -> dict[str, Any]:
    """This process's global RNG states, in types `torch.load(weights_only=True)` accepts.

    CUDA: the current device's generator (diffrl runs one process per GPU), and only once CUDA is
    initialised: a process that never touched CUDA has drawn nothing from it (and asking would
    create a CUDA context on a CPU run).
    """
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any], source: Path) -> None:
    if "cuda" in state and not torch.cuda.is_available():
        raise ValueError(
            f"{source} holds a CUDA RNG state but CUDA is not available here: the run cannot continue "
            "bit-identically on this machine; pass restore_rng=False to load everything else"
        )
    random.setstate(state["python"])
    numpy = state["numpy"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    np.random.set_state((numpy["kind"], keys, numpy["pos"], numpy["has_gauss"], numpy["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


# ---------------------------------------------------------------------------------- save
def save_checkpoint(
    ckpt_dir_root: str | Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    trainable_only: bool,
    extra: dict[str, Any],
    keep_last: int | None = None,
) -> Path:
    """Write `<root>/step_<step:08d>/` atomically and return it; keep only the newest `keep_last`.

    Call it on every rank (DCP writes each rank's shards; under a process group this is a
    collective) with the same `step`, `extra` and `keep_last`; rank 0's `extra` is stored.
    `trainable_only=True` stores the LoRA adapter weights (every named adapter) and not the base
    model; False stores the full model. The optimizer state is stored once the optimizer has
    stepped (before its first step it has none, and a load then leaves a fresh optimizer fresh);
    None for `optimizer`/`scheduler` stores none. `keep_last=None` keeps every checkpoint.
    Saving a step that already has a checkpoint replaces it (a crash during that replacement can
    lose this step's old version, never an older checkpoint).
    """
    if step < 0:
        raise ValueError(f"step must be a non-negative integer; got {step}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (or None to keep every checkpoint); got {keep_last}")
    if not isinstance(extra, dict):
        raise ValueError(f"extra must be a dict of JSON-able values (step counters, ...); got {type(extra)}")
    try:
        extra_json = json.dumps(extra, indent=2, sort_keys=True)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"extra must be JSON-able (numbers, strings, lists, dicts): {err}; convert tensors with .item() "
            "or .tolist()"
        ) from err

    root = Path(ckpt_dir_root)
    final = step_dir(root, step)
    tmp = root / f"{_TMP_PREFIX}{final.name}"
    rank = process_rank()

    state: dict[str, Any] = {"model": _model_state(model, trainable_only)}
    # An optimizer that has not stepped has no state; asking DCP for one would initialise it with a
    # zero step (torch's _init_optim_state), shifting Adam's bias correction, so store none.
    has_optimizer_state = optimizer is not None and bool(optimizer.state)
    if has_optimizer_state:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()

    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(root)
        tmp.mkdir()
    barrier()

    with _single_process_quiet():
        dcp.save(state, checkpoint_id=tmp, no_dist=not is_distributed())
    (tmp / "rng").mkdir(exist_ok=True)
    rng = io.BytesIO()
    torch.save(_rng_state(), rng)
    _write_durable(tmp / "rng" / f"rank_{rank:05d}.pt", rng.getvalue())
    if rank == 0:
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "trainable_only": trainable_only,
            "adapters": _lora_summary(model),
            "has_optimizer_state": has_optimizer_state,
            "has_scheduler": scheduler is not None,
            "world_size": world_size(),
            "torch_version": torch.__version__,
        }
        _write_durable(tmp / "meta.json", json.dumps(meta, indent=2, sort_keys=True).encode())
        _write_durable(tmp / "extra.json", extra_json.encode())
    barrier()  # every rank's shards and RNG file are on disk

    if rank == 0:
        _fsync_dir(tmp / "rng")
        _write_durable(tmp / COMPLETE_MARKER, f"{step}\n".encode())
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step: move the old one aside, never delete before the rename
            final.rename(root / f"{_TRASH_PREFIX}{final.name}")
        os.replace(tmp, final)
        _fsync_dir(root)
        if keep_last is not None:
            _prune(root, keep_last, protect=final)
        _remove_leftovers(root)
    barrier()
    return final


def _remove_leftovers(root: Path) -> None:
    """Delete temporary directories of interrupted saves and renamed-aside old checkpoints."""
    for entry in root.iterdir():
        if entry.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)) and entry.is_dir():
            shutil.rmtree(entry)


def _prune(root: Path, keep_last: int, protect: Path) -> None:
    complete = _complete_checkpoints(root)
    for _, path in complete[: max(len(complete) - keep_last, 0)]:
        if path != protect:
            trash = root / f"{_TRASH_PREFIX}{path.name}"
            path.rename(trash)
            shutil.rmtree(trash)


# ---------------------------------------------------------------------------------- find
def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (highest step), or None when there is none.

    Temporary directories of interrupted saves and directories without the `complete` marker are
    never returned. A missing `root` is a run that has not saved yet: None.
    """
    complete = _complete_checkpoints(Path(root))
    return complete[-1][1] if complete else None


# ---------------------------------------------------------------------------------- load
def _check_readable(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise FileNotFoundError(
            f"checkpoint {str(path)!r} does not exist: pass a step_XXXXXXXX directory written by "
            "save_checkpoint (latest_checkpoint(root) finds the newest)"
        )
    if not path.is_dir():
        raise ValueError(f"checkpoint {str(path)!r} is a file: pass a step_XXXXXXXX directory")
    if not (path / COMPLETE_MARKER).is_file():
        if _complete_checkpoints(path):
            raise ValueError(
                f"{str(path)!r} is a checkpoint root, not a checkpoint: pass one of its step_XXXXXXXX "
                f"directories, e.g. latest_checkpoint(root) = {latest_checkpoint(path)}"
            )
        previous = latest_checkpoint(path.parent)
        raise ValueError(
            f"checkpoint {str(path)!r} is incomplete (no {COMPLETE_MARKER!r} marker: its save was interrupted "
            f"or it was not written by save_checkpoint); load a complete one instead, e.g. the newest in "
            f"{str(path.parent)!r}: {previous}"
        )
    meta = json.loads((path / "meta.json").read_text())
    if meta["format_version"] != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {str(path)!r} has format version {meta['format_version']}; this diffrl reads "
            f"version {FORMAT_VERSION}"
        )
    return meta


def _saved_model_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """FQN -> global shape of the model tensors in the DCP checkpoint, read from its metadata."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    assert metadata.planner_data is not None, "diffrl checkpoints are saved with DCP's flattening planner"
    shapes = {}
    for key, item in metadata.state_dict_metadata.items():
        location = metadata.planner_data[key]
        if location[0] == "model" and hasattr(item, "size"):
            shapes[location[1]] = tuple(item.size)
    return shapes


def _diff_lines(saved: dict[str, tuple], model: dict[str, tuple], limit: int = 5) -> list[str]:
    lines = []
    missing = sorted(set(saved) - set(model))
    unexpected = sorted(set(model) - set(saved))
    shape = sorted(k for k in set(saved) & set(model) if saved[k] != model[k])
    if missing:
        lines.append(f"{len(missing)} saved tensor(s) the model lacks, e.g. {missing[:limit]}")
    if unexpected:
        lines.append(f"{len(unexpected)} model tensor(s) the checkpoint lacks, e.g. {unexpected[:limit]}")
    if shape:
        examples = [f"{k}: saved {list(saved[k])}, model {list(model[k])}" for k in shape[:limit]]
        lines.append(f"{len(shape)} shape mismatch(es), e.g. {examples}")
    return lines


def _check_model_matches(
    path: Path, meta: dict[str, Any], model: nn.Module, model_state: dict[str, Any], trainable_only: bool
) -> None:
    """Raise, saying what differs and the fix, when the checkpoint's weights do not fit `model`."""
    saved_shapes = _saved_model_shapes(path)
    model_shapes = {key: tuple(value.shape) for key, value in model_state.items() if hasattr(value, "shape")}
    if not trainable_only:
        lines = _diff_lines(saved_shapes, model_shapes)
        if lines:
            raise ValueError(
                f"checkpoint {str(path)!r} holds full weights of a different model: "
                + "; ".join(lines)
                + ". Load it into the architecture it was saved from (the same model.path)"
            )
        return

    saved, current = meta["adapters"], _lora_summary(model)
    if set(saved) != set(current):
        fixes = []
        if set(saved) - set(current):
            fixes.append(
                f"add adapter(s) {sorted(set(saved) - set(current))} to the model before loading "
                "(transformer.add_adapter(LoraConfig(...), adapter_name=...); the engine adds 'old' when the "
                "algorithm keeps an old policy)"
            )
        if set(current) - set(saved):
            fixes.append(
                f"the checkpoint has no weights for adapter(s) {sorted(set(current) - set(saved))}: "
                "configure the run as it was saved (same algorithm.old_policy) or delete those adapters"
            )
        raise ValueError(
            f"checkpoint {str(path)!r} holds LoRA adapters {sorted(saved)}, the model has {sorted(current)}: "
            + "; ".join(fixes)
        )
    hints, scale_differs = [], False
    for name in sorted(saved):
        for field in _LORA_FIELDS:
            if saved[name][field] != current[name][field]:
                # alpha, rsLoRA and DoRA change the update without changing tensor shapes.
                scale_differs |= field in ("lora_alpha", "use_rslora", "use_dora")
                key = {"r": "model.lora.rank", "lora_alpha": "model.lora.alpha"}.get(
                    field, f"model.lora.{field}"
                )
                hints.append(
                    f"adapter {name!r} was saved with {field}={saved[name][field]!r}, the model has "
                    f"{current[name][field]!r} (set {key} to the saved value)"
                )
    lines = _diff_lines(saved_shapes, model_shapes)
    if lines or scale_differs:
        raise ValueError(
            f"checkpoint {str(path)!r} does not match the model's LoRA adapters: "
            + "; ".join(hints + lines)
            + ". Build the adapters exactly as in the run that saved it"
        )


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    trainable_only: bool,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restore a `save_checkpoint` directory into `model`/`optimizer`/`scheduler` and return its `extra`.

    Call it on every rank, after the model has its adapters (same names, ranks and targets as when
    saved) and after FSDP sharding, with `trainable_only` as when saved. The weights are checked
    against the checkpoint's metadata before anything is read, so a mismatch raises a ValueError
    naming what differs, and leaves the model untouched. `optimizer=None`/`scheduler=None` skip
    their state (e.g. loading weights for export). `restore_rng=True` restores this rank's python,
    numpy, torch and CUDA RNG states (the run's world size must match the saved one).
    """
    path = Path(path)
    meta = _check_readable(path)
    if meta["trainable_only"] != trainable_only:
        saved = "LoRA adapters only" if meta["trainable_only"] else "the full model"
        raise ValueError(
            f"checkpoint {str(path)!r} holds {saved} (saved with trainable_only={meta['trainable_only']}); "
            f"pass trainable_only={meta['trainable_only']} and a model configured the same way "
            "(model.lora.rank > 0 for adapters, 0 for full fine-tuning)"
        )
    if scheduler is not None and not meta["has_scheduler"]:
        raise ValueError(
            f"checkpoint {str(path)!r} was saved without a scheduler state: pass scheduler=None to load it"
        )
    rng_file = path / "rng" / f"rank_{process_rank():05d}.pt"
    if restore_rng and (meta["world_size"] != world_size() or not rng_file.is_file()):
        raise ValueError(
            f"checkpoint {str(path)!r} was saved by {meta['world_size']} rank(s) and this run has "
            f"{world_size()}: RNG states are per rank; resume with the same world size, or pass "
            "restore_rng=False (weights, optimizer and scheduler still load; DCP reshards them)"
        )

    model_state = _model_state(model, trainable_only)
    _check_model_matches(path, meta, model, model_state, trainable_only)
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None and meta["has_optimizer_state"]:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=path, no_dist=not is_distributed())

    # Not strict for adapters: the frozen base weights are deliberately absent from the state.
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not trainable_only))
    if "optim" in state:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        _set_rng_state(torch.load(rng_file, weights_only=True), rng_file)
    return json.loads((path / "extra.json").read_text())
