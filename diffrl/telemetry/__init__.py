"""Telemetry: metrics to the console, metrics.jsonl, TensorBoard and wandb; phase timing, MFU,
memory; image grids. Metric names and units: docs/metrics.md."""

from diffrl.telemetry.images import image_grid, save_png
from diffrl.telemetry.logger import LOGGERS, RunLogger, check_loggers
from diffrl.telemetry.perf import (
    PEAK_BF16_FLOPS,
    max_rss_gb,
    memory_metrics,
    mfu_metrics,
    peak_flops,
    peak_flops_for_name,
)
from diffrl.telemetry.sinks import read_jsonl, read_metrics
from diffrl.telemetry.timing import PHASES, PhaseTimer

__all__ = [
    "LOGGERS",
    "PEAK_BF16_FLOPS",
    "PHASES",
    "PhaseTimer",
    "RunLogger",
    "check_loggers",
    "image_grid",
    "max_rss_gb",
    "memory_metrics",
    "mfu_metrics",
    "peak_flops",
    "peak_flops_for_name",
    "read_jsonl",
    "read_metrics",
    "save_png",
]
