"""docs/configuration.md must document every key of the schema (and nothing the schema lacks)."""

import dataclasses
import re
import typing
from pathlib import Path

from diffrl.config import Config, RewardFnConfig

DOC = Path(__file__).parents[2] / "docs" / "configuration.md"


def _leaf_keys(cls, prefix):
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            yield from _leaf_keys(tp, f"{path}.")
        else:
            yield path


def _documented_keys(text):
    """Keys in the first column of the tables; `a.b.c`, `.d` rows expand to a.b.c and a.b.d."""
    keys = set()
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        first_cell = line.split("|")[1]
        names = re.findall(r"`([^`]+)`", first_cell)
        base = names[0].rpartition(".")[0]
        for name in names:
            keys.add(f"{base}{name}" if name.startswith(".") else name)
    return keys


def test_every_schema_key_is_documented_and_every_documented_key_exists():
    schema = set(_leaf_keys(Config, ""))
    schema |= {f"reward.functions.<name>.{key}" for key in _leaf_keys(RewardFnConfig, "")}
    documented = _documented_keys(DOC.read_text())
    assert schema - documented == set(), "keys missing from docs/configuration.md"
    assert documented - schema == set(), "docs/configuration.md documents keys the schema lacks"
