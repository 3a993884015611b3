"""Loading a checkpoint into a live model, optimizer and scheduler: `load_checkpoint`.

Every check runs before anything is restored: the checkpoint verifies against its manifest
(`diffrl.train.checkpoint_files`), the weights' shapes and LoRA settings fit the model
(`diffrl.train.checkpoint_fit`), and optim.json / scheduler.json fit the live optimizer and
scheduler (`_optimizer_target`, `fit_problem`), so a mismatch leaves the model untouched. Apart
from `diffrl.train.checkpoint` (saving, which re-exports `load_checkpoint`) because a load is
these checks and the restore, none of the save's files and publication.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from diffrl.train.checkpoint_files import (
    _FIX,
    MODEL_DIR,
    OPTIM_DIR,
    RNG_DIR,
    CheckpointError,
    _read_json,
    fit_problem,
    verify_checkpoint,
)
from diffrl.train.checkpoint_fit import check_model_matches
from diffrl.train.checkpoint_state import _load_tensors, _model_state
from diffrl.train.distributed import rank as process_rank
from diffrl.train.distributed import world_size
from diffrl.train.rng_state import restore_rng_state


def _restore_types(saved: Any, live: Any) -> Any:
    """JSON turns tuples (Adam's betas) into lists: give them back the live optimizer's type."""
    if isinstance(saved, dict) and isinstance(live, dict):
        return {key: _restore_types(value, live.get(key)) for key, value in saved.items()}
    if isinstance(saved, list) and isinstance(live, tuple):
        return tuple(saved)
    return saved


def _does_not_fit(path: Path, name: str, problem: str) -> None:
    raise CheckpointError(
        f"checkpoint {str(path)!r}: {name} does not fit this run's optimizer and scheduler: {problem}. "
        f"Resume with the actor.optim settings it was saved with; if they are the same, {_FIX}"
    )


def _optimizer_target(
    path: Path, saved: Any, model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """(this rank's optimizer state tensors to fill, the live state dict) for `saved` (optim.json),
    or a CheckpointError saying what does not fit; checked before anything is restored."""
    try:
        description, _, groups = saved["tensors"], saved["scalars"], saved["param_groups"]
        live = get_optimizer_state_dict(model, optimizer)  # initialises the state tensors to fill
        target: dict[str, dict[str, Any]] = {}
        for fqn, keys in description.items():
            have = live["state"].get(fqn, {})
            if not set(keys) <= set(have):
                raise ValueError(
                    f"the checkpoint's optimizer state for {fqn!r} has {sorted(keys)}, the optimizer has "
                    f"{sorted(k for k, v in have.items() if isinstance(v, torch.Tensor))}: resume with the "
                    "optimizer it was saved with (same actor.optim)"
                )
            target[fqn] = {key: have[key] for key in keys}
        if len(groups) != len(live["param_groups"]):
            raise ValueError(
                f"the checkpoint's optimizer has {len(groups)} param group(s), this one "
                f"{len(live['param_groups'])}: resume with the optimizer it was saved with"
            )
        for index, (group, live_group) in enumerate(zip(groups, live["param_groups"], strict=True)):
            if sorted(group["params"]) != sorted(live_group["params"]):
                _does_not_fit(path, "optim.json", f"param_groups[{index}].params lists other parameters")
            problem = fit_problem(group, live_group, f"param_groups[{index}]")
            if problem:
                _does_not_fit(path, "optim.json", problem)
    except (KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"checkpoint {str(path)!r}: optim.json is malformed ({err}); {_FIX}") from err
    return target, live


def _load_optimizer(
    path: Path,
    saved: Any,
    target: dict[str, dict[str, Any]],
    live: dict[str, Any],
    model: nn.Module,
    optimizer,
) -> None:
    """Restore `optimizer` from optim.json (`saved`) and its tensors, into `_optimizer_target`'s `target`."""
    scalars, groups = saved["scalars"], saved["param_groups"]
    _load_tensors(target, path / OPTIM_DIR)
    state = {fqn: {**target.get(fqn, {}), **scalars.get(fqn, {})} for fqn in set(target) | set(scalars)}
    param_groups = [_restore_types(g, lg) for g, lg in zip(groups, live["param_groups"], strict=True)]
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": param_groups})


def _check_adapters_bound(path: Path, model: nn.Module, model_state: dict[str, Any], bound: Any) -> None:
    """Raise AdapterMismatchError unless the load bound every adapter tensor the model trains.

    `bound` is what `set_model_state_dict` reports (missing and unexpected keys): not strict for
    adapters, it would pass over an adapter tensor it did not bind, and the module would train on
    from its initial weights (LoRA's B = 0) as if resumed. (That the state covers every tensor
    that requires grad, `_model_state` checks.)"""
    from diffrl.models.lora_check import check_adapter_tensors

    where = f"checkpoint {str(path)!r}"
    fix = (
        "The model's adapters and the state loaded into them disagree although their settings match: "
        "a bug in the load (please report it with the modules named); the checkpoint itself may be intact"
    )
    shapes = {key: tuple(value.shape) for key, value in model_state.items()}
    missing = set(bound.missing_keys)
    arrived = {key: shape for key, shape in shapes.items() if key not in missing}
    arrived.update({key: shapes.get(key, ()) for key in bound.unexpected_keys})
    check_adapter_tensors(where, shapes, arrived, side="the model after loading", fix=fix)


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    trainable_only: bool,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restore a `save_checkpoint` directory into `model`/`optimizer`/`scheduler` and return its `extra`.

    Call it on every rank, after the model has its adapters (same names, ranks and targets as when
    saved) and after FSDP sharding, with `trainable_only` as when saved. The checkpoint is first
    verified against its manifest (`verify_checkpoint`: a damaged, altered or old-format checkpoint
    raises a CheckpointError, a ValueError, naming the file), then the weights are checked against
    the saved shapes, so a mismatch raises a ValueError naming what differs and leaves the model
    untouched. `optimizer=None`/`scheduler=None` skip their state (e.g. loading weights for export).
    `restore_rng=True` restores this rank's python, numpy, torch and CUDA RNG states (the run's
    world size must match the saved one).
    """
    path = Path(path)
    meta = verify_checkpoint(path)
    if meta["trainable_only"] != trainable_only:
        saved = "LoRA adapters only" if meta["trainable_only"] else "the full model"
        raise ValueError(
            f"checkpoint {str(path)!r} holds {saved} (saved with trainable_only={meta['trainable_only']}); "
            f"pass trainable_only={meta['trainable_only']} and a model configured the same way "
            "(model.lora.rank > 0 for adapters, 0 for full fine-tuning)"
        )
    if scheduler is not None and not meta["has_scheduler"]:
        raise ValueError(
            f"checkpoint {str(path)!r} was saved without a scheduler state: pass scheduler=None to load it"
        )
    rng_file = path / RNG_DIR / f"rank_{process_rank():05d}.json"
    if restore_rng and (meta["world_size"] != world_size() or not rng_file.is_file()):
        raise ValueError(
            f"checkpoint {str(path)!r} was saved by {meta['world_size']} rank(s) and this run has "
            f"{world_size()}: RNG states are per rank; resume with the same world size, or pass "
            "restore_rng=False (weights, optimizer and scheduler still load, resharded to this run); "
            f"from the command line: resume with trainer.n_gpus_per_node x trainer.nnodes = {meta['world_size']}, "
            f"or `diffrl export {path}` and start a new run from the exported weights with model.path"
        )

    model_state = _model_state(model, trainable_only)
    check_model_matches(path, meta, model, model_state, trainable_only)
    # Every JSON file is parsed before anything is restored: a malformed one leaves all untouched.
    extra = _read_json(path, "extra.json")
    load_optimizer = optimizer is not None and meta["has_optimizer_state"]
    optim_saved = _read_json(path, "optim.json") if load_optimizer else None
    scheduler_state = _read_json(path, "scheduler.json") if scheduler is not None else None
    rng_state = _read_json(path, rng_file.relative_to(path).as_posix()) if restore_rng else None
    if scheduler is not None and (
        problem := fit_problem(scheduler_state, scheduler.state_dict(), "its state")
    ):
        _does_not_fit(path, "scheduler.json", problem)
    if load_optimizer:  # its values checked against the live optimizer's, still before any restore
        optim_target, optim_live = _optimizer_target(path, optim_saved, model, optimizer)
    _load_tensors(model_state, path / MODEL_DIR)
    # Not strict for adapters: the frozen base weights are deliberately absent from the state.
    bound = set_model_state_dict(model, model_state, options=StateDictOptions(strict=not trainable_only))
    if trainable_only:
        _check_adapters_bound(path, model, model_state, bound)
    if load_optimizer:
        _load_optimizer(path, optim_saved, optim_target, optim_live, model, optimizer)
    if scheduler is not None:
        scheduler.load_state_dict(scheduler_state)
    if rng_state is not None:
        restore_rng_state(rng_state, rng_file)
    return extra
