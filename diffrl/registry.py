"""A name -> object table, for everything a config names by a stable string.

Algorithms (`diffrl.algos`), rewards (`diffrl.rewards`) and their users register objects under
names at import time; a lookup of an unknown name raises `ValueError` listing what is registered
(with a did-you-mean), and registering a taken name raises instead of silently replacing the first.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table `name -> object` of one kind (`kind` is used in error messages only)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator that stores the decorated object under `name` and returns it unchanged."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(obj: T) -> T:
            if name in self._items:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered ({self._items[name]!r}); "
                    f"refusing to replace it with {obj!r}. Pick another name."
                )
            self._items[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        """The object registered as `name`; `ValueError` naming the registered ones otherwise."""
        try:
            return self._items[name]
        except (KeyError, TypeError):
            pass
        known = self.names()
        close = difflib.get_close_matches(str(name), known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown {self.kind} {name!r}.{hint} Registered: {', '.join(known) or '(none)'}.")

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)

    def values(self) -> list[T]:
        """Registered objects, in registration order."""
        return list(self._items.values())

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
