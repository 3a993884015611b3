"""Model families: one `ModelAdapter` per diffusers pipeline class, loaded from a local directory.

The registry maps a directory's model_index.json `_class_name` to the adapter that serves it. It
names modules rather than importing them, so loading one family never imports the others.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from pathlib import Path

import torch

from diffrl.config.early_checks import check_model_dir
from diffrl.config.registries import SHIPPED_MODEL_DIRS, TINY_MODELS
from diffrl.files import read_json_file
from diffrl.models.base import MODEL_DIR_FIX, ModelAdapter, PromptEmbeds

ADAPTERS: dict[str, str] = {
    "StableDiffusion3Pipeline": "diffrl.models.sd3:SD3Adapter",
    "FluxPipeline": "diffrl.models.flux:FluxAdapter",
    "QwenImagePipeline": "diffrl.models.qwen_image:QwenImageAdapter",
    "QwenImageEditPipeline": "diffrl.models.qwen_image_edit:QwenImageEditAdapter",
    "QwenImageEditPlusPipeline": "diffrl.models.qwen_image_edit:QwenImageEditPlusAdapter",
    "FluxKontextPipeline": "diffrl.models.flux_kontext:FluxKontextAdapter",
    "WanPipeline": "diffrl.models.wan:WanAdapter",
    "ZImagePipeline": "diffrl.models.zimage:ZImageAdapter",
    "Flux2KleinPipeline": "diffrl.models.flux2:Flux2KleinAdapter",
    "Flux2Pipeline": "diffrl.models.flux2_dev:Flux2DevAdapter",
    "QwenImage21Pipeline": "diffrl.models.qwen_image21:QwenImage21Adapter",
    "HunyuanVideo15Pipeline": "diffrl.models.hunyuan_video15:HunyuanVideo15Adapter",
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def adapter_class(pipeline_class_name: str) -> type[ModelAdapter]:
    if pipeline_class_name not in ADAPTERS:
        raise ValueError(
            f"model_index.json names pipeline class {pipeline_class_name!r}, which diffrl does not support; "
            f"supported: {', '.join(sorted(ADAPTERS))}"
        )
    module_name, _, class_name = ADAPTERS[pipeline_class_name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


TINY_PREFIX = "tiny:"
TOY_PREFIX = "toy:"


def resolve_model_path(path: str | Path) -> Path:
    """`model.path` -> a directory. `toy:<name>` names a trained model shipped in the package, in a
    folder a task registers (`toy:shapes`, the shapes world's model). `tiny:<name>` names a tiny random
    model built offline once into the cache (`$DIFFRL_CACHE`, default ~/.cache/diffrl): demos and tests
    need no download. Both tables are `diffrl.config.registries`'."""
    text = str(path)
    if text.startswith(TOY_PREFIX):
        name = text[len(TOY_PREFIX) :]
        shipped = {
            p.name: p
            for folder in SHIPPED_MODEL_DIRS
            if folder.is_dir()
            for p in folder.iterdir()
            if p.is_dir()
        }
        if name not in shipped:
            raise ValueError(
                f"model.path={text!r}: no shipped model {name!r}; shipped: {sorted(shipped) or 'none'}"
            )
        return shipped[name]
    if not text.startswith(TINY_PREFIX):
        return Path(path)
    from diffrl import __version__
    from diffrl.models.tiny import build_tiny, tiny_model_names

    family = text[len(TINY_PREFIX) :]
    if family not in TINY_MODELS:
        raise ValueError(
            f"model.path={text!r}: no tiny model {family!r}; choose tiny:{', tiny:'.join(tiny_model_names())}"
        )
    cache = Path(os.environ.get("DIFFRL_CACHE", Path.home() / ".cache" / "diffrl"))
    target = cache / "tiny" / f"{family}-seed0-v{__version__}"
    if not (target / "model_index.json").is_file():
        # Build beside the target and rename, so concurrent workers never see a half-written model.
        staging = Path(tempfile.mkdtemp(prefix=f".{family}-", dir=_mkdir(target.parent)))
        build_tiny(family, staging, seed=0)
        try:
            staging.rename(target)
        except OSError:  # another process won the race: its copy is identical
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def read_model_index(path: str | Path) -> dict:
    """The directory's model_index.json, with clear errors for a missing directory, file or component."""
    check_model_dir(path)  # a plain path: empty, missing, no model_index.json (the CLI's early check too)
    root = resolve_model_path(path)
    index_file = root / "model_index.json"
    index = read_json_file(index_file, f"model.path={str(path)!r}:", MODEL_DIR_FIX)
    if not isinstance(index, dict) or "_class_name" not in index:
        raise ValueError(f"{index_file} has no _class_name: it is not a diffusers pipeline index")
    # Components are [library, class] pairs; [null, null] marks an optional component left out.
    missing = [
        name
        for name, spec in index.items()
        if not name.startswith("_")
        and isinstance(spec, list)
        and spec[0] is not None
        and not (root / name).is_dir()
    ]
    if missing:
        raise FileNotFoundError(
            f"{str(path)!r} lacks the component folder(s) {', '.join(missing)} that model_index.json lists: "
            "the directory is incomplete (copy the whole saved pipeline)"
        )
    return index


def edits_images(path: str | Path) -> bool:
    """Whether the model at `path` is an image-edit model (its family has a `condition_rule`: each
    prompt comes with condition images), read from its model_index.json without loading it."""
    return adapter_class(read_model_index(path)["_class_name"]).condition_rule is not None


def load_model(path: str | Path, dtype: str = "bfloat16", device: str | torch.device = "cpu") -> ModelAdapter:
    """Load the diffusers pipeline at `path` and wrap it in its family's adapter."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    index = read_model_index(path)
    cls = adapter_class(index["_class_name"])
    return cls.from_pretrained(resolve_model_path(path), torch.device(device), DTYPES[dtype])


__all__ = [
    "ADAPTERS",
    "ModelAdapter",
    "PromptEmbeds",
    "adapter_class",
    "edits_images",
    "load_model",
    "read_model_index",
    "resolve_model_path",
]
