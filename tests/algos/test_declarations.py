"""Algorithms declare themselves: the rest of diffrl asks the declaration, never the name."""

import ast
from pathlib import Path

import pytest

import diffrl
from diffrl.algos import ALGORITHMS, DirectPreferenceSpec, algorithms

PACKAGE = Path(diffrl.__file__).parent


def _name_tests(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every registered algorithm name compared with (==, !=, in, not in) or
    matched on (`case "name"`)."""
    names = set(ALGORITHMS.names())
    found = []
    for node in ast.walk(tree):
        operands: list[ast.AST] = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.MatchValue):
            operands = [node.value]
        for operand in operands:
            for leaf in ast.walk(operand):
                if isinstance(leaf, ast.Constant) and leaf.value in names:
                    found.append((node.lineno, leaf.value))
    return found


def test_no_algorithm_name_is_tested_outside_diffrl_algos():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if (PACKAGE / "algos") in path.parents:
            continue
        for line, name in _name_tests(ast.parse(path.read_text(), str(path))):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line} tests {name!r}")
    assert not offenders, "ask the algorithm's declaration (diffrl.algos.spec) instead:\n" + "\n".join(
        offenders
    )


def test_the_scan_finds_a_name_test():
    assert _name_tests(ast.parse('if mode == "dpo" or m in ("awm",): pass')) == [(1, "dpo"), (1, "awm")]


def test_settings_keys_are_unique_and_validate_themselves():
    from dataclasses import fields

    seen: set[str] = set()
    for spec in algorithms():
        if spec.settings is None:
            continue
        keys = {f.name for f in fields(spec.settings)}
        assert not keys & seen
        seen |= keys
        spec.settings().validate("actor.loss")  # the defaults are valid


@pytest.mark.parametrize(
    "spec", [s for s in algorithms() if isinstance(s, DirectPreferenceSpec)], ids=lambda s: s.name
)
def test_direct_preference_algorithms_name_their_term(spec):
    assert callable(spec.term)
