"""Reward names -> reward factories, and how a config entry becomes a reward object.

Registration is explicit, at import time of the defining module (`import diffrl.rewards`
registers the built-ins):

    @register_reward("brightness")           # a function IS the reward; config args bind as kwargs
    def brightness(pixels, prompts, metadata, *, scale=1.0): ...

    @register_reward("my_edit_check")        # a `sources` keyword: it also gets each sample's
    def my_edit_check(pixels, prompts, metadata, *, sources): ...   # source images (edit runs)

    @register_reward("my_model")             # a class is constructed ONCE with the config args
    class MyModelReward:                     # (load the model in __init__), then called per batch
        def __init__(self, path: str): ...
        def __call__(self, pixels, prompts, metadata) -> RewardOutput: ...

A key of `reward.functions` (a "reward spec") is one of:

- `NAME`: a registered reward (`jpeg_compressibility`, `ocr`, `clip_score`, `http`, ...);
- `NAME@LABEL`: another instance of a registered reward, so one config can use, say, two `http`
  scorers (`http@ocr`, `http@pickscore`) with different args;
- `module:function`: a user's function or class by import path (the `python` reward), so user
  code needs no registration.

Unknown names raise `ValueError` listing the registered ones with a did-you-mean; unknown args
raise listing the accepted ones. `check_reward_spec` runs those checks without loading any model,
for config validation.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

from diffrl.registry import Registry
from diffrl.rewards.base import SOURCES_PARAM, Reward, needs_sources

REWARDS: Registry[Callable[..., Any]] = Registry("reward")

# Positional parameters of every reward call; a function reward's other parameters are its args.
_CALL_PARAMS = 3


def register_reward(name: str) -> Callable[[Any], Any]:
    """Register a reward class (constructed once with the config args) or function under `name`."""
    if "@" in name or ":" in name:
        raise ValueError(
            f"reward name {name!r} must not contain '@' or ':' (they mark labels and import paths)"
        )
    return REWARDS.register(name)


def reward_names() -> list[str]:
    """Registered reward names, sorted."""
    return REWARDS.names()


def base_name(spec: str) -> str:
    """The registered reward a spec refers to: `ocr@en` -> `ocr`, `pkg.mod:fn` -> `python`."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"a reward name must be a non-empty string, got {spec!r}")
    if ":" in spec:
        return "python"
    name, at, label = spec.partition("@")
    if at and not (name and re.fullmatch(r"[A-Za-z0-9_.\-]+", label)):
        raise ValueError(
            f"reward {spec!r}: use NAME@LABEL with a registered NAME and a LABEL of letters, digits, _ . -, "
            "e.g. 'http@ocr'"
        )
    return name


def metric_name(spec: str) -> str:
    """The spec as a metric path segment: characters outside `[A-Za-z0-9_.-]` become `_`.

    TensorBoard tags allow only those; `http@ocr` logs as `rewards/http_ocr/mean`.
    """
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", spec)


def _accepted(factory: Callable[..., Any]) -> tuple[list[str], bool]:
    """(names of the config args the factory takes, whether it takes **kwargs)."""
    params = list(inspect.signature(factory).parameters.values())
    if not inspect.isclass(factory):
        params = params[_CALL_PARAMS:]
    # `sources` is how a reward receives the source images of an edit run (base.takes_sources), never a config arg
    names = [
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != SOURCES_PARAM
    ]
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def _check_args(spec: str, factory: Callable[..., Any], args: Mapping[str, Any]) -> None:
    names, any_kwargs = _accepted(factory)
    params = inspect.signature(factory).parameters
    missing = [n for n in names if params[n].default is inspect.Parameter.empty and n not in args]
    if missing:
        raise ValueError(
            f"reward {spec!r} needs argument(s) {', '.join(missing)}: set "
            + ", ".join(f"reward.functions.{spec}.args.{n}=..." for n in missing)
        )
    if any_kwargs:
        return
    for key in args:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"reward {spec!r} got an unknown argument {key!r} (reward.functions.{spec}.args.{key}).{hint} "
                f"It accepts: {', '.join(names) or '(no arguments)'}."
            )


def check_reward_spec(spec: str, args: Mapping[str, Any] | None = None) -> None:
    """Raise ValueError if `spec` names no reward or `args` do not fit it; loads no model.

    A factory may define a static `check_args(**args)` for checks beyond the signature (the
    `python` reward imports the module there, to check the path exists).
    """
    args = dict(args or {})
    if ":" in spec:
        if "function" in args:
            raise ValueError(
                f"reward {spec!r} is an import path already; drop args.function={args['function']!r} "
                "(or name the entry 'python' and keep args.function)"
            )
        args = {"function": spec, **args}
    try:
        factory = REWARDS.get(base_name(spec))
    except ValueError as err:
        if "." in spec:
            raise ValueError(f"{err} For a function by import path write 'module:function'.") from None
        raise
    _check_args(spec, factory, args)
    check = getattr(factory, "check_args", None)
    if check is not None:
        check(**args)


def build_reward(spec: str, args: Mapping[str, Any] | None = None) -> Reward:
    """The reward object for a config entry: classes are constructed with `args` (models load
    here, once), functions get `args` bound as keyword arguments."""
    args = dict(args or {})
    check_reward_spec(spec, args)
    if ":" in spec:
        args = {"function": spec, **args}
    factory = REWARDS.get(base_name(spec))
    if inspect.isclass(factory):
        return factory(**args)
    return functools.partial(factory, **args) if args else factory


def spec_needs_sources(spec: str) -> bool:
    """Whether the registered reward `spec` names cannot score without the source images of an
    edit run (its call's `sources` parameter has no default), read from its signature without
    building it. False for `module:function` rewards (known once imported; they fail at their
    first batch instead) and for `http` (the remote reward decides)."""
    if ":" in spec:
        return False
    factory = REWARDS.get(base_name(spec))
    target = factory.__call__ if inspect.isclass(factory) else factory
    return needs_sources(target)
