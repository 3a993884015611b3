"""A module imported on first attribute access.

Why: an algorithm is one file holding its declaration (read by the config schema, so by
`diffrl config`) and its math (torch). Splitting each algorithm in two files would double what a
new algorithm touches; importing torch eagerly costs `diffrl config` seconds. So the algorithm and
reward files bind `torch = lazy_import("torch")`: declaring and validating never touch it, and the
first tensor operation loads it. The rules that keep it lazy: no torch attribute at module level
(decorators, defaults, `from torch import ...`); the math uses it inside functions only. A
submodule of a heavy package (`diffusers.training_utils`) cannot be deferred this way (finding it
imports its package), so the function that needs one imports it in its body.

Not `importlib.util.LazyLoader`: on Python 3.11 its placeholder becomes an empty module while the
real one executes, so a second thread touching it then (two reward-server requests, a reward
thread pool) gets AttributeError. Here the first access goes through `importlib.import_module`,
whose per-module lock makes every other thread wait for the finished module; nothing is put in
`sys.modules` under the real name, so other code importing the module normally is unaffected.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any


class _Deferred(ModuleType):
    """Stands for module `__name__` until an attribute is read; then holds the real module's names."""

    def __getattr__(self, attr: str) -> Any:  # called only for names not (yet) in __dict__
        module = importlib.import_module(self.__name__)
        # Later reads find the names in __dict__ directly and no longer come through here.
        self.__dict__.update(module.__dict__)
        return getattr(module, attr)


def lazy_import(name: str) -> ModuleType:
    """`name` itself when already imported, else a placeholder that imports it when first used."""
    if name in sys.modules:
        return sys.modules[name]
    if importlib.util.find_spec(name) is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    return _Deferred(name)


def is_deferred(module: ModuleType) -> bool:
    """Whether `module` is a `lazy_import` placeholder whose module has not been imported yet."""
    return isinstance(module, _Deferred) and module.__name__ not in sys.modules
