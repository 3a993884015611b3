"""Everything `diffrl train` checks before any model or Ray starts (run.py's first stage).

Order matters for users: a config typo, a missing model directory, an empty prompt file, an
unknown reward or an unwritable output place is reported before Ray or any model starts, and
nothing is written for a run that cannot start. `preflight_common` serves every job (train, sft,
eval); `preflight` adds the RL loops' checks. `run_plan` gathers the machine's facts (devices,
memory, the model's size) and resolves the run plan (diffrl.config.plan) before any worker exists;
the config itself is never changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from diffrl.config.plan import Machine, RunPlan, resolve_plan
from diffrl.config.schema import Config, ConfigError
from diffrl.controller.policy_gradient import VALIDATION_PROMPTS_FROM_TRAIN
from diffrl.controller.sizes import check_sizes
from diffrl.data import PromptRecord, load_prompts
from diffrl.files import check_output_dir, check_regular, read_json_file
from diffrl.models import adapter_class, read_model_index, resolve_model_path
from diffrl.models.base import MODEL_DIR_FIX, ModelAdapter
from diffrl.models.conditions import ConditionRow, check_condition_rows
from diffrl.models.sampling import ImageGeometry
from diffrl.rewards import reward_specs
from diffrl.rewards.registry import spec_needs_sources

BUILTIN_DATA = Path(__file__).resolve().parents[1] / "config" / "presets" / "data"
#: Seconds the preflight waits for a remote scorer's /health before refusing to start.
SCORER_PROBE_TIMEOUT_S = 5.0


def data_path(path: str) -> str:
    """`builtin:<file>` names a prompt file shipped with diffrl (diffrl/config/presets/data/)."""
    if path.startswith("builtin:"):
        return str(BUILTIN_DATA / path.removeprefix("builtin:"))
    return path


def needs_rewards(cfg: Config) -> bool:
    """Offline DPO learns from the dataset's preferences: rewards are optional (validation only)."""
    return not (cfg.algorithm.sample_source == "offline" and not cfg.reward.functions)


def preflight_common(cfg: Config) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """The checks every job needs before any model or Ray starts: loggers, model directory (its
    weight files and the image size it takes), rewards (a remote scorer answers), data files;
    returns the train and validation prompts (no validation without rewards)."""
    from diffrl.telemetry import check_loggers

    try:
        check_loggers(cfg.trainer.loggers)
    except ImportError as err:  # a missing optional package is the user's setup, not a bug
        raise ValueError(str(err)) from None
    index = read_model_index(cfg.model.path)
    check_model_files(cfg.model.path, index)
    check_declared_sizes(cfg.model.path, index)
    check_image_size(cfg)
    if needs_rewards(cfg):
        probe_scorers(reward_specs(cfg.reward.functions))
    if not cfg.data.train_files:
        raise ConfigError(
            "data.train_files is empty: give at least one prompt file (.txt, .jsonl or .parquet)"
        )
    family = adapter_class(index["_class_name"])
    warn_attention_backend(cfg, family)
    rule = family.condition_rule
    if rule is None and needs_rewards(cfg):
        check_no_source_rewards(cfg, index["_class_name"])
    image_key = cfg.data.image_key if rule is not None else None  # read for edit models only
    train = load_prompts([data_path(p) for p in cfg.data.train_files], cfg.data.prompt_key, image_key)
    if not cfg.reward.functions:
        val = []  # nothing to score validation samples with
    elif cfg.data.val_files:
        val = load_prompts([data_path(p) for p in cfg.data.val_files], cfg.data.prompt_key, image_key)
    else:
        val = train[:VALIDATION_PROMPTS_FROM_TRAIN]
    if rule is not None:
        check_condition_rows(rule, condition_rows(train), "data.train_files", cfg.data.image_key)
        check_condition_rows(rule, condition_rows(val), "data.val_files", cfg.data.image_key)
    return train, val


def warn_attention_backend(cfg: Config, family: type[ModelAdapter]) -> None:
    """A family whose training backward fails under torch's default attention on a GPU, trained
    with that default (`model.attn_backend=native` set explicitly; `auto` picks the family's own)
    where a GPU is present: said before anything loads (a warning: the failure was measured on
    H100/H200 and may not hold on every GPU or torch)."""
    backend = family.gpu_training_attn_backend
    if backend is None or cfg.model.attn_backend != "native" or not torch.cuda.is_available():
        return
    print(
        f"warning: {family.pipeline_class_name} trains with model.attn_backend=native, torch's default "
        "attention (cuDNN on H100/H200), whose backward failed this family's training there (an illegal "
        f"memory access at full size, a NaN gradient on a tiny model); set model.attn_backend={backend} "
        "(or auto, the default, which picks it)"
    )


def check_no_source_rewards(cfg: Config, family: str) -> None:
    """A reward that compares each result with its source image (`edit_preservation`) needs an
    image-edit model: with a text-to-image one it fails here, before any model loads."""
    for spec in reward_specs(cfg.reward.functions):
        if spec_needs_sources(spec.name):
            raise ConfigError(
                f"reward.functions.{spec.name} scores each result against its source image, and "
                f"model.path={cfg.model.path!r} ({family}) takes no condition images, so there is none: "
                "use an image-edit model (FLUX.1 Kontext, Qwen-Image-Edit) with prompt rows that carry "
                f"their images (data.image_key), or remove it (reward.functions.{spec.name}=null)"
            )


def condition_rows(records: Sequence[PromptRecord]) -> list[ConditionRow]:
    """The records' condition images as `diffrl.models.conditions` checks them."""
    return [(r.source, [(i.name, i.width, i.height) for i in r.images]) for r in records]


def machine_facts(cfg: Config) -> Machine:
    """What the run plan is resolved against (diffrl.config.plan.Machine): this (driver) process's
    accelerator and one device's memory, the pipeline's weight bytes in model.dtype (read from the
    safetensors headers; only where the choice of actor.strategy needs them: `auto`, several
    workers, LoRA) and the model family's GPU training attention backend."""
    from diffrl.train.parallel import device_memory_bytes, pipeline_weight_bytes

    weight_bytes = device_bytes = None
    if cfg.actor.strategy == "auto" and cfg.world_size > 1 and cfg.model.lora.rank > 0:
        dtype = getattr(torch, cfg.model.dtype)
        weight_bytes = pipeline_weight_bytes(resolve_model_path(cfg.model.path), dtype)
        device_bytes = device_memory_bytes(cfg.trainer.n_gpus_per_node)
    family = adapter_class(read_model_index(cfg.model.path)["_class_name"])
    return Machine(
        accelerator="cuda" if torch.cuda.is_available() else "cpu",
        device_bytes=device_bytes,
        weight_bytes=weight_bytes,
        gpu_attn_backend=family.gpu_training_attn_backend,
    )


def run_plan(cfg: Config, job: str = "train") -> RunPlan:
    """The run plan of `cfg` on this machine (`resolve_plan` with `machine_facts`): every `auto`
    resolved once; `cfg` is not changed. A ConfigError for a setting the plan makes useless."""
    return resolve_plan(cfg, machine_facts(cfg), job=job)


def check_model_files(path: str, index: dict) -> None:
    """Every component's JSON files parse, and its safetensors files have a readable header that
    covers the file; each is a regular file.

    Reading a header costs a few kilobytes, while loading a large model takes minutes before a
    garbage or truncated file would fail inside diffusers (a broken config.json there is an OSError
    that does not say what is wrong)."""
    from safetensors import SafetensorError, safe_open

    root = resolve_model_path(path)
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or spec[0] is None:
            continue
        for file in sorted((root / name).glob("*.json")):
            read_json_file(file, f"model.path={path!r}:", MODEL_DIR_FIX)
        for file in sorted((root / name).glob("*.safetensors")):
            check_regular(file, f"model.path={path!r}:")
            try:
                with safe_open(file, framework="pt") as handle:
                    handle.keys()
            except (SafetensorError, OSError) as err:
                raise ValueError(
                    f"model.path={path!r}: {file} is not a readable safetensors file ({err}); the "
                    "model directory is damaged: copy or save the model again"
                ) from None


def check_declared_sizes(path: str, index: dict) -> None:
    """No component's config declares more tensor memory than this process may use
    (`declared_tensor_bytes`, counted on the meta device in fp32, as the modules are built before
    a cast) beyond what its weight files hold: exit 2 naming the component, its largest tensor and
    the config file, instead of an allocator traceback minutes into the load.

    A large model on a host with less memory than its fp32 size is not this: its weights load in
    the run's dtype, often straight to the GPU. So the declared bytes must also exceed twice the
    component's safetensors files (fp32 against bf16 weights) to be refused: tensors its files do
    not hold (a buffer built from a config size) or a config that does not describe its weights."""
    from diffrl.models.memory import GIB, declared_tensor_bytes, memory_limit

    root, limit = resolve_model_path(path), memory_limit()
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or len(spec) != 2 or None in spec:
            continue
        if not (root / name / "config.json").is_file():
            continue
        declared = declared_tensor_bytes(root / name, spec[0], spec[1])
        stored = sum(f.stat().st_size for f in (root / name).glob("*.safetensors"))
        if declared is None or declared[0] <= max(limit.bytes, 2 * stored):
            continue
        total, tensor, shape = declared
        raise ValueError(
            f"model.path={path!r}: {root / name / 'config.json'} declares a {spec[1]} of "
            f"{total / GIB:,.1f} GiB of parameters and buffers (its largest, {tensor}, has shape "
            f"{list(shape)}), more than the {limit.describe()} this process may use: the config's sizes "
            "are wrong (a damaged or altered file) or the model needs a larger machine; copy or save "
            "the model again"
        )


def check_image_size(cfg: Config) -> None:
    """rollout.pipeline.height/width against what the model's config files allow, before it loads
    (`ImageGeometry`: VAE factor x patch size, at most pos_embed_max_size patches). Adapters check
    again, exactly, once loaded (a family that packs latents further says so then)."""
    geometry = ImageGeometry.read(resolve_model_path(cfg.model.path))
    pipe = cfg.rollout.pipeline
    for key, value in (("height", pipe.height), ("width", pipe.width)):
        if (problem := geometry.problem(value)) is not None:
            raise ConfigError(
                f"rollout.pipeline.{key}={value} does not fit the model {cfg.model.path!r}: {problem}: set "
                f"rollout.pipeline.{key}={geometry.nearest(value)}"
            )


def probe_scorers(specs: Sequence[Any]) -> None:
    """Every remote (`http`) reward's server answers /health within SCORER_PROBE_TIMEOUT_S, so an
    unreachable scorer fails in seconds instead of at step 1 after the model loads."""
    from diffrl.rewards.registry import base_name, build_reward
    from diffrl.rewards.remote import ScorerAnswered

    for spec in specs:
        if base_name(spec.name) != "http":
            continue
        args = dict(spec.args)
        args["timeout"] = min(float(args.get("timeout", SCORER_PROBE_TIMEOUT_S)), SCORER_PROBE_TIMEOUT_S)
        try:
            client = build_reward(spec.name, args)
        except ValueError as err:
            raise ValueError(f"reward.functions.{spec.name}: {err}") from None
        try:
            client.health()
        # An answer, but not a health report: an error status (ScorerAnswered: a 401 for a missing
        # or wrong token, a 404 for a wrong path) or not JSON. Something runs there, so "start it"
        # would be wrong; the client's message says what the answer means and what to change.
        except (ScorerAnswered, ValueError) as err:
            message = (
                f"reward.functions.{spec.name}: the scorer at args.url={spec.args.get('url')!r} answered "
                f"/health, but not with its status: {err}"
            )
        except OSError as err:  # ConnectionError, TimeoutError: nothing answered
            message = (
                f"reward.functions.{spec.name}: the scorer at args.url={spec.args.get('url')!r} did not "
                f"answer /health within {args['timeout']:g} s ({err}); start it (diffrl serve-reward NAME "
                "--port PORT) or correct args.url"
            )
        else:
            continue
        if spec.required:
            raise ValueError(message) from None
        print(f"warning: {message}; it is not required, so its samples will go unscored")


def preflight(cfg: Config) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Every check of an RL job that needs no model and no Ray; returns the train and validation prompts."""
    check_output_dir(cfg.trainer.output_dir, "trainer.output_dir")
    train, val = preflight_common(cfg)
    check_sizes(cfg, len(val))
    if cfg.algorithm.sample_source == "offline":
        from diffrl.data.preference import check_pairs

        pipe = cfg.rollout.pipeline
        check_pairs(train, cfg.data.chosen_key, cfg.data.rejected_key, pipe.height, pipe.width)
    return train, val
