"""Everything `diffrl train` checks before any model or Ray starts (run.py's first stage).

Order matters for users: a config typo, a missing model directory, an empty prompt file, an
unknown reward or an unwritable output place is reported before Ray or any model starts, and
nothing is written for a run that cannot start. `preflight_common` serves every job (train, sft,
eval); `preflight` adds the RL loops' checks. Choosing `actor.strategy=auto` happens here too:
it needs the model directory and, for the merge check, comes before any worker exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from diffrl.algos import (
    DIRECT_PREFERENCE,
    PAIRS,
    DirectPreferenceSpec,
    algorithm,
    algorithms,
    uses_old_adapter,
)
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
    check_image_size(cfg)
    choose_parallelism(cfg)
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


def choose_parallelism(cfg: Config) -> None:
    """Resolve `actor.strategy=auto` in `cfg` (diffrl.train.parallel) from the world size, LoRA or
    full fine-tuning, and the pipeline's weights against one device's memory; with several
    workers the choice and its reason are the run's first line."""
    from diffrl.train.parallel import choose_strategy, device_memory_bytes, pipeline_weight_bytes

    actor, lora = cfg.actor, cfg.model.lora.rank > 0
    weight_bytes = device_bytes = None
    if actor.strategy == "auto" and cfg.world_size > 1 and lora:
        dtype = getattr(torch, cfg.model.dtype)
        weight_bytes = pipeline_weight_bytes(resolve_model_path(cfg.model.path), dtype)
        device_bytes = device_memory_bytes(cfg.trainer.n_gpus_per_node)
    choice = choose_strategy(
        actor.strategy,
        world_size=cfg.world_size,
        lora=lora,
        sequence_parallel=actor.sequence_parallel_size > 1,
        param_offload=actor.param_offload,
        weight_bytes=weight_bytes,
        device_bytes=device_bytes,
    )
    if cfg.world_size > 1:
        print(choice.line(), flush=True)
    actor.strategy = choice.strategy


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
    _check_trainer_type(cfg)
    if cfg.algorithm.trainer_type == DIRECT_PREFERENCE:
        _check_direct_preference(cfg)
    train, val = preflight_common(cfg)
    _check_merge_inference(cfg)  # after preflight_common has chosen actor.strategy
    check_sizes(cfg, len(val))
    if cfg.algorithm.sample_source == "offline":
        from diffrl.data.preference import check_pairs

        pipe = cfg.rollout.pipeline
        check_pairs(train, cfg.data.chosen_key, cfg.data.rejected_key, pipe.height, pipe.width)
    return train, val


def _check_merge_inference(cfg: Config) -> None:
    """model.lora.merge_inference: where merged weights are safe and possible."""
    if not cfg.model.lora.merge_inference:
        return
    if cfg.model.lora.rank <= 0:
        raise ConfigError(
            "model.lora.merge_inference=true needs LoRA adapters to merge, but model.lora.rank=0 (full "
            "fine-tuning samples with the trained weights as they are): set model.lora.merge_inference=false"
        )
    if cfg.algorithm.trainer_type != DIRECT_PREFERENCE and cfg.reuses_rollout_log_probs:
        raise ConfigError(
            "model.lora.merge_inference=true with algorithm.old_log_probs=rollout: merged weights give "
            "velocities that differ from the trained adapter's in the last bits, so the rollout's SDE "
            "log-probabilities are not the trainer's, and PPO's ratio would start off 1 (a clip range "
            "of 1e-4 sees that). Set algorithm.old_log_probs=auto (it recomputes them with the adapter, "
            "as the update runs it), or model.lora.merge_inference=false"
        )
    if cfg.algorithm.trainer_type != DIRECT_PREFERENCE and cfg.trainer.placement == "separate":
        raise ConfigError(
            "model.lora.merge_inference=true with a policy-gradient loss and trainer.placement=separate: "
            "the replicas' passes without gradient (rollout.log_prob_passes) must run the adapter as the "
            "trainer's update does, which merged weights do not. Set model.lora.merge_inference=false, "
            "or trainer.placement=colocated"
        )
    if cfg.actor.strategy == "fsdp2" and cfg.world_size > 1:
        raise ConfigError(
            f"model.lora.merge_inference=true needs unsharded weights, but actor.strategy=fsdp2 shards them "
            f"over {cfg.world_size} workers: set actor.strategy=ddp (replicated weights) or "
            "model.lora.merge_inference=false"
        )


def _check_trainer_type(cfg: Config) -> None:
    """The loss and the loop must fit each other, in both directions: a policy-gradient loss needs
    SDE transitions and log-probs, a direct-preference loss clean samples at fresh noise levels."""
    mode, trainer_type = cfg.actor.loss.mode, cfg.algorithm.trainer_type
    needs = algorithm(mode).loop
    if needs != trainer_type:
        raise ConfigError(
            f"actor.loss.mode={mode} needs algorithm.trainer_type={needs}, but it is {trainer_type}: set "
            f"algorithm.trainer_type={needs}, or choose a {trainer_type} loss"
        )


def _check_direct_preference(cfg: Config) -> None:
    """Settings of the direct-preference loop that would otherwise be silently ignored or fail late."""
    algo, mode = cfg.algorithm, cfg.actor.loss.mode
    if algo.sample_source == "offline":
        spec = algorithm(mode)
        if not (isinstance(spec, DirectPreferenceSpec) and spec.trains_on == PAIRS):
            on_pairs = "/".join(s.name for s in algorithms(DIRECT_PREFERENCE) if s.trains_on == PAIRS)
            raise ConfigError(
                f"algorithm.sample_source=offline reads preference pairs, which only actor.loss.mode={on_pairs} "
                f"trains on (got {mode}): set actor.loss.mode={on_pairs}, or algorithm.sample_source=online"
            )
        if cfg.rollout.n != 2:
            raise ConfigError(
                f"rollout.n={cfg.rollout.n}: with algorithm.sample_source=offline each row is a group of "
                "two images (chosen, rejected), so set rollout.n=2 (actor.mini_batch_size counts images)"
            )
    rc, defaults = algo.rollout_correction, Config().algorithm
    if rc != defaults.rollout_correction:
        raise ConfigError(
            "algorithm.rollout_correction has no effect with algorithm.trainer_type=direct_preference "
            "(no SDE log-probs are compared): leave it at its defaults"
        )
    if algo.old_policy != defaults.old_policy and not uses_old_adapter(cfg.actor.loss):
        raise ConfigError(
            f"algorithm.old_policy has no effect with actor.loss.mode={mode} (no `old` adapter): leave it "
            "at its defaults, or use an algorithm with an `old` adapter (docs/algorithms.md), e.g. "
            "diffusion_nft, or awm with actor.loss.awm_ema_kl_coef > 0"
        )
    if uses_old_adapter(cfg.actor.loss) and cfg.model.lora.rank <= 0:
        raise ConfigError(
            f"actor.loss.mode={mode} needs an `old` adapter, which exists only with LoRA: set "
            "model.lora.rank > 0"
        )
