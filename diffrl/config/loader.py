"""Resolve a config: schema defaults <- a preset or YAML file <- `key=value` overrides.

A preset or file may start from another one with a top-level `base: <preset or path>` key (a
path relative to the file naming it): the base is merged first, then the file's own keys, so a
variant states only what differs (e.g. `shapes_grpo_guard.yaml` is `base: shapes_base` plus its loss).
A file without `base:` starts from the schema's defaults, which name no model: a user's file that
leaves model.path empty that way is refused at once, saying to add `base: default`.

Mappings of named entries (`reward.functions`, each reward's `args`: every `dict[str, ...]` of the
schema) merge entry by entry like everything else, and two more operations let a layer take entries
away from the layers below it:

- `null` as an entry's value removes the entry (`reward.functions.shapes=null`, or `shapes: null`
  in YAML); naming an entry that does not exist is an error listing the ones that do;
- the YAML tag `!replace` on such a mapping replaces it wholesale
  (`functions: !replace {ocr: {weight: 1}}`, or `'reward.functions=!replace {ocr: {weight: 1}}'` on
  the command line): the layers below contribute none of their entries.

OmegaConf does the merging and the type checks against the dataclass schema; this module turns its
exceptions into messages that name the key, the value and the fix, then runs the schema's range
and cross-field validation.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Sequence
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from diffrl.config.schema import Config, ConfigError
from diffrl.files import open_regular

PRESETS_DIR = Path(__file__).parent / "presets"
DEFAULT_PRESET = "default"
REPLACE_TAG = "!replace"


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
        if not path.exists():  # anything else (a directory, a FIFO) is named by _read_yaml
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
    for layer in [*_file_layers(path, ()), _parse_overrides(overrides)]:
        try:
            merged = _apply_layer(merged, layer)
        except OmegaConfBaseException as err:
            raise ConfigError(f"{layer.where}: {_explain(err)}") from None
    if not merged.model.path and path.parent != PRESETS_DIR and "base" not in _read_yaml(path).values:
        raise ConfigError(
            f"{path} names no `base:`, so it starts from the schema's defaults, which name no model "
            "(model.path is empty): add the line `base: default` to make it a change of the default job "
            "(or name another preset: `diffrl presets`), or set model.path"
        )
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, Config)
    return cfg.validate(job)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


@dataclass
class _Layer:
    """One source of values: a file or the command line, and the paths it tags `!replace`."""

    where: str
    values: DictConfig
    replace: list[tuple[str, ...]]


def _entry_type(path: tuple[str, ...]) -> Any:
    """The schema's type of the value at `path` (Optional stripped); None off the schema or under Any."""
    tp: Any = Config
    for part in path:
        if is_dataclass(tp):
            tp = typing.get_type_hints(tp).get(part)
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        else:
            return None
        args = typing.get_args(tp)
        if typing.get_origin(tp) in (typing.Union, type(int | None)) and type(None) in args:
            tp = next(a for a in args if a is not type(None))
    return tp


def _removal_fix(key: str) -> str:
    """How to get what `~key` (Hydra's deletion) means: `key=null` where the schema takes null
    (an entry of a mapping, an Optional key), else that the key keeps a value."""
    path = tuple(key.split("."))
    parent = _entry_type(path[:-1]) if len(path) > 1 else Config
    if typing.get_origin(parent) is dict:
        return f"remove the entry with {key}=null"
    hint = typing.get_type_hints(parent).get(path[-1]) if is_dataclass(parent) else None
    if hint is None:  # not a key of the schema: the override's own check names it
        return f"set it with {key}=VALUE"
    if type(None) in typing.get_args(hint):
        return f"unset it with {key}=null"
    return f"{key} always has a value (set the one you want; `diffrl config` shows the current one)"


def _is_entries(path: tuple[str, ...]) -> bool:
    """Whether `path` is a mapping of named entries (a `dict[str, ...]` of the schema)."""
    return typing.get_origin(_entry_type(path)) is dict


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(path) or "the top level"


def _split_removals(values: dict, path: tuple[str, ...], removals: list[tuple[str, ...]], where: str) -> dict:
    """`values` without its entry removals (`null` under a mapping of entries), which go to `removals`."""
    kept = {}
    for key, value in values.items():
        here = (*path, str(key))
        if value is None and _is_entries(path):
            removals.append(here)
        elif value is None and _is_entries(here):
            raise ConfigError(
                f"{where}: {_dotted(here)}=null: a mapping of entries cannot be null. Remove one entry "
                f"with {_dotted(here)}.<name>=null, or empty it with `{here[-1]}: {REPLACE_TAG} {{}}` in YAML "
                f"('{_dotted(here)}={REPLACE_TAG} {{}}' on the command line)"
            )
        elif isinstance(value, dict):
            kept[key] = _split_removals(value, here, removals, where)
        else:
            kept[key] = value
    return kept


def _apply_layer(merged: DictConfig, layer: _Layer) -> DictConfig:
    """`merged` with the layer's replacements and removals done, then the layer merged on top."""
    for path in layer.replace:
        if not _is_entries(path):
            entries = ", ".join(_dotted(p) for p in _entry_paths(Config, ()))
            raise ConfigError(
                f"{layer.where}: {REPLACE_TAG} on {_dotted(path)}: only mappings of named entries can be "
                f"replaced ({entries}); sections merge key by key and lists are always replaced whole"
            )
        OmegaConf.update(merged, _dotted(path), {}, merge=False)
    removals: list[tuple[str, ...]] = []
    plain = OmegaConf.to_container(layer.values, resolve=False)
    assert isinstance(plain, dict)
    kept = _split_removals(plain, (), removals, layer.where)
    for path in removals:
        parent = OmegaConf.select(merged, ".".join(path[:-1]), default=None)
        name = path[-1]
        if not isinstance(parent, DictConfig) or name not in parent:
            present = ", ".join(map(repr, parent.keys())) if isinstance(parent, DictConfig) else ""
            raise ConfigError(
                f"{layer.where}: {_dotted(path)}=null removes an entry, but {_dotted(path[:-1])} has no "
                f"entry {name!r} to remove (its entries: {present or 'none'})"
            )
        del parent[name]
    return OmegaConf.merge(merged, OmegaConf.create(kept))


def _entry_paths(tp: Any, path: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The schema's mappings of entries, for messages (`<name>` stands for any entry)."""
    if typing.get_origin(tp) is dict:
        return [path, *_entry_paths(typing.get_args(tp)[1], (*path, "<name>"))]
    if not is_dataclass(tp):
        return []
    hints = typing.get_type_hints(tp)
    return [p for f in fields(tp) for p in _entry_paths(hints[f.name], (*path, f.name))]


def _replace_paths(node: yaml.Node, path: tuple[str, ...], found: list[tuple[str, ...]]) -> None:
    """Collect the paths of mappings tagged `!replace` and give them back the plain mapping tag."""
    if node.tag == REPLACE_TAG:
        if not isinstance(node, yaml.MappingNode):
            raise ConfigError(f"{REPLACE_TAG} at {_dotted(path)} must tag a mapping ({{name: ...}})")
        found.append(path)
        node.tag = yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            _replace_paths(value, (*path, str(key.value)), found)


def _read_yaml(path: Path) -> _Layer:
    with open_regular(path, "config file") as file:
        data = file.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason}): save the config file as UTF-8") from None
    replace: list[tuple[str, ...]] = []
    try:
        if REPLACE_TAG in text:
            # OmegaConf's YAML loader knows no custom tags: find the tagged mappings on the node
            # tree, untag them, and hand OmegaConf the same document without the tags.
            root = yaml.compose(text, Loader=yaml.SafeLoader)
            if root is not None:
                _replace_paths(root, (), replace)
                text = yaml.serialize(root, Dumper=yaml.SafeDumper)
        layer = OmegaConf.create(text)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    except Exception as err:  # yaml's parser errors carry the line and column
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"{path}: a config file must be a mapping of sections (model:, rollout:, ...)")
    return _Layer(str(path), layer, replace)


def _file_layers(path: Path, chain: tuple[Path, ...]) -> list[_Layer]:
    """The file's layer after those of its `base` chain (outermost base first)."""
    if path.resolve() in chain:
        names = " -> ".join(str(p) for p in (*chain, path.resolve()))
        raise ConfigError(f"{path}: `base` chain loops back on itself: {names}")
    layer = _read_yaml(path)
    base = layer.values.pop("base", None)
    if base is None:
        return [layer]
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base={base!r} must name a preset or a .yaml path")
    base_path = Path(base)
    if base.endswith((".yaml", ".yml")) and not base_path.is_absolute():
        base_path = path.parent / base_path  # relative to the file that names it
        if not base_path.exists():
            raise FileNotFoundError(f"{path}: base {base!r} does not exist (looked at {base_path})")
    else:
        base_path = resolve_source(base)
    return [*_file_layers(base_path, (*chain, path.resolve())), layer]


def _parse_overrides(overrides: Sequence[str]) -> _Layer:
    items, replace = [], []
    for item in overrides:
        if item.startswith(("+", "~")):
            bare = item.lstrip("+~")
            fix = (
                f"write it as {bare!r}: every key of the schema can be set, and a new entry of "
                "reward.functions is made by naming it"
                if item[0] == "+"
                else _removal_fix(bare.partition("=")[0])
            )
            raise ConfigError(
                f"override {item!r}: {item[0]!r} is Hydra's prefix to add or delete a key; diffrl's overrides "
                f"take none: {fix}"
            )
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"override {item!r} is not key=value (e.g. rollout.sde.noise_level=0.8; "
                "lists as actor.optim.betas=[0.9,0.99])"
            )
        if value.lstrip().startswith(REPLACE_TAG):
            replace.append(tuple(key.strip().split(".")))
            value = value.lstrip().removeprefix(REPLACE_TAG)
            if not value.strip().startswith("{"):
                raise ConfigError(f"override {item!r}: {REPLACE_TAG} must tag a mapping ({{name: ...}})")
        items.append(f"{key}={value}")
    try:
        return _Layer("command line", OmegaConf.from_dotlist(items), replace)
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
