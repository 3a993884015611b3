"""The config's error type and range checks, shared by the schema and the algorithms' settings.

Stdlib only: `diffrl.algos` declarations validate their own settings with these, and the schema
imports those declarations, so nothing here may import either.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value is wrong; the message names the key, the value and what is allowed."""


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {allowed}")


def require_choice(key: str, value: Any, choices: tuple[str, ...] | list[str]) -> None:
    require(value in choices, key, value, f"must be one of {', '.join(map(repr, choices))}")


def require_positive(key: str, value: float) -> None:
    require(value > 0, key, value, "must be > 0")


def require_at_least(key: str, value: float, low: float) -> None:
    require(value >= low, key, value, f"must be >= {low}")


def require_step_range(key: str, value: Any) -> None:
    """A [lo, hi) range of a schedule's step indices (None, meaning all steps, is not checked)."""
    if value is not None:
        require(
            len(value) == 2 and 0 <= value[0] < value[1],
            key,
            value,
            "must be [lo, hi) with 0 <= lo < hi (step indices of the rollout schedule), or null for all steps",
        )


def require_ray_resources(key: str, resources: dict[str, float]) -> None:
    """Custom Ray resources (e.g. a node label `{rollout_node: 1}`); CPU and GPU have their own keys."""
    for name, amount in resources.items():
        require(
            name not in ("CPU", "GPU", "memory"),
            key,
            resources,
            f"names {name!r}, which Ray accounts itself: use trainer.gpus_per_worker / rollout.gpus_per_replica",
        )
        require(isinstance(amount, int | float) and amount > 0, key, resources, f"{name} must be > 0")
