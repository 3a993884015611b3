"""Whether a checkpoint's weights fit a model: the LoRA settings of each adapter, stored in the
checkpoint's meta.json (`lora_summary`), and the tensor shapes in its safetensors headers, compared
with the model's before anything is loaded (`check_model_matches`), so a mismatch says what differs
and leaves the model untouched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader

from diffrl.train.checkpoint_files import MODEL_DIR
from diffrl.train.export import lora_adapter_names

# The LoraConfig fields that decide which tensors an adapter has and how they scale.
LORA_FIELDS = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora")


def lora_summary(model: nn.Module) -> dict[str, dict[str, Any]]:
    """{adapter: its LORA_FIELDS} of `model`, as JSON values: what meta.json stores."""
    summary = {}
    for name in lora_adapter_names(model):
        config = model.peft_config[name]
        fields = {field: getattr(config, field, None) for field in LORA_FIELDS}
        if isinstance(fields["target_modules"], set | frozenset | list | tuple):
            fields["target_modules"] = sorted(fields["target_modules"])
        summary[name] = fields
    return summary


def _saved_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Key -> global shape of the tensors in a per-rank safetensors directory, from the headers (JSON)."""
    if not directory.is_dir():
        return {}
    metadata = HuggingFaceStorageReader(str(directory)).read_metadata()
    return {key: tuple(item.size) for key, item in metadata.state_dict_metadata.items()}


def _diff_lines(saved: dict[str, tuple], model: dict[str, tuple], limit: int = 5) -> list[str]:
    lines = []
    missing = sorted(set(saved) - set(model))
    unexpected = sorted(set(model) - set(saved))
    shape = sorted(k for k in set(saved) & set(model) if saved[k] != model[k])
    if missing:
        lines.append(f"{len(missing)} saved tensor(s) the model lacks, e.g. {missing[:limit]}")
    if unexpected:
        lines.append(f"{len(unexpected)} model tensor(s) the checkpoint lacks, e.g. {unexpected[:limit]}")
    if shape:
        examples = [f"{k}: saved {list(saved[k])}, model {list(model[k])}" for k in shape[:limit]]
        lines.append(f"{len(shape)} shape mismatch(es), e.g. {examples}")
    return lines


def check_model_matches(
    path: Path, meta: dict[str, Any], model: nn.Module, model_state: dict[str, Any], trainable_only: bool
) -> None:
    """Raise, saying what differs and the fix, when the checkpoint's weights do not fit `model`."""
    saved_shapes = _saved_shapes(path / MODEL_DIR)
    model_shapes = {key: tuple(value.shape) for key, value in model_state.items() if hasattr(value, "shape")}
    if not trainable_only:
        lines = _diff_lines(saved_shapes, model_shapes)
        if lines:
            raise ValueError(
                f"checkpoint {str(path)!r} holds full weights of a different model: "
                + "; ".join(lines)
                + ". Load it into the architecture it was saved from (the same model.path)"
            )
        return

    saved, current = meta["adapters"], lora_summary(model)
    if set(saved) != set(current):
        fixes = []
        if set(saved) - set(current):
            fixes.append(
                f"add adapter(s) {sorted(set(saved) - set(current))} to the model before loading "
                "(transformer.add_adapter(LoraConfig(...), adapter_name=...); the engine adds 'old' when the "
                "algorithm keeps an old policy)"
            )
        if set(current) - set(saved):
            fixes.append(
                f"the checkpoint has no weights for adapter(s) {sorted(set(current) - set(saved))}: "
                "configure the run as it was saved (same algorithm.old_policy) or delete those adapters"
            )
        raise ValueError(
            f"checkpoint {str(path)!r} holds LoRA adapters {sorted(saved)}, the model has {sorted(current)}: "
            + "; ".join(fixes)
        )
    hints, scale_differs = [], False
    for name in sorted(saved):
        for field in LORA_FIELDS:
            if saved[name][field] != current[name][field]:
                # alpha, rsLoRA and DoRA change the update without changing tensor shapes.
                scale_differs |= field in ("lora_alpha", "use_rslora", "use_dora")
                key = {"r": "model.lora.rank", "lora_alpha": "model.lora.alpha"}.get(
                    field, f"model.lora.{field}"
                )
                hints.append(
                    f"adapter {name!r} was saved with {field}={saved[name][field]!r}, the model has "
                    f"{current[name][field]!r} (set {key} to the saved value)"
                )
    lines = _diff_lines(saved_shapes, model_shapes)
    if lines or scale_differs:
        raise ValueError(
            f"checkpoint {str(path)!r} does not match the model's LoRA adapters: "
            + "; ".join(hints + lines)
            + ". Build the adapters exactly as in the run that saved it"
        )
