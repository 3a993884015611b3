"""The shipped presets form a flat tree (DESIGN.md, rule 1): a preset is at most two deep (itself and
its base, which has no base of its own), and the user-facing `default` is nobody's base, so changing
the default job never silently changes another preset (and the evidence its header cites).

The chains are read from the YAML files here, not through the loader, so that a loader change
cannot hide a deep chain."""

from pathlib import Path

import yaml

from diffrl.config.loader import DEFAULT_PRESET, PRESETS_DIR, preset_names


def base_chain(name: str, presets_dir: Path = PRESETS_DIR) -> list[str]:
    """`name` and then its bases, outermost last, as the files' `base:` keys name them."""
    chain = [name]
    while True:
        values = yaml.safe_load((presets_dir / f"{chain[-1]}.yaml").read_text()) or {}
        base = values.get("base")
        if base is None:
            return chain
        assert isinstance(base, str) and not base.endswith((".yaml", ".yml")) and "/" not in base, (
            f"preset {chain[-1]}: base {base!r} should name a shipped preset, not a file"
        )
        assert base not in chain, f"preset {name}: base chain loops: {' > '.join([*chain, base])}"
        chain.append(base)


def tree_problems(presets_dir: Path = PRESETS_DIR) -> list[str]:
    """Every preset more than two deep or built on the default preset, named with its chain."""
    problems = []
    for name in sorted(path.stem for path in presets_dir.glob("*.yaml")):
        chain = base_chain(name, presets_dir)
        if len(chain) > 2:
            problems.append(f"{name} is {len(chain)} deep: {' > '.join(chain)}")
        if DEFAULT_PRESET in chain[1:]:
            problems.append(f"{name} is built on {DEFAULT_PRESET!r}: {' > '.join(chain)}")
    return problems


def test_presets_are_at_most_two_deep_and_none_is_built_on_default():
    assert tree_problems() == []


def test_the_check_names_a_deep_chain_and_a_preset_built_on_default(tmp_path):
    # The check itself, on a made-up tree: c > b > a is three deep, and d is built on default.
    for name, base in [("a", None), ("b", "a"), ("c", "b"), (DEFAULT_PRESET, "a"), ("d", DEFAULT_PRESET)]:
        (tmp_path / f"{name}.yaml").write_text("" if base is None else f"base: {base}\n")
    assert tree_problems(tmp_path) == [
        "c is 3 deep: c > b > a",
        "d is 3 deep: d > default > a",
        "d is built on 'default': d > default > a",
    ]


def test_the_loader_reads_the_chains_this_file_reads():
    # The loader follows the same `base:` keys (else the tree above would prove nothing).
    from diffrl.config.loader import _file_layers, resolve_source

    for name in preset_names():
        assert len(_file_layers(resolve_source(name), ())) == len(base_chain(name)), name
