"""Typed configs: the schema (dataclasses with defaults), presets, and key=value overrides.

The names below are imported on first use (PEP 562), so that `diffrl.config.catalog` (what
`diffrl presets` reads) loads without the schema, whose validation imports the algorithm and
reward registries and with them torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ below imports them
    from diffrl.config.loader import DEFAULT_PRESET, load_config, preset_names, preset_summary, to_yaml
    from diffrl.config.schema import (
        ActorConfig,
        AlgorithmConfig,
        Config,
        ConfigError,
        DataConfig,
        LoraConfig,
        LossConfig,
        ModelConfig,
        OldPolicyConfig,
        OptimConfig,
        PipelineConfig,
        RewardConfig,
        RewardFnConfig,
        RolloutConfig,
        RolloutCorrectionConfig,
        SdeConfig,
        TrainerConfig,
        ValidationConfig,
    )

_LOADER = ("DEFAULT_PRESET", "load_config", "preset_names", "preset_summary", "to_yaml")

__all__ = [
    "DEFAULT_PRESET",
    "ActorConfig",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoraConfig",
    "LossConfig",
    "ModelConfig",
    "OldPolicyConfig",
    "OptimConfig",
    "PipelineConfig",
    "RewardConfig",
    "RewardFnConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "SdeConfig",
    "TrainerConfig",
    "ValidationConfig",
    "load_config",
    "preset_names",
    "preset_summary",
    "to_yaml",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'diffrl.config' has no attribute {name!r}")
    module = importlib.import_module("diffrl.config.loader" if name in _LOADER else "diffrl.config.schema")
    value = getattr(module, name)
    globals()[name] = value  # later lookups skip this function
    return value
