"""Upper bounds a model directory sets on size-like settings, read from its files before it loads.

- denoising steps: at most the scheduler's `num_train_timesteps` (scheduler/scheduler_config.json):
  the model was trained on that many noise levels, and the step schedule's arrays grow with the
  value (1e9 steps took the whole machine's memory);
- text tokens (`max_sequence_length`): at most what the family's text encoder takes
  (`ModelAdapter.max_text_tokens`); prompts are padded to it, so 1e9 would allocate 1e9 embeddings.

`diffrl train` (controller/sizes.py) and `diffrl sample` (rollout/generate.py) check their keys or
flags against these, naming them, before the model loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from diffrl.files import read_json_file
from diffrl.models import adapter_class, read_model_index, resolve_model_path
from diffrl.models.base import MODEL_DIR_FIX


def trained_timesteps(path: str | Path) -> tuple[int | None, Path]:
    """The scheduler's `num_train_timesteps` (None when the directory does not say) and its file."""
    file = resolve_model_path(path) / "scheduler" / "scheduler_config.json"
    if not file.is_file():
        return None, file
    config = read_json_file(file, f"model {str(path)!r}:", MODEL_DIR_FIX)
    value = config.get("num_train_timesteps") if isinstance(config, dict) else None
    return (value if isinstance(value, int) and value > 0 else None), file


def check_model_bounds(
    path: str | Path, steps: Mapping[str, int | None], text_tokens: Mapping[str, int | None]
) -> None:
    """Each named value of `steps` (denoising steps) and `text_tokens` (max_sequence_length)
    against the model's bound; a ValueError names the key or flag, the bound, where it comes
    from, and the fix."""
    trained, file = trained_timesteps(path)
    for key, value in steps.items():
        if trained is not None and value is not None and value > trained:
            raise ValueError(
                f"{key}={value} is more than the {trained} noise levels the model was trained on "
                f"(num_train_timesteps in {file}): set {key} <= {trained}"
            )
    family = adapter_class(read_model_index(path)["_class_name"])
    limit = family.max_text_tokens
    for key, value in text_tokens.items():
        if value is not None and value > limit:
            raise ValueError(
                f"{key}={value} is more text tokens than {family.pipeline_class_name}'s text encoder takes "
                f"({limit}): set {key} <= {limit}"
            )
