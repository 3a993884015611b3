"""Every config a run has used: RUN/config.yaml is the latest, RUN/configs/step_<N>.yaml the one each
start used from step N on (N = the step it resumed from; 0 for the first start).

A resume may change settings (`trainer.resume=auto actor.optim.lr=1e-2`, more
`trainer.total_steps`): the earlier steps were trained with the earlier file, which is kept, and
the keys that changed are printed as a warning when the run starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from diffrl.files import atomic_write_text

CONFIG_FILE = "config.yaml"
HISTORY_DIR = "configs"


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        flat.update(_flatten(value, name) if isinstance(value, dict) and value else {name: value})
    return flat


def changed_keys(old_yaml: str, new_yaml: str) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every key whose value differs; absent = None."""
    old, new = _flatten(yaml.safe_load(old_yaml) or {}), _flatten(yaml.safe_load(new_yaml) or {})
    return [
        (key, old.get(key), new.get(key))
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key)
    ]


def record_config(run_dir: Path, config_yaml: str, step: int) -> list[tuple[str, Any, Any]]:
    """Write the config of a start at `step`: RUN/configs/step_<step>.yaml and RUN/config.yaml
    (atomically). Returns the keys that changed from the run's previous config.yaml (none for a
    new run) and prints them as a warning; the previous file stays in RUN/configs/."""
    run_dir = Path(run_dir)
    history = run_dir / HISTORY_DIR
    history.mkdir(exist_ok=True)
    current = run_dir / CONFIG_FILE
    changes: list[tuple[str, Any, Any]] = []
    if current.is_file():
        previous = current.read_text(encoding="utf-8")
        changes = changed_keys(previous, config_yaml)
        if not any(history.glob("step_*.yaml")):  # a run from before this file kept a history
            atomic_write_text(history / "step_00000000.yaml", previous)
    path = history / f"step_{step:08d}.yaml"
    atomic_write_text(path, config_yaml)
    atomic_write_text(current, config_yaml)
    if changes:
        shown = "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in changes)
        print(
            f"warning: this start at step {step} changes {len(changes)} setting(s) of the run: {shown}. "
            f"The steps before were trained with the earlier settings, kept in {history}/; "
            f"{path.name} and {CONFIG_FILE} hold the new ones"
        )
    return changes


__all__ = ["CONFIG_FILE", "HISTORY_DIR", "changed_keys", "record_config"]
