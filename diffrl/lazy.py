"""A module imported on first attribute access (the `importlib.util.LazyLoader` recipe).

Why: an algorithm is one file holding its declaration (read by the config schema, so by
`diffrl config`) and its math (torch). Splitting each algorithm in two files would double what a
new algorithm touches; importing torch eagerly costs `diffrl config` seconds. So the algorithm
files bind `torch = lazy_import("torch")`: declaring and validating never touch it, and the first
tensor operation loads it. The rules that keep it lazy: no torch attribute at module level
(decorators, defaults, `from torch import ...`); the math uses it inside functions only. A
submodule of a heavy package (`diffusers.training_utils`) cannot be deferred this way (finding it
imports its package), so the function that needs one imports it in its body.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def lazy_import(name: str) -> ModuleType:
    """`name` itself when already imported, else a placeholder that imports it when first used."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module


def is_deferred(module: ModuleType) -> bool:
    """Whether `module` is a `lazy_import` placeholder whose code has not run yet."""
    return isinstance(module, importlib.util._LazyModule)
