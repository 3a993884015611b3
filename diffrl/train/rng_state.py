"""A process's global RNG states as JSON values, and back: what a checkpoint's `rng/rank_<r>.json`
holds (`diffrl.train.checkpoint`), so that a resumed rank continues every random stream it drew
from: python's `random`, numpy's global generator, torch's CPU generator and, once CUDA is in use,
the current device's (diffrl runs one process per GPU). Byte states are lists of ints."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states. CUDA's only once CUDA is initialised: a process that never
    touched CUDA has drawn nothing from it (and asking would create a CUDA context on a CPU run)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": keys.astype(np.int64).tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def parse_rng_state(state: Any) -> tuple[Any, Any, torch.Tensor, torch.Tensor | None]:
    """(python, numpy, torch, cuda or None) states of `capture_rng_state`'s JSON, each of the type
    its setter takes, checked without touching this process's generators; anything else is a
    ValueError naming the error."""
    try:
        python, numpy = state["python"], state["numpy"]
        python_state = (int(python["version"]), tuple(int(v) for v in python["internal"]), python["gauss"])
        numpy_state = (
            str(numpy["kind"]),
            np.asarray(numpy["keys"], dtype=np.int64).astype(np.uint32),
            int(numpy["pos"]),
            int(numpy["has_gauss"]),
            float(numpy["gauss"]),
        )
        torch_state = torch.tensor(state["torch"], dtype=torch.uint8)
        cuda_state = torch.tensor(state["cuda"], dtype=torch.uint8) if "cuda" in state else None
        # what the setters would refuse, found on throwaway generators
        random.Random().setstate(python_state)
        np.random.RandomState().set_state(numpy_state)
        torch.Generator().set_state(torch_state)
    except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as err:
        raise ValueError(f"{type(err).__name__}: {err}") from err
    return python_state, numpy_state, torch_state, cuda_state


def restore_rng_state(state: dict[str, Any], source: Path) -> None:
    """Set this process's generators to `state`, read from the checkpoint file `source`."""
    if "cuda" in state and not torch.cuda.is_available():
        raise ValueError(
            f"{source} holds a CUDA RNG state but CUDA is not available here: the run cannot continue "
            "bit-identically on this machine; pass restore_rng=False to load everything else (from the "
            f"command line: resume on a CUDA machine, or `diffrl export {source.parent.parent}` and "
            "start a new run from the exported weights with model.path)"
        )
    try:
        python_state, numpy_state, torch_state, cuda_state = parse_rng_state(state)
    except ValueError as err:
        raise ValueError(f"{source} is not a valid RNG state ({err})") from err
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)
    if cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state)
