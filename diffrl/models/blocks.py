"""A transformer's repeated blocks: finding them by class name, and telling their structures apart.

Every family declares its block classes (`ModelAdapter.block_class_names`); the blocks are the
units of FSDP2 sharding and activation checkpointing (`diffrl.train.fsdp`) and of regional
compilation (`ModelAdapter.compile_blocks`), which grants each distinct block structure its own
share of dynamo's recompile limit. Apart from `base` (the adapter contract) because it works on
any `nn.Module`, sharded or not, and the trainer's parallelism uses it without an adapter.
"""

from __future__ import annotations

from collections import Counter

import torch


def find_blocks(module: torch.nn.Module, block_class_names: tuple[str, ...]) -> list[torch.nn.Module]:
    """Submodules of a class named in `block_class_names` (or derived from one), in `modules()` order.

    A class is matched through its whole MRO, not only its own name: FSDP2's `fully_shard` turns a
    `JointTransformerBlock` into an instance of a generated `FSDPJointTransformerBlock` subclass,
    and the blocks must still be found after sharding (compilation, activation checkpointing).

    Raises ValueError when the names are malformed or nothing matches, listing the repeated
    classes the module does have (the usual candidates).
    """
    if isinstance(block_class_names, str) or not all(isinstance(n, str) for n in block_class_names):
        raise ValueError(
            f"block_class_names must be a tuple of class-name strings; got {block_class_names!r} "
            "(for one class write ('JointTransformerBlock',))"
        )
    if not block_class_names:
        raise ValueError("block_class_names is empty: name the transformer's repeated block classes")
    names = set(block_class_names)
    blocks = [m for m in module.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not blocks:
        counts = Counter(type(m).__name__ for m in module.modules())
        repeated = sorted(name for name, n in counts.items() if n > 1)
        raise ValueError(
            f"no submodule of {type(module).__name__} has a class named {', '.join(block_class_names)}: "
            f"pass the class names of its repeated blocks (classes appearing more than once: "
            f"{', '.join(repeated) or 'none'}); for a model adapter use adapter.block_class_names"
        )
    return blocks


# torch's default dynamo recompile limit, granted to each distinct block structure (see compile_blocks).
_GRAPHS_PER_STRUCTURE = 8


def _block_structure(block: torch.nn.Module) -> tuple:
    """What makes dynamo guard a block differently: its submodule names and its scalar attributes."""
    scalars = sorted(
        (name, key, repr(value))
        for name, m in block.named_modules()
        for key, value in vars(m).items()
        if isinstance(value, bool | int | float | str)
    )
    return type(block).__name__, tuple(scalars)
