"""Where an export may be written, and how it replaces an earlier one without losing anything.

An export folder is recognised by its manifest (`diffrl_export.json`, written into it before it is
published) and by holding nothing but what an export writes. `diffrl export --out X` may replace X
only when X is such a folder: a run, a checkpoint, a folder of runs, a folder of the user's own files
or a stray file are refused with a ValueError naming the folder (exit 2), and nothing is touched.

Writing is atomic: the export is built in a staging folder beside the target (marked as diffrl's own
when made, so a leftover of a crashed export is recognisable and nothing else ever is removed), then
published by two renames: the earlier export aside, the new one into place. Whatever moment a crash
comes, the earlier export survives whole (under its own name, or renamed aside) or the new one is
in place.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from diffusers.loaders.lora_base import LORA_WEIGHT_NAME_SAFE

from diffrl.files import naming
from diffrl.models.sampling import SAMPLING_FILE

EXPORT_INFO = "diffrl_export.json"  # the manifest: what an export came from, next to the weights
LORA_FILE = LORA_WEIGHT_NAME_SAFE  # the file diffusers' save_lora_weights writes and load_lora_weights reads
STAGING_MARK = ".diffrl-export-staging"  # inside a staging folder while diffrl builds an export in it
_REPLACED_SUFFIX = ".replaced"  # an earlier export renamed aside while the new one takes its place


def normalized(path: str | os.PathLike) -> Path:
    """`path` absolute and without `.`/`..` parts or a trailing slash, so `--out .` has a name."""
    return Path(os.path.abspath(os.fspath(path)))


def staging_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def replaced_path(out: Path) -> Path:
    return out.with_name(out.name + _REPLACED_SUFFIX)


def _entries_an_export_writes(folder: Path, manifest: dict) -> set[str]:
    names = {EXPORT_INFO, SAMPLING_FILE, STAGING_MARK}
    if manifest.get("kind") == "lora":
        return names | {LORA_FILE}
    # A pipeline: model_index.json and one folder per component it lists.
    names.add("model_index.json")
    try:
        index = json.loads((folder / "model_index.json").read_text())
    except (OSError, ValueError):
        return names
    return names | {key for key in index if not key.startswith("_")} if isinstance(index, dict) else names


def _not_an_export(out: Path) -> str | None:
    """Why the existing folder `out` is not an earlier export diffrl may replace, or None when it is."""
    manifest_file = out / EXPORT_INFO
    if not manifest_file.is_file():
        return f"it has no {EXPORT_INFO} (the manifest every diffrl export holds)"
    try:
        manifest = json.loads(manifest_file.read_text())
    except (OSError, ValueError) as err:
        return f"its {EXPORT_INFO} does not parse ({err})"
    if not isinstance(manifest, dict) or manifest.get("kind") not in ("lora", "pipeline"):
        return f"its {EXPORT_INFO} does not describe a LoRA or pipeline export"
    unexpected = sorted(
        entry.name for entry in out.iterdir() if entry.name not in _entries_an_export_writes(out, manifest)
    )
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (
            f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        )
        return f"it holds files an export does not write ({shown})"
    return None


def check_export_target(
    out: str | os.PathLike, *, protected: tuple[Path, ...] = (), what: str = "--out"
) -> Path:
    """The normalized `out` if an export may be written there, else a ValueError naming it and why.

    `out` may be new, or an earlier export (see the module docstring). It may never be one of the
    `protected` folders (the run being exported, its checkpoint) nor a folder that holds one.
    """
    out = normalized(out)
    protected = [normalized(folder) for folder in protected]
    for folder in protected:
        if out == folder or out in folder.parents:
            role = "is" if out == folder else "holds"
            raise ValueError(
                f"{what} {str(out)!r} {role} {str(folder)!r}, which this export reads: an export replaces "
                f"its folder, so that would delete it. Give a new folder, e.g. {what} "
                f"{protected[0].with_name(protected[0].name + '_export')}"
            )
    if os.path.islink(out):
        raise ValueError(f"{what} {str(out)!r} is a symbolic link: give the folder itself or a new path")
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"{what} {str(out)!r} is a file, not a folder: give a new folder path")
        reason = _not_an_export(out) if any(out.iterdir()) else None
        if reason is not None:
            raise ValueError(
                f"{what} {str(out)!r} exists and is not an earlier diffrl export: {reason}. An export "
                "replaces only an earlier export; give a new folder, or move this one away first"
            )
    staging = staging_path(out)
    if os.path.lexists(staging) and (staging.is_symlink() or not (staging / STAGING_MARK).is_file()):
        raise ValueError(
            f"{str(staging)!r} exists and is not a leftover of a diffrl export (it has no {STAGING_MARK}); "
            f"the export is built there before it replaces {str(out)!r}: move it away, or give another {what}"
        )
    aside = replaced_path(out)
    if os.path.lexists(aside) and (aside.is_symlink() or not aside.is_dir() or _not_an_export(aside)):
        raise ValueError(
            f"{str(aside)!r} exists and is not an earlier diffrl export; an earlier export is renamed "
            f"there while the new one takes its place: move it away, or give another {what}"
        )
    return out


def write_manifest(folder: Path, **info) -> None:
    """The export's manifest (what it came from: kind "lora" or "pipeline", run, step, base model)."""
    assert info.get("kind") in ("lora", "pipeline"), info
    with naming(folder / EXPORT_INFO):  # a full disk fails the write naming no file
        (folder / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")


def begin_staging(out: Path) -> Path:
    """A fresh, marked staging folder beside `out` (a leftover of a crashed export is removed first:
    `check_export_target` has made sure it is one). Call it on one process (rank 0)."""
    staging = staging_path(out)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    (staging / STAGING_MARK).touch()
    return staging


def publish(staging: Path, out: Path) -> Path:
    """Put the finished export `staging` in place of `out` (an earlier export, or nothing)."""
    aside = replaced_path(out)
    if os.path.lexists(aside):
        shutil.rmtree(aside)  # an earlier export a crashed publish left aside (checked to be one)
    if out.exists():
        out.rename(aside)
    staging.rename(out)
    (out / STAGING_MARK).unlink()  # last: a crash before it leaves a whole export, mark and all
    if aside.exists():
        shutil.rmtree(aside)
    return out
