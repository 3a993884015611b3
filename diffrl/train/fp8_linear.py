"""torchao's float8 training linear with a switch per pass (imported only when `model.fp8` is on).

`SwitchableFloat8Linear` is torchao's `Float8Linear` (dynamic scaling, rowwise recipe: each row of
the input and of the weight gets its own power-of-two scale into float8 e4m3, then
`torch._scaled_mm`; the backward casts the output gradient the same way) with one attribute,
`fp8`: on, a pass runs torchao's forward; off, it runs `nn.Linear`'s own forward on the same
weight, so that pass is the unconverted model's bit for bit. `model.fp8=sampling` needs the switch:
colocated, the sampler and the trainer share one module, and only the sampler's passes run float8.
The weight stays a plain parameter in the model's dtype (the cast happens in each forward), so LoRA
merges, weight sync, checkpoints, FSDP2 sharding and the parameter names are those of `nn.Linear`.

torchao builds the module through `Float8Linear.from_float`, which constructs `cls`: this subclass
is made by torchao's own constructor, the only extension point it offers for the module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchao.float8 import Float8LinearConfig
from torchao.float8.float8_linear import Float8Linear

#: torchao's recipe: rowwise (axiswise) dynamic scaling, e4m3 for inputs, weights and gradients.
RECIPE = "rowwise"


class SwitchableFloat8Linear(Float8Linear):
    """torchao's `Float8Linear` whose `fp8` attribute picks float8 GEMMs (True) or `nn.Linear`'s
    forward (False) for the next passes (`diffrl.train.fp8.fp8_gemms`)."""

    fp8: bool = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            return super().forward(input)
        return F.linear(input, self.weight, self.bias)


def recipe_config() -> Float8LinearConfig:
    return Float8LinearConfig.from_recipe_name(RECIPE)


def to_float8(linear: torch.nn.Linear, config: Float8LinearConfig, enabled: bool) -> SwitchableFloat8Linear:
    """`linear` as a `SwitchableFloat8Linear` holding the same weight and bias parameters."""
    module = SwitchableFloat8Linear.from_float(linear, config=config)
    module.fp8 = enabled
    module.train(linear.training)
    return module


def apply_inductor_workaround() -> None:
    """What `convert_to_float8_training` does besides the swap: torchao's fix for a Triton
    miscompile of compiled float8 backward kernels (NaN/Inf bytes in a transposed fp8 store),
    applied only where float8 training is used. Absent in a torchao that does not need it."""
    try:
        from torchao.float8._inductor_patch import _patch_inductor_min_max_codegen
    except ImportError:
        return
    _patch_inductor_min_max_codegen()


__all__ = ["RECIPE", "SwitchableFloat8Linear", "apply_inductor_workaround", "recipe_config", "to_float8"]
