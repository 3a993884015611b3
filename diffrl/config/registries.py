"""The tables a config's names are looked up in, filled by the code that defines what they name.

The config is the foundation (DESIGN.md, "Layers"): it describes settings and imports none of what
they configure. The names a config may use are therefore registered here, by their owners, when
those are imported:

- `actor.loss.mode` names an algorithm: each algorithm file calls `register_algorithm` with its
  declaration (`diffrl.algos.spec`), whose own `actor.loss` settings the schema composes into
  `LossConfig`; `algorithm.trainer_type` names the loop the declaration says feeds it;
- `algorithm.adv_estimator` names an advantage estimator (`diffrl.algos.registry.register_advantage`);
- `reward.functions` names rewards: `diffrl.rewards` registers the check of their names and
  arguments (`register_reward_check`);
- `model.path=tiny:<name>` names a builder of a tiny random model (`register_tiny_model`: each
  model family's, and the shapes world's), `model.path=toy:<name>` a trained model shipped in a
  folder a task registers (`register_shipped_models`).

Importing `diffrl` imports the packages that register the built-in ones (diffrl/__init__.py), so
every table is full before any config is read. A user's own algorithm, reward or model registers
the same way, from a module imported before the run. Stdlib only: the algorithm and reward
declarations import this module, and `diffrl config` stays light.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from diffrl.registry import Registry

POLICY_GRADIENT = "policy_gradient"
DIRECT_PREFERENCE = "direct_preference"
DISTILLATION = "distillation"
#: The loops, i.e. the values of `algorithm.trainer_type`.
LOOPS = (POLICY_GRADIENT, DIRECT_PREFERENCE, DISTILLATION)

#: What a direct-preference loss trains on: clean samples with their advantages, or preference
#: pairs (the only kind an offline dataset provides).
SAMPLES = "samples"
PAIRS = "pairs"

# ---- actor.loss.mode: the algorithms' declarations (diffrl.algos.spec.AlgorithmSpec) -----------------

#: name -> declaration; what the config reads of one: `name`, `loop` (one of LOOPS), `settings` (a
#: dataclass of its own `actor.loss` keys, with `validate(at)`, or None) and, for a direct-preference
#: one, `trains_on` (SAMPLES or PAIRS).
ALGORITHMS: Registry[Any] = Registry("loss")
# Names a user may try as actor.loss.mode that are something else, with what to do instead.
_NOT_ALGORITHMS: dict[str, str] = {}


def register_algorithm(spec: Any) -> Any:
    """Add `spec` to the table; its settings' keys must not collide with another algorithm's."""
    taken = {name for other in ALGORITHMS.values() for name in settings_keys(other)}
    clash = sorted(taken & set(settings_keys(spec)))
    if clash:
        raise ValueError(f"algorithm {spec.name!r}: settings {clash} are already another algorithm's keys")
    return ALGORITHMS.register(spec.name)(spec)


def explain_not_an_algorithm(name: str, explanation: str) -> None:
    """Make `algorithm(name)` raise `explanation` (a ValueError) instead of "unknown loss"."""
    _NOT_ALGORITHMS[name] = explanation


def algorithm(name: str) -> Any:
    """The declaration registered as `name` (`actor.loss.mode`); ValueError listing them otherwise."""
    if name in _NOT_ALGORITHMS:
        raise ValueError(_NOT_ALGORITHMS[name])
    return ALGORITHMS.get(name)


def algorithms(loop: str | None = None) -> list[Any]:
    """The declarations in registration order, those of `loop` only when given."""
    return [spec for spec in ALGORITHMS.values() if loop is None or spec.loop == loop]


def settings_keys(spec: Any) -> list[str]:
    return [f.name for f in fields(spec.settings)] if spec.settings is not None else []


def algorithm_settings(spec: Any, loss_cfg: Any) -> Any:
    """`spec.settings` filled from the flat `actor.loss` section (None when it has no settings)."""
    if spec.settings is None:
        return None
    return spec.settings(**{key: getattr(loss_cfg, key) for key in settings_keys(spec)})


# ---- algorithm.adv_estimator -------------------------------------------------------------------------

#: name -> `fn(rewards_B, uids, cfg: AlgorithmConfig) -> adv_B`
ADVANTAGE_ESTIMATORS: Registry[Callable] = Registry("advantage estimator")


def register_advantage(name: str) -> Callable:
    """Register an advantage estimator `fn(rewards_B, uids, cfg: AlgorithmConfig) -> adv_B`."""
    return ADVANTAGE_ESTIMATORS.register(name)


def get_advantage_estimator(name: str) -> Callable:
    """The estimator function registered as `name` (`algorithm.adv_estimator`)."""
    return ADVANTAGE_ESTIMATORS.get(name)


# ---- reward.functions --------------------------------------------------------------------------------

_reward_checks: list[Callable[[Mapping[str, Any]], Any]] = []


def register_reward_check(check: Callable[[Mapping[str, Any]], Any]) -> None:
    """`check(reward.functions)` raises ValueError naming what is wrong with the rewards' names or
    arguments, without loading any model (`diffrl.rewards.reward_specs`)."""
    _reward_checks.append(check)


def check_reward_functions(functions: Mapping[str, Any]) -> None:
    """Every registered check of `reward.functions` (ValueError from the first that fails)."""
    if not _reward_checks:  # an internal invariant: importing diffrl registers diffrl.rewards' check
        raise RuntimeError(
            "no check of reward.functions is registered: import diffrl before loading a config"
        )
    for check in _reward_checks:
        check(functions)


# ---- model.path: tiny:<name> and toy:<name> ----------------------------------------------------------

#: name -> "module" (its `build_tiny(path, seed)`) or "module:function", imported when first built.
TINY_MODELS: dict[str, str] = {}
#: Folders of trained models shipped in the package: `toy:<name>` is the subfolder <name> of one.
SHIPPED_MODEL_DIRS: list[Path] = []


def register_tiny_model(name: str, builder: str) -> None:
    """`model.path=tiny:<name>` builds a tiny random model with `builder` ("module" for its
    `build_tiny(path, seed=0)`, or "module:function") into the cache, once."""
    if name in TINY_MODELS and TINY_MODELS[name] != builder:
        raise ValueError(f"tiny model {name!r} is already built by {TINY_MODELS[name]!r}; pick another name")
    TINY_MODELS[name] = builder


def register_shipped_models(folder: Path) -> None:
    """`model.path=toy:<name>` may name a subfolder of `folder` (a trained diffusers model)."""
    if folder not in SHIPPED_MODEL_DIRS:
        SHIPPED_MODEL_DIRS.append(folder)
