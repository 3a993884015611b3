"""What a checkpoint folder holds and how it is checked before anything in it is used.

The layout's names (`diffrl.train.checkpoint` describes the files), the manifest and its
`complete` marker, `verify_checkpoint` (every file listed, sized and hashed as the manifest says,
every safetensors header readable, every JSON file parsed and of the shape a load reads) and
`latest_checkpoint` (the newest checkpoint that verifies). `diffrl.train.checkpoint` writes and
loads checkpoints and re-exports these names.

A parse error is a verification failure: a file that hashes right because its manifest was
forged too, but does not parse or does not fit, fails here, in the driver, before any worker
starts, where `trainer.resume=auto` falls back to the previous checkpoint and an explicit path is
a `CheckpointError` (a ValueError: exit 2).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import safe_open

from diffrl.data.sampler import state_problem as sampler_state_problem
from diffrl.train.distributed import all_reduce_mean, is_distributed, world_size
from diffrl.train.distributed import rank as process_rank
from diffrl.train.rng_state import parse_rng_state

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
COMPLETE_MARKER = "complete"
MANIFEST = "manifest.json"
MODEL_DIR, OPTIM_DIR, RNG_DIR = "model", "optim", "rng"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
# Every file a checkpoint may hold besides the manifest and the marker. Anything else (a `.pt`,
# DCP's `.metadata`, a `.pkl`) was not written by save_checkpoint and is refused, not ignored.
_ALLOWED_FILE = re.compile(
    r"^(meta\.json|extra\.json|optim\.json|scheduler\.json|rng/rank_\d{5}\.json"
    r"|(model|optim)/shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors)$"
)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_FIX = (
    "this checkpoint is damaged or was not written by diffrl: load another one (trainer.resume=auto skips "
    "damaged checkpoints and takes the newest intact one), or delete it"
)


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded: damaged, altered, incomplete or of an unsafe old format."""


def _read_json(path: Path, name: str) -> Any:
    """A checkpoint's JSON file (already checksummed); a malformed one is a CheckpointError naming it."""
    try:
        return json.loads((path / name).read_bytes())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"checkpoint {str(path)!r}: {name} is not valid JSON ({err}); {_FIX}") from err


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def step_dir(root: str | Path, step: int) -> Path:
    """`<root>/step_<step:08d>`: the name sorts by step as text too."""
    return Path(root) / f"step_{step:08d}"


def _my_share(names: list[str]) -> list[str]:
    """This rank's part of `names` (sorted) when the ranks split hashing work round-robin."""
    return sorted(names)[process_rank() :: world_size()]


# ---------------------------------------------------------------------------------- verify
def _is_legacy(path: Path) -> bool:
    """A checkpoint of format 1 (torch.distributed.checkpoint): recognised by names only, never read."""
    if (path / MANIFEST).exists():
        return False
    return (path / ".metadata").exists() or any(path.glob("*.distcp"))


def _refuse_legacy(path: Path) -> None:
    raise CheckpointError(
        f"checkpoint {str(path)!r} was written by an older diffrl (format 1, torch.distributed.checkpoint): "
        "loading it unpickles its .metadata file, which can run arbitrary code, so this diffrl refuses to read "
        "it. Re-train (the run's config.yaml reproduces it), or, only if you trust where the files came from, "
        "export its weights with the diffrl version that wrote it (diffrl export RUN --out DIR) and start from "
        "that export"
    )


def _walk_entries(path: Path) -> tuple[list[str], list[str]]:
    """(files, anomalies) under `path`: files as relative paths; symlinks and special files as anomalies."""
    files, anomalies = [], []
    for dirpath, dirnames, filenames in os.walk(path):
        base = Path(dirpath)
        for name in list(dirnames):
            if (base / name).is_symlink():
                anomalies.append(f"{(base / name).relative_to(path).as_posix()} (a symlink)")
                dirnames.remove(name)
        for name in filenames:
            entry = base / name
            relative = entry.relative_to(path).as_posix()
            if entry.is_symlink() or not entry.is_file():
                anomalies.append(f"{relative} (a symlink or special file)")
            else:
                files.append(relative)
    return sorted(files), anomalies


def _read_manifest(path: Path) -> dict[str, dict[str, Any]]:
    """The manifest's file table, after checking that the `complete` marker vouches for it."""
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} has no {MANIFEST}; {_FIX}")
    manifest_bytes = (path / MANIFEST).read_bytes()
    marker = (path / COMPLETE_MARKER).read_bytes().strip()
    if marker != hashlib.sha256(manifest_bytes).hexdigest().encode():
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {MANIFEST} does not match the sha256 in the {COMPLETE_MARKER!r} marker "
            f"(one of them is truncated or altered); {_FIX}"
        )
    manifest = _read_json(path, MANIFEST)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {MANIFEST} is not a format-{FORMAT_VERSION} manifest; {_FIX}"
        )
    for name, entry in files.items():
        if not _ALLOWED_FILE.match(name):
            raise CheckpointError(
                f"checkpoint {str(path)!r}: {MANIFEST} lists {name!r}, which is not a file diffrl writes "
                f"(checkpoints hold only JSON and safetensors files); {_FIX}"
            )
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("size"), int)
            and isinstance(entry.get("sha256"), str)
            and _SHA256.match(entry["sha256"])
        ):
            raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} entry {name!r} is malformed; {_FIX}")
    return files


def _hash_problems(path: Path, files: dict[str, dict[str, Any]], names: list[str]) -> dict[str, str]:
    """{file: what is wrong} for the `names` whose content is not what the manifest says."""
    problems = {}
    for name in names:
        if _sha256(path / name) != files[name]["sha256"]:
            problems[name] = "its sha256 differs from the manifest's (the content was altered)"
        elif name.endswith(".safetensors"):
            try:  # the header only: a file that hashes right but does not parse was forged with its manifest
                with safe_open(str(path / name), framework="pt") as f:
                    f.keys()
            except Exception as err:  # safetensors raises its own error types
                problems[name] = f"it is not a valid safetensors file ({err})"
    return problems


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check a checkpoint directory against its manifest and return its meta.json; nothing is unpickled.

    Raises FileNotFoundError for a missing path and `CheckpointError` (a ValueError) naming the
    file and the fix when the checkpoint is incomplete, of the unsafe old format, or differs from
    its manifest in any way: a file missing, extra (e.g. a planted `.pt` or `.metadata`), truncated
    or altered. Under a process group call it on every rank: the ranks hash a share each.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"checkpoint {str(path)!r} does not exist: pass a step_XXXXXXXX directory written by "
            "save_checkpoint (latest_checkpoint(root) finds the newest)"
        )
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} is a file: pass a step_XXXXXXXX directory")
    if _is_legacy(path):
        _refuse_legacy(path)
    if not (path / COMPLETE_MARKER).is_file():
        if complete_checkpoints(path):
            raise CheckpointError(
                f"{str(path)!r} is a checkpoint root, not a checkpoint: pass one of its step_XXXXXXXX "
                f"directories, e.g. latest_checkpoint(root) = {_latest_quietly(path)}"
            )
        raise CheckpointError(
            f"checkpoint {str(path)!r} is incomplete (no {COMPLETE_MARKER!r} marker: its save was interrupted "
            f"or it was not written by save_checkpoint); load a complete one instead, e.g. the newest in "
            f"{str(path.parent)!r}: {_latest_quietly(path.parent)}"
        )
    files = _read_manifest(path)
    on_disk, anomalies = _walk_entries(path)
    on_disk = [name for name in on_disk if name not in (MANIFEST, COMPLETE_MARKER)]
    extra_files = sorted(set(on_disk) - set(files)) + anomalies
    if extra_files:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds file(s) its manifest does not list: {extra_files}. diffrl "
            "checkpoints hold only JSON and safetensors files and never unpickle anything; a .pt, .pkl or "
            f".metadata file there was not written by save_checkpoint. Delete the file(s) if you know where "
            f"they came from; otherwise {_FIX}"
        )
    for name in sorted(files):
        if name not in on_disk:
            raise CheckpointError(
                f"checkpoint {str(path)!r} is missing {name!r} (listed in its manifest); {_FIX}"
            )
        size = (path / name).stat().st_size
        if size != files[name]["size"]:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: {name!r} has {size} bytes, its manifest says {files[name]['size']} "
                f"(truncated or altered); {_FIX}"
            )
    problems = _hash_problems(path, files, _my_share(list(files)))
    if is_distributed():  # every rank must raise the same error, or the others would wait for it
        flags = all_reduce_mean({name: float(name in problems) for name in files})
        problems = {
            name: problems.get(name, "another rank found its sha256 or header wrong")
            for name, flag in flags.items()
            if flag > 0
        }
    if problems:
        listed = "; ".join(f"{name!r}: {why}" for name, why in sorted(problems.items()))
        raise CheckpointError(f"checkpoint {str(path)!r} failed verification: {listed}; {_FIX}")

    meta = _read_json(path, "meta.json")
    problem = _meta_problem(path, meta)
    if problem:
        raise CheckpointError(f"checkpoint {str(path)!r}: meta.json {problem}; {_FIX}")
    for name in sorted(files):
        if name.endswith(".json") and name != "meta.json":
            problem = _json_problem(path, name, _read_json(path, name), meta)
            if problem:
                raise CheckpointError(f"checkpoint {str(path)!r}: {name} {problem}; {_FIX}")
    return meta


# ---------------------------------------------------------------------------------- JSON fields
# Every field a load reads from a checkpoint's JSON files is checked here, in type and range, so a
# file that hashes right under a forged manifest fails the verification (named, with the value),
# not the load in a worker, nor the run steps later.
def _is_count(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _is_flag(value: Any) -> bool:
    return isinstance(value, bool)


_META_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "format_version": (_is_count, "an integer"),
    "step": (_is_count, "an integer >= 0"),
    "trainable_only": (_is_flag, "true or false"),
    "has_optimizer_state": (_is_flag, "true or false"),
    "has_scheduler": (_is_flag, "true or false"),
    "world_size": (lambda value: _is_count(value, low=1), "an integer >= 1"),
    "adapters": (lambda value: isinstance(value, dict), "an object {adapter: its LoRA settings}"),
}
# The LoRA settings of each adapter (checkpoint_fit.LORA_FIELDS), compared with the model's on load.
_ADAPTER_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "r": (lambda value: _is_count(value, low=1), "an integer >= 1"),
    "lora_alpha": (lambda value: _is_number(value) and value > 0, "a number > 0"),
    "target_modules": (
        lambda value: value is None or isinstance(value, str) or _is_str_list(value),
        "a module name, a list of them, or null",
    ),
    "use_rslora": (lambda value: value is None or _is_flag(value), "true, false or null"),
    "use_dora": (lambda value: value is None or _is_flag(value), "true, false or null"),
}


def _field_problem(fields: dict[str, tuple[Callable[[Any], bool], str]], value: dict, at: str) -> str | None:
    missing = [key for key in fields if key not in value]
    if missing:
        return f"lacks {at}{missing}"
    for key, (valid, expected) in fields.items():
        if not valid(value[key]):
            return f"has {at}{key}={value[key]!r}, which must be {expected}"
    return None


def _meta_problem(path: Path, meta: Any) -> str | None:
    """What is wrong with the parsed meta.json of the checkpoint `path`, or None."""
    if not isinstance(meta, dict):
        return f"is not a JSON object but a {type(meta).__name__}"
    problem = _field_problem(_META_FIELDS, meta, "")
    if problem:
        return problem
    if meta["format_version"] != FORMAT_VERSION:
        return f"has format version {meta['format_version']}; this diffrl reads version {FORMAT_VERSION}"
    named = _STEP_DIR.match(path.name)
    if named and int(named.group(1)) != meta["step"]:
        return f"says step {meta['step']}, its folder's name step {int(named.group(1))}"
    if meta["trainable_only"] and not meta["adapters"]:
        return "says trainable_only (LoRA adapters) but lists no adapters"
    for name, adapter in meta["adapters"].items():
        if not isinstance(adapter, dict):
            return f"has adapters[{name!r}]={adapter!r}, which must be an object of its LoRA settings"
        problem = _field_problem(_ADAPTER_FIELDS, adapter, f"adapters[{name!r}].")
        if problem:
            return problem
    return None


def _is_json_scalar(value: Any) -> bool:
    """A JSON leaf a state may hold: a finite number, true/false, a string or null."""
    return value is None or isinstance(value, bool | str) or _is_number(value)


def _is_plain_state(value: Any) -> bool:
    """A JSON scalar, or a list or object of plain states: no NaN or infinity anywhere."""
    if isinstance(value, list):
        return all(_is_plain_state(item) for item in value)
    if isinstance(value, dict):
        return all(_is_plain_state(item) for item in value.values())
    return _is_json_scalar(value)


def _optim_problem(value: dict) -> str | None:
    tensors, scalars, groups = value.get("tensors"), value.get("scalars"), value.get("param_groups")
    if not (isinstance(tensors, dict) and all(_is_str_list(keys) for keys in tensors.values())):
        return "has no valid 'tensors' table ({parameter: [state keys]})"
    if not (isinstance(scalars, dict) and all(isinstance(v, dict) for v in scalars.values())):
        return "has no valid 'scalars' table ({parameter: {key: number}})"
    for fqn, values in scalars.items():
        for key, item in values.items():
            if not _is_json_scalar(item):
                return f"has scalars[{fqn!r}][{key!r}]={item!r}, which must be a finite number, a flag or a string"
    if not (isinstance(groups, list) and groups and all(isinstance(g, dict) for g in groups)):
        return "has no valid 'param_groups' list"
    for index, group in enumerate(groups):
        if not _is_str_list(group.get("params")):
            return f"has param_groups[{index}].params={group.get('params')!r}, which must be a list of parameter names"
        for key, item in group.items():
            if key != "params" and not _is_plain_state(item):
                return f"has param_groups[{index}].{key}={item!r}, which must be finite numbers, flags or strings"
        if not (_is_number(group.get("lr")) and group["lr"] >= 0):
            return f"has param_groups[{index}].lr={group.get('lr')!r}, which must be a number >= 0"
    return None


# LRScheduler.state_dict's counters; its other entries are compared with the live scheduler on load.
_SCHEDULER_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "last_epoch": (lambda value: _is_count(value, low=-1), "an integer >= -1"),
    "_step_count": (_is_count, "an integer >= 0"),
    "base_lrs": (
        lambda value: isinstance(value, list) and all(_is_number(v) and v >= 0 for v in value),
        "a list of numbers >= 0",
    ),
}


def _scheduler_problem(value: dict) -> str | None:
    for key, (valid, expected) in _SCHEDULER_FIELDS.items():
        if key in value and not valid(value[key]):
            return f"has {key}={value[key]!r}, which must be {expected}"
    for key, item in value.items():
        if not _is_plain_state(item):
            return f"has {key}={item!r}, which must be finite numbers, flags or strings"
    return None


def _json_problem(path: Path, name: str, value: Any, meta: dict[str, Any]) -> str | None:
    """What is wrong with the parsed JSON file `name` of a checkpoint, or None: its shape is what a
    load reads, so a file that hashes right (a forged manifest) but would fail the load fails the
    verification instead, where `trainer.resume=auto` falls back and an explicit path exits 2."""
    if not isinstance(value, dict):
        return f"is not a JSON object but a {type(value).__name__}"
    if name == "extra.json":
        step = value.get("step", meta["step"])
        if isinstance(step, bool) or step != meta["step"]:
            return f"says step {step!r}, its meta.json step {meta['step']!r}"
        # the data sampler's position, where the loops keep it (TrainingLoop.save)
        if "data" in value and (problem := sampler_state_problem(value["data"])) is not None:
            return f"holds a data position that cannot be resumed: {problem}"
    elif name == "optim.json":
        return _optim_problem(value)
    elif name == "scheduler.json":
        return _scheduler_problem(value)
    elif name.startswith(f"{RNG_DIR}/"):
        try:
            parse_rng_state(value)
        except ValueError as err:
            return f"is not a valid RNG state ({err})"
    return None


def fit_problem(saved: Any, live: Any, at: str) -> str | None:
    """Where the JSON value `saved` (an optimizer's param group, a scheduler's state) does not have
    the type of the live value `live` it replaces on load, as 'AT=VALUE, where this run has LIVE',
    or None. Lists must also have the live one's length; objects may hold only keys the live one
    has. A null on either side fits any value (torch's `foreach=None` defaults)."""
    if isinstance(live, list | tuple) and isinstance(saved, list) and len(saved) == len(live):
        for index, (item, live_item) in enumerate(zip(saved, live, strict=True)):
            if problem := fit_problem(item, live_item, f"{at}[{index}]"):
                return problem
        return None
    if isinstance(live, dict) and isinstance(saved, dict):
        unknown = sorted(set(saved) - set(live))
        if unknown:
            return f"{at} has {unknown}, which this run's has not"
        for key, item in saved.items():
            if problem := fit_problem(item, live[key], f"{at}.{key}"):
                return problem
        return None
    if saved is None or live is None:
        fits = True
    elif isinstance(live, bool):
        fits = isinstance(saved, bool)
    elif isinstance(live, int | float):
        fits = _is_number(saved)
    elif isinstance(live, str):
        fits = isinstance(saved, str)
    else:  # a list or an object that does not match, or a type no JSON value could stand for
        fits = not isinstance(live, list | tuple | dict)
    return None if fits else f"{at}={saved!r}, where this run has {live!r}"


# ---------------------------------------------------------------------------------- find
def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of the step directories under `root` that have a `complete` marker, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _latest_quietly(root: Path) -> Path | None:
    """For hints inside error messages: the newest checkpoint that verifies, without warnings or errors."""
    for _, path in reversed(complete_checkpoints(root)):
        with contextlib.suppress(ValueError, OSError):
            verify_checkpoint(path)
            return path
    return None


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint under `root` that verifies (see `verify_checkpoint`), or None when there is none.

    A checkpoint that fails verification (damaged, altered, of the unsafe old format) is skipped
    with a warning naming it and why, and the next older one is tried. Temporary directories of
    interrupted saves and step directories without the `complete` marker are not checkpoints.
    A missing `root` is a run that has not saved yet: None. When checkpoints exist but none
    verifies, this raises a CheckpointError listing them: starting over silently would lose the run.

    Call it in one process (the driver), not under a process group: it hashes every file itself.
    """
    candidates = complete_checkpoints(Path(root))
    skipped = []
    for _, path in reversed(candidates):
        try:
            verify_checkpoint(path)
        except (ValueError, OSError) as err:
            log.warning("skipping checkpoint %s: %s", path, err)
            skipped.append(f"{path.name}: {err}")
            continue
        if skipped:
            log.warning("using checkpoint %s (skipped %d newer damaged one(s))", path, len(skipped))
        return path
    if skipped:
        raise CheckpointError(
            f"no checkpoint in {str(root)!r} verifies: "
            + " | ".join(skipped)
            + ". Resume from a copy you trust (trainer.resume=PATH), or start a new run (another trainer.run_name)"
        )
    return None
