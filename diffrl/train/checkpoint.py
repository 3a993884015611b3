"""Training checkpoints: weights, optimizer, scheduler, counters and RNG, in a format that executes nothing.

Layout of one checkpoint, `<root>/step_<step:08d>/` (format version 2):

    model/shard-<r+1>-model-00001-of-00001.safetensors   rank r's part of the model state (tensors)
    optim/shard-<r+1>-model-00001-of-00001.safetensors   rank r's part of the optimizer state tensors
    optim.json           the rest of the optimizer: param groups (hyper-parameters, parameter FQNs), the
                         non-tensor per-parameter values, and which tensors each parameter has
    scheduler.json       the LR scheduler's state_dict
    meta.json            how it was saved: trainable_only, adapters (rank, alpha, targets), world size
    extra.json           the caller's counters (rank 0's `extra`: step, data sampler position, ...)
    rng/rank_<r>.json    python `random`, numpy, torch CPU (and this rank's CUDA device) RNG states
                         (`diffrl.train.rng_state`)
    manifest.json        every file above with its size and sha256
    complete             written last: the sha256 of manifest.json, vouching that the checkpoint is whole

Nothing in a checkpoint is unpickled: tensors are safetensors (a JSON header and raw bytes), the rest
is JSON. The previous format (torch.distributed.checkpoint's `.metadata`/`*.distcp`, version 1)
unpickled its `.metadata` on load, so a crafted file ran code; it is refused, never read.

Why per-rank safetensors through DCP: `torch.distributed.checkpoint` with its Hugging Face storage
writer (`save_distributed=True`) has every rank write only its own FSDP2 shards (no rank gathers
the model or the optimizer: a 12B model's Adam state is ~100 GB that no single rank could hold),
and its reader rebuilds the global layout from the safetensors headers (offsets stored as JSON in
their metadata), so a load reshards to the loading run's layout, with or without a process group.
The state dicts come from `torch.distributed.checkpoint.state_dict.get_state_dict`-style helpers
(FQN keys that do not depend on FSDP or activation-checkpoint wrappers) and go back through
`set_model_state_dict` / `set_optimizer_state_dict`.

Integrity: a load first checks the manifest against the directory (no file missing, none extra,
sizes equal, names of the kinds listed above) and then every file's sha256, before any byte is
parsed; then every JSON file is parsed and checked to have the shape a load reads (a file that
hashes right under a forged manifest but does not parse fails here). A mismatch is a
`CheckpointError` (a ValueError) naming the file and the fix. Under a process group the hashing is
split across the ranks. `latest_checkpoint` returns the newest checkpoint that verifies and logs a
warning for every newer one it skipped. Verification and finding live in
`diffrl.train.checkpoint_files` (re-exported here); whether the weights fit a model (LoRA settings,
shapes) in `diffrl.train.checkpoint_fit`. This module saves; `load_checkpoint` is in
`diffrl.train.checkpoint_load` (re-exported here), and the state dicts both use, with their DCP
reads and writes, in `diffrl.train.checkpoint_state`.

Crash safety: a save writes into `<root>/.tmp-step_<step>/` and rank 0 renames it to
`step_<step>/` only after every rank has finished and the manifest and `complete` marker are on
disk (fsynced), so a crash mid-save leaves the previous checkpoints untouched; the next save removes
leftover temporary directories. Old checkpoints beyond `keep_last` are removed after the rename
(renamed aside first, then deleted, so a half-deleted directory never looks like a checkpoint).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from diffrl.files import naming
from diffrl.train.checkpoint_files import (  # noqa: F401  (re-exported: callers import them from here)
    _FIX,
    COMPLETE_MARKER,
    FORMAT_VERSION,
    MANIFEST,
    MODEL_DIR,
    OPTIM_DIR,
    RNG_DIR,
    CheckpointError,
    _my_share,
    _read_json,
    _sha256,
    complete_checkpoints,
    fit_problem,
    latest_checkpoint,
    step_dir,
    verify_checkpoint,
)
from diffrl.train.checkpoint_fit import lora_summary
from diffrl.train.checkpoint_load import load_checkpoint  # noqa: F401  (re-exported, as above)
from diffrl.train.checkpoint_state import _model_state, _save_tensors, _split_optimizer_state
from diffrl.train.distributed import all_reduce_mean, world_size
from diffrl.train.distributed import rank as process_rank
from diffrl.train.rng_state import capture_rng_state

log = logging.getLogger(__name__)

_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
_PARTS_DIR = ".manifest-parts"


def _write_durable(path: Path, data: bytes) -> None:
    """Write `data` to `path` and flush it to the disk before the `complete` marker can vouch for it."""
    with naming(path), open(path, "wb") as f:
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


def _json_bytes(value: Any, what: str, fix: str) -> bytes:
    try:
        return json.dumps(value, indent=2, sort_keys=True, allow_nan=True).encode()
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what} must be JSON-able (numbers, strings, lists, dicts): {err}; {fix}") from err


def _data_files(directory: Path, skip_dir: str | None = None) -> list[str]:
    """Every file under `directory`, as sorted '/'-separated relative paths (hidden ones too)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(directory):
        if skip_dir in dirnames:
            dirnames.remove(skip_dir)
        for filename in filenames:
            found.append((Path(dirpath) / filename).relative_to(directory).as_posix())
    return sorted(found)


@contextmanager
def _every_rank_succeeds(stage: str) -> Iterator[None]:
    """This rank's part of one stage of a save, then a collective that tells every rank whether all
    parts succeeded; it takes the place of a barrier.

    A bare barrier after a rank's own writes would leave the other ranks waiting there until the
    process group's timeout when one rank's write fails (a full disk, a permission): here every
    rank reaches the collective, the failing rank raises its own error, and the others raise at
    once, naming the stage. Outside a process group it is just the stage.
    """
    error: BaseException | None = None
    try:
        yield
    except Exception as err:  # reported to the other ranks first, then re-raised unchanged
        error = err
    failed = all_reduce_mean({"failed": float(error is not None)})["failed"] > 0
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(
            f"checkpoint save failed on another rank while {stage}; its log has the error "
            "(this rank's part succeeded, and the checkpoint was not published)"
        )


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

    Call it on every rank (each rank writes its own shards; under a process group this is a
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
    extra_json = _json_bytes(extra, "extra", "convert tensors with .item() or .tolist()")
    scheduler_json = None
    if scheduler is not None:
        scheduler_json = _json_bytes(
            scheduler.state_dict(),
            f"the scheduler state of {type(scheduler).__name__}",
            "use a scheduler whose state is numbers and lists (torch.optim.lr_scheduler's with plain functions)",
        )

    root = Path(ckpt_dir_root)
    final = step_dir(root, step)
    tmp = root / f"{_TMP_PREFIX}{final.name}"
    rank = process_rank()

    model_state = _model_state(model, trainable_only)
    # An optimizer that has not stepped has no state; asking for one would initialise it with a
    # zero step (torch's _init_optim_state), shifting Adam's bias correction, so store none.
    has_optimizer_state = optimizer is not None and bool(optimizer.state)
    optim_tensors: dict[str, Any] = {}
    optim_json = None
    if has_optimizer_state:
        optim_state = get_optimizer_state_dict(model, optimizer)
        optim_tensors, description, scalars = _split_optimizer_state(optim_state["state"])
        optim_json = _json_bytes(
            {"param_groups": optim_state["param_groups"], "tensors": description, "scalars": scalars},
            "the optimizer's param groups",
            "keep hyper-parameters numbers, strings or lists",
        )

    meta = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "trainable_only": trainable_only,
        "adapters": lora_summary(model),
        "has_optimizer_state": has_optimizer_state,
        "has_scheduler": scheduler is not None,
        "world_size": world_size(),
        "torch_version": torch.__version__,
    }
    rank0_files = {"meta.json": _json_bytes(meta, "meta", ""), "extra.json": extra_json}
    if scheduler_json is not None:
        rank0_files["scheduler.json"] = scheduler_json
    if optim_json is not None:
        rank0_files["optim.json"] = optim_json

    try:
        with _every_rank_succeeds("creating the temporary folder"):
            if rank == 0:
                root.mkdir(parents=True, exist_ok=True)
                _remove_leftovers(root)
                tmp.mkdir()

        with _every_rank_succeeds("writing the shards"):
            _write_rank_files(tmp, rank, model_state, optim_tensors)
            if rank == 0:
                _write_rank0_files(tmp, rank0_files)

        # Each rank hashes a share of the files (a big model's shards take minutes on one core).
        with _every_rank_succeeds("hashing the files"):
            names = _data_files(tmp, skip_dir=_PARTS_DIR)
            part = {
                name: {"size": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
                for name in _my_share(names)
            }
            _write_durable(tmp / _PARTS_DIR / f"rank_{rank:05d}.json", _json_bytes(part, "manifest part", ""))

        with _every_rank_succeeds("publishing the checkpoint"):
            if rank == 0:
                _publish(root, tmp, final, names, step, keep_last)
    except BaseException:
        # a full disk or a failed rank: nothing half-written stays (the previous checkpoints do)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write_rank_files(tmp: Path, rank: int, model_state: dict, optim_tensors: dict) -> None:
    """What every rank writes: its shards of the model and optimizer state, its RNG state."""
    _save_tensors(model_state, tmp / MODEL_DIR)
    if optim_tensors:
        _save_tensors(optim_tensors, tmp / OPTIM_DIR)
    (tmp / RNG_DIR).mkdir(exist_ok=True)
    _write_durable(tmp / RNG_DIR / f"rank_{rank:05d}.json", _json_bytes(capture_rng_state(), "RNG state", ""))


def _write_rank0_files(tmp: Path, files: dict[str, bytes]) -> None:
    """What rank 0 alone writes: the metadata and JSON states, and the folder of the hash parts."""
    for name, data in files.items():
        _write_durable(tmp / name, data)
    (tmp / _PARTS_DIR).mkdir()


def _publish(root: Path, tmp: Path, final: Path, names: list[str], step: int, keep_last: int | None) -> None:
    """Rank 0: join the hash parts into the manifest, mark the folder complete, rename it into place."""
    files: dict[str, Any] = {}
    for part_file in sorted((tmp / _PARTS_DIR).iterdir()):
        files.update(json.loads(part_file.read_bytes()))
    assert sorted(files) == names, "every file is hashed by exactly one rank"
    shutil.rmtree(tmp / _PARTS_DIR)
    for sub in (MODEL_DIR, OPTIM_DIR, RNG_DIR):
        if (tmp / sub).is_dir():
            _fsync_dir(tmp / sub)
    manifest = _json_bytes({"format_version": FORMAT_VERSION, "step": step, "files": files}, "manifest", "")
    _write_durable(tmp / MANIFEST, manifest)
    _write_durable(tmp / COMPLETE_MARKER, f"{hashlib.sha256(manifest).hexdigest()}\n".encode())
    _fsync_dir(tmp)
    if final.exists():  # re-saving a step: move the old one aside, never delete before the rename
        final.rename(root / f"{_TRASH_PREFIX}{final.name}")
    os.replace(tmp, final)
    _fsync_dir(root)
    if keep_last is not None:
        _prune(root, keep_last, protect=final)
    _remove_leftovers(root)


def _remove_leftovers(root: Path) -> None:
    """Delete temporary directories of interrupted saves and renamed-aside old checkpoints."""
    for entry in root.iterdir():
        if entry.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)) and entry.is_dir():
            shutil.rmtree(entry)


def _prune(root: Path, keep_last: int, protect: Path) -> None:
    complete = complete_checkpoints(root)
    for _, path in complete[: max(len(complete) - keep_last, 0)]:
        if path != protect:
            trash = root / f"{_TRASH_PREFIX}{path.name}"
            path.rename(trash)
            shutil.rmtree(trash)
