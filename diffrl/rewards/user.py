"""A user's own reward by import path: `module:function` (or `module:Class`), sync or async.

Config, either form:

    reward:
      functions:
        my_rewards:brightness: {weight: 1.0, args: {target: 0.5}}     # the key is the import path
        python: {args: {function: my_rewards:brightness, target: 0.5}}  # same, overridable on the CLI

The target is imported in each process that scores (a Ray reward worker too), so its module must be
importable there: installed, or on `PYTHONPATH` / in the working directory.

- A function is called as `fn(pixels, prompts, metadata, **args)`.
- A class is constructed once as `Class(**args)` (load models there) and its instances are called
  as `obj(pixels, prompts, metadata)`.
- Either gets `sources=` too (each sample's source images in an edit run, diffrl.rewards.base)
  when its call has a `sources` parameter.

Either may be `async def` (it is run to completion on an event loop) and may return a
`RewardOutput`, a tensor, a NumPy array or a list of B floats.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from diffrl.lazy import lazy_import
from diffrl.rewards.base import (
    SOURCES_PARAM,
    RewardOutput,
    as_reward_output,
    check_batch,
    needs_sources,
    resolve_awaitable,
    takes_sources,
)
from diffrl.rewards.registry import _check_args, register_reward

torch = lazy_import("torch")  # deferred: see diffrl.lazy

_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def import_object(path: str) -> Any:
    """Import `package.module:attribute` (the attribute may be dotted, `module:Class.method`).

    Raises ValueError naming the path and what is wrong with it, never a bare ImportError.
    """
    if not isinstance(path, str) or not _PATH.match(path):
        raise ValueError(
            f"{path!r} is not an import path: expected 'module:function' (e.g. 'my_rewards:brightness' "
            "for def brightness(...) in my_rewards.py)"
        )
    module_name, _, attr_path = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and module_name.startswith(err.name):
            raise ValueError(
                f"cannot import module {module_name!r} for reward {path!r}: no such module. Install it, or "
                f"put it on PYTHONPATH (the working directory is {os.getcwd()})"
            ) from err
        raise ValueError(f"importing {module_name!r} for reward {path!r} failed: {err}") from err
    except Exception as err:
        raise ValueError(
            f"importing {module_name!r} for reward {path!r} failed: {type(err).__name__}: {err}"
        ) from err
    target: Any = module
    for part in attr_path.split("."):
        if not hasattr(target, part):
            public = [n for n in dir(target) if not n.startswith("_") and callable(getattr(target, n))]
            close = difflib.get_close_matches(part, public, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"{getattr(target, '__name__', target)!r} has no attribute {part!r} (reward {path!r}).{hint} "
                f"Callables there: {', '.join(public[:20]) or '(none)'}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"reward {path!r} is a {type(target).__name__}, not a function or class")
    return target


@register_reward("python")
class PythonReward:
    """A user function or class by import path; `args` other than `function` go to it."""

    def __init__(self, function: str, **kwargs: Any) -> None:
        target = self.check_args(function, **kwargs)
        self.name = function
        self._fn: Callable[..., Any]
        if inspect.isclass(target):
            self._fn = target(**kwargs)
        else:
            self._fn = functools.partial(target, **kwargs) if kwargs else target
        # what `call_reward` reads: the target's, not this wrapper's (which forwards `sources`)
        self.takes_sources = takes_sources(self._fn)
        self.needs_sources = needs_sources(self._fn)

    @staticmethod
    def check_args(function: str, **kwargs: Any) -> Any:
        """Import the target and check that `kwargs` fit its signature; returns the target."""
        target = import_object(function)
        try:
            inspect.signature(target)
        except (TypeError, ValueError):  # a builtin without a signature: nothing to check
            return target
        _check_args(function, target, kwargs)
        if not inspect.isclass(target):
            sources = {SOURCES_PARAM: None} if needs_sources(target) else {}
            try:
                inspect.signature(target).bind(None, None, None, **sources, **kwargs)
            except TypeError as err:
                raise ValueError(
                    f"reward function {function!r} must accept (pixels, prompts, metadata) positionally, "
                    f"then its args as keywords: {err}"
                ) from err
        return target

    def __call__(
        self,
        pixels: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
        sources: Sequence[Sequence[torch.Tensor]] | None = None,
    ) -> RewardOutput:
        rows = check_batch(pixels, prompts, metadata)
        given = {SOURCES_PARAM: sources} if self.takes_sources else {}
        result = resolve_awaitable(self._fn(pixels, list(prompts), rows, **given))
        return as_reward_output(result, int(pixels.shape[0]), self.name)
