"""Telemetry: metrics to the console, metrics.jsonl, TensorBoard and wandb; phase timing, MFU,
memory; image grids; console quieting and progress lines. Metric names and units: docs/metrics.md.

The names below load their module on first use (PEP 562), so `diffrl.telemetry.console`, which
the `diffrl` command imports before anything else, does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "image_grid": "images",
    "save_png": "images",
    "LOGGERS": "logger",
    "RunLogger": "logger",
    "check_loggers": "logger",
    "PEAK_BF16_FLOPS": "perf",
    "max_rss_gb": "perf",
    "memory_metrics": "perf",
    "mfu_metrics": "perf",
    "peak_flops": "perf",
    "peak_flops_for_name": "perf",
    "peak_over_workers": "perf",
    "read_jsonl": "sinks",
    "read_metrics": "sinks",
    "PHASES": "timing",
    "PhaseTimer": "timing",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = sorted(_EXPORTS)
