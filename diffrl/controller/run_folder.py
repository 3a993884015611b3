"""A run's directory while one process owns it: created if new, locked (flock on RUN/.lock), the
checkpoint to resume checked against the config, removed again when a new run fails before its
first record, and trainer.output_dir/latest pointed at it (`run_folder`, used by
diffrl.controller.run.run_job). Stdlib and small files only: nothing here loads a model.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from diffrl.config.history import CONFIG_FILE
from diffrl.config.loader import resolve_source
from diffrl.config.schema import Config, ConfigError
from diffrl.files import naming
from diffrl.train.checkpoint import complete_checkpoints, latest_checkpoint, verify_checkpoint

LOCK_FILE = ".lock"


def find_checkpoint(cfg: Config, run_dir: Path) -> Path | None:
    resume = cfg.trainer.resume
    if resume == "off":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir / "checkpoints") if run_dir.exists() else None
    path = Path(resume)
    if not path.exists():
        raise FileNotFoundError(
            f"trainer.resume={resume!r} does not exist: give a checkpoint directory, auto or off"
        )
    return path


def check_checkpoint(cfg: Config, path: Path, verified: bool = False) -> None:
    """The checkpoint to resume from verifies against its manifest (unless `verified`: then
    `latest_checkpoint` just did) and was saved with this config's LoRA settings: both read from
    small files before any model loads (the load itself would find a mismatch minutes later)."""
    meta = json.loads((path / "meta.json").read_text()) if verified else verify_checkpoint(path)
    rank, alpha = cfg.model.lora.rank, cfg.model.lora.alpha
    if "trainable_only" in meta and bool(meta["trainable_only"]) != (rank > 0):
        saved = "LoRA adapters" if meta["trainable_only"] else "full-model weights"
        raise ValueError(
            f"checkpoint {str(path)!r} holds {saved} but model.lora.rank={rank} "
            f"({'LoRA' if rank > 0 else 'full fine-tuning'}): use the run's own model.lora settings to "
            "resume it, or start a new run (another trainer.run_name, or trainer.resume=off)"
        )
    adapters = {name: a for name, a in (meta.get("adapters") or {}).items() if isinstance(a, dict)}
    for name, adapter in adapters.items():
        for key, field, value in (("r", "rank", rank), ("lora_alpha", "alpha", alpha)):
            saved = adapter.get(key)
            if saved is not None and float(saved) != float(value):
                raise ValueError(
                    f"checkpoint {str(path)!r} was saved with model.lora.{field}={saved} (adapter {name!r}) "
                    f"but the config has model.lora.{field}={value}: set model.lora.{field}={saved} to resume "
                    "it, or start a new run (another trainer.run_name, or trainer.resume=off)"
                )
    saved_targets = {
        name: a["target_modules"] for name, a in adapters.items() if isinstance(a.get("target_modules"), list)
    }
    if rank > 0 and saved_targets:
        targets = _lora_targets(cfg)
        for name, saved in saved_targets.items():
            if sorted(saved) != targets:
                raise ValueError(
                    f"checkpoint {str(path)!r} was saved with LoRA on {sorted(saved)} (adapter {name!r}) but "
                    f"this config adapts {targets} (model.lora.target_modules="
                    f"{cfg.model.lora.target_modules}): set model.lora.target_modules=[{','.join(sorted(saved))}] "
                    "to resume it, or start a new run (another trainer.run_name, or trainer.resume=off)"
                )


def _lora_targets(cfg: Config) -> list[str]:
    """The module names this config's LoRA adapts, as meta.json records them (sorted): the
    configured list, else the model family's default (diffrl.train.lora.target_modules)."""
    from diffrl.models import adapter_class, read_model_index
    from diffrl.train.lora import target_modules

    family = adapter_class(read_model_index(cfg.model.path)["_class_name"])
    return sorted(set(target_modules(cfg.model.lora, family)))


def _lock(run_dir: Path) -> int:
    """Hold RUN/.lock exclusively (flock) for as long as this process owns the run; returns the fd.

    The OS drops the lock when the process ends, however it ends, so a kill -9 leaves no stale lock.
    The file holds the owner's PID, for the message another start gets."""
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)  # FileNotFoundError: no folder
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ValueError(
            f"run folder {run_dir} is in use by another run (PID {owner}): wait for it to end or stop it, "
            "or choose another trainer.run_name"
        ) from None
    except OSError as err:  # e.g. ENOLCK: a file system without locks
        os.close(fd)
        raise ValueError(
            f"cannot lock run folder {run_dir} ({err}): put trainer.output_dir on a local file system"
        ) from None
    try:
        with naming(run_dir / LOCK_FILE):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
    except OSError:  # e.g. ENOSPC: the caller removes a folder it made
        os.close(fd)
        raise
    return fd


def _create_and_lock(run_dir: Path, attempts: int = 5) -> tuple[int, bool]:
    """Make the run folder if it is missing and lock it; returns (lock fd, whether this call made it).

    A start that fails removes the folder it made, and it can do so after another start found the
    folder and opened its lock file: that start would then lock a file no longer in any folder and
    run in a folder that is gone. So after locking, the file locked must still be the one at
    RUN/.lock; when it is not (or the folder vanished before the open), start over.
    """
    for _ in range(attempts):
        try:
            run_dir.mkdir(parents=True)
            created = True
        except FileExistsError:  # it existed, or another start made it a moment ago: the lock decides
            created = False
        try:
            fd = _lock(run_dir)
        except FileNotFoundError:  # removed between the mkdir and the open
            continue
        except BaseException:  # a full disk, a refused lock: leave no half-made folder behind
            if created:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        try:
            current = os.stat(run_dir / LOCK_FILE)
        except FileNotFoundError:
            current = None
        held = os.fstat(fd)
        if current is not None and (current.st_dev, current.st_ino) == (held.st_dev, held.st_ino):
            return fd, created
        os.close(fd)
    raise ValueError(
        f"run folder {run_dir} kept being removed while this start tried to lock it (another start on the "
        "same trainer.run_name failing repeatedly?): check the other process, or choose another trainer.run_name"
    )


@dataclass
class RunFolder:
    """A run's directory while this process owns it: locked, and its checkpoint to resume from."""

    path: Path
    name: str
    checkpoint: Path | None
    created: bool  # this start made the directory (a failure before the run has a record removes it)
    # Whether the run has recorded anything of its own (`job` asks its logger: a step was logged),
    # so that a failure must keep the folder; until it is told, whether config.yaml was written.
    recorded: Callable[[], bool]


def _point_latest_back(run_dir: Path, previous: str | None) -> None:
    """After a failed new run's folder is removed: trainer.output_dir/latest, if it still names it,
    names the run it named before (`previous`), or goes."""
    link = run_dir.parent / "latest"
    if not link.is_symlink() or os.readlink(link) != run_dir.name:
        return  # not made by this start, or another start has moved it on since
    if previous is None:
        link.unlink()
        return
    staging = run_dir.parent / f".latest.{os.getpid()}"
    staging.unlink(missing_ok=True)
    os.symlink(previous, staging)
    os.replace(staging, link)


@contextmanager
def run_folder(cfg: Config, source: str | None) -> Iterator[RunFolder]:
    """Own trainer.output_dir/run_name: create the directory if new, lock it, check the resume
    checkpoint against the config; release on exit.

    Nothing of an existing run is changed here: its config.yaml is rewritten only once the run has
    started (`run_loop`). When a new run fails before its first record (`RunFolder.recorded`: a
    reward that raises in step 1, say), the directory this call created is removed again and
    trainer.output_dir/latest named what it named before, so a failed start leaves nothing behind."""
    run_name = cfg.trainer.run_name or f"{resolve_source(source).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.trainer.output_dir) / run_name
    latest = run_dir.parent / "latest"
    previous_latest = os.readlink(latest) if latest.is_symlink() else None
    checkpoint, folder = None, None
    if not run_dir.exists():
        checkpoint = _check_resume_target(cfg, run_dir)  # an explicit trainer.resume path
    fd, created = None, False
    try:
        fd, created = _create_and_lock(run_dir)
        if not created:
            checkpoint = _check_resume_target(cfg, run_dir)
        from diffrl.telemetry.console import console_log, run_started

        folder = RunFolder(run_dir, run_name, checkpoint, created, lambda: (run_dir / CONFIG_FILE).exists())
        with console_log(run_dir):  # RUN/console.log, once the run has started (run_loop)
            run_started(run_dir, checkpoint)  # the run's first line: where to look
            yield folder
    except BaseException:
        if created and fd is not None and not (folder is not None and folder.recorded()):
            shutil.rmtree(run_dir, ignore_errors=True)
            _point_latest_back(run_dir, previous_latest)
            if folder is not None:  # it was announced ("run directory: ..."): say where it went
                print(f"removed {run_dir}: the run failed before it recorded a step", flush=True)
        raise
    finally:
        if fd is not None:
            os.close(fd)


def link_latest(run_dir: Path) -> None:
    """trainer.output_dir/latest -> the run started last (a relative symlink, swapped atomically),
    so `diffrl eval runs/latest` and the README's commands work as printed."""
    link = run_dir.parent / "latest"
    if link.exists() and not link.is_symlink():
        print(f"note: {link} is not a link (a run named 'latest'?), so it is left as it is")
        return
    staging = run_dir.parent / f".latest.{os.getpid()}"
    staging.unlink(missing_ok=True)
    os.symlink(run_dir.name, staging)
    os.replace(staging, link)


def _check_resume_target(cfg: Config, run_dir: Path) -> Path | None:
    checkpoint = find_checkpoint(cfg, run_dir)
    if checkpoint is None and cfg.trainer.resume == "off" and latest_checkpoint(run_dir / "checkpoints"):
        raise ConfigError(
            f"{run_dir} already holds checkpoints and trainer.resume=off: choose another trainer.run_name, "
            "or trainer.resume=auto to continue it"
        )
    if checkpoint is None and (run_dir / CONFIG_FILE).is_file():
        # A start from step 0 would rewrite the run's records (metrics.jsonl, configs/step_00000000.yaml):
        # the earlier start's settings and curves are all that is left of it.
        raise ConfigError(
            f"{run_dir} holds an earlier start of this run ({CONFIG_FILE}, its metrics and config history) "
            f"but no checkpoint to resume from (trainer.resume={cfg.trainer.resume}): starting it over would "
            "overwrite those records. Choose another trainer.run_name for a new run, resume a copy of a "
            "checkpoint with trainer.resume=PATH, or move the folder away yourself to reuse its name"
        )
    if checkpoint is not None:
        check_checkpoint(cfg, checkpoint, verified=cfg.trainer.resume == "auto")
        _check_not_past_total(cfg, checkpoint)
    return checkpoint


def _check_not_past_total(cfg: Config, checkpoint: Path) -> None:
    """A checkpoint saved after `trainer.total_steps` would resume into a run with nothing left to
    train and export that later step's weights as if they were the requested step's: refuse it,
    naming the kept checkpoint that does match when there is one."""
    step = json.loads((checkpoint / "meta.json").read_text())["step"]
    total = cfg.trainer.total_steps
    if step <= total:
        return
    earlier = [path for kept, path in complete_checkpoints(checkpoint.parent) if kept <= total]
    fix = (
        f"resume the newest checkpoint at or before step {total}: trainer.resume={earlier[-1]}"
        if earlier
        else f"start a new run (another trainer.run_name): no kept checkpoint is at or before step {total}"
    )
    raise ConfigError(
        f"trainer.total_steps={total} is below step {step} of the checkpoint this run would resume "
        f"({checkpoint}): it would train nothing and end with step {step}'s weights. Raise "
        f"trainer.total_steps, or {fix}"
    )


def prepare_run(cfg: Config, source: str | None) -> tuple[Path, str, Path | None]:
    """The run directory, its name, and the checkpoint to resume from (None for a fresh run),
    without holding the folder (tests and tools); `diffrl train` uses `run_folder`."""
    with run_folder(cfg, source) as folder:
        return folder.path, folder.name, folder.checkpoint


__all__ = [
    "LOCK_FILE",
    "RunFolder",
    "check_checkpoint",
    "find_checkpoint",
    "link_latest",
    "prepare_run",
    "run_folder",
]
