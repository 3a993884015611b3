"""Resolve a config: schema defaults <- a preset or YAML file <- `key=value` overrides.

A preset or file may start from another one with a top-level `base: <preset or path>` key (a
path relative to the file naming it): the base is merged first, then the file's own keys, so a
variant states only what differs (e.g. `shapes_grpo_guard.yaml` is `base: default` plus its loss).

OmegaConf does the merging and the type checks against the dataclass schema; this module turns its
exceptions into messages that name the key, the value and the fix, then runs the schema's range
and cross-field validation.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from diffrl.config.schema import Config, ConfigError

PRESETS_DIR = Path(__file__).parent / "presets"
DEFAULT_PRESET = "default"


def preset_names() -> list[str]:
    return sorted(path.stem for path in PRESETS_DIR.glob("*.yaml"))


def preset_summary(name: str) -> str:
    """The first comment line of a preset file: what the preset is for."""
    for line in (PRESETS_DIR / f"{name}.yaml").read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def resolve_source(source: str | None) -> Path:
    """A preset name or a YAML path -> the file to read. None means the default preset."""
    if source is None:
        source = DEFAULT_PRESET
    if source.endswith((".yaml", ".yml")) or "/" in source:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(
                f"config file {source!r} does not exist (presets: {', '.join(preset_names())})"
            )
        return path
    path = PRESETS_DIR / f"{source}.yaml"
    if not path.is_file():
        names = preset_names()
        close = difflib.get_close_matches(source, names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"unknown preset {source!r}.{hint} Available presets: {', '.join(names)} "
            "(or pass a path to a .yaml file; `diffrl presets` describes each)"
        )
    return path


def load_config(source: str | None = None, overrides: Sequence[str] = (), job: str = "train") -> Config:
    """Defaults, then the preset/file `source`, then `overrides` ("a.b=value"), validated for `job`
    (`train` or `sft`: see `Config.validate`)."""
    path = resolve_source(source)
    merged: DictConfig = OmegaConf.structured(Config)
    layers = [*_file_layers(path, ()), ("command line", _parse_overrides(overrides))]
    for where, layer in layers:
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as err:
            raise ConfigError(f"{where}: {_explain(err)}") from None
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, Config)
    return cfg.validate(job)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _read_yaml(path: Path) -> DictConfig:
    try:
        layer = OmegaConf.load(path)
    except Exception as err:  # yaml's parser errors carry the line and column
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"{path}: a config file must be a mapping of sections (model:, rollout:, ...)")
    return layer


def _file_layers(path: Path, chain: tuple[Path, ...]) -> list[tuple[str, DictConfig]]:
    """The file's layer after those of its `base` chain (outermost base first)."""
    if path.resolve() in chain:
        names = " -> ".join(str(p) for p in (*chain, path.resolve()))
        raise ConfigError(f"{path}: `base` chain loops back on itself: {names}")
    layer = _read_yaml(path)
    base = layer.pop("base", None)
    if base is None:
        return [(str(path), layer)]
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base={base!r} must name a preset or a .yaml path")
    base_path = Path(base)
    if base.endswith((".yaml", ".yml")) and not base_path.is_absolute():
        base_path = path.parent / base_path  # relative to the file that names it
        if not base_path.is_file():
            raise FileNotFoundError(f"{path}: base {base!r} does not exist (looked at {base_path})")
    else:
        base_path = resolve_source(base)
    return [*_file_layers(base_path, (*chain, path.resolve())), (str(path), layer)]


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"override {item!r} is not key=value (e.g. rollout.sde.noise_level=0.8; "
                "lists as actor.optim.betas=[0.9,0.99])"
            )
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as err:
        raise ConfigError(f"command line: {_explain(err)}") from None


def _explain(err: OmegaConfBaseException) -> str:
    """OmegaConf's error -> one message naming the full key, the value and what is allowed."""
    key = err.full_key or err.key
    schema = err.object_type if is_dataclass(err.object_type) else None
    if isinstance(err, ConfigKeyError) and schema is not None:
        valid = [f.name for f in fields(schema)]
        close = difflib.get_close_matches(str(err.key), valid, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        parent = str(key).rpartition(".")[0] or "the top level"
        return f"unknown key {key!r}.{hint} Valid keys under {parent}: {', '.join(valid)}"
    if isinstance(err, ValidationError) and schema is not None and err.key is not None:
        expected = typing.get_type_hints(schema).get(str(err.key))
        expected_name = _type_name(expected) if expected is not None else "another type"
        value = getattr(err, "value", None)
        return f"{key}={value!r} has the wrong type: expected {expected_name}"
    return str(err).splitlines()[0]


def _type_name(tp: object) -> str:
    if is_dataclass(tp):
        return "a section (use its sub-keys, e.g. section.key=value)"
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")
