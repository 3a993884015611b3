"""`model.fp8`: float8 GEMMs for the transformer blocks' linear layers.

Which layers (`fp8_linear_names`): the plain `nn.Linear` layers inside the family's declared
transformer blocks (`ModelAdapter.block_class_names`: they hold nearly all of the GEMM FLOPs), that
is the attention projections and the MLPs, each a GEMM over every token. Not converted:

- the LoRA adapters (`lora_A` / `lora_B` of peft's tuner layers): they train in their own dtype;
  under a LoRA-adapted projection only its frozen `base_layer` is converted;
- the modulation layers of adaptive norms (`norm1.linear`, Qwen-Image's `img_mod`, Z-Image's
  `adaLN_modulation`): their input is one conditioning vector per sample, a GEMM of B rows where
  float8 gains nothing and the weight's cast costs a pass over it;
- layers outside the blocks (embeddings, the final norm and projection), and any whose in or out
  features are not multiples of 16 (`torch._scaled_mm` requires it);
- norms and the attention computation itself are not linear layers: they stay as they are.

How (`convert`): a layer whose weight is frozen (a LoRA run's base, a full fine-tuning run's
reference copy) becomes `diffrl.train.fp8_frozen.FrozenFloat8Linear`: its weight is cast to e4m3
once (again only where it changes: `refresh_cast_weights`), each call casts only its input, and
the backward computes only the gradient to the input, with `torch._scaled_mm` directly. A trained
weight (full fine-tuning) becomes torchao's float8 training linear instead
(`Float8LinearConfig.from_recipe_name(model.fp8_scaling)`, `diffrl.train.fp8_linear`), which
casts the weight on each call and computes the weight gradient in float8 too; so does a frozen
one under FSDP2 (`cast_once=False`), whose cast copies would otherwise be whole on every rank.
Scales (`model.fp8_scaling`): `rowwise`, one per row of the input and of the weight (per column
for the backward's weight), or `tensorwise`, one per tensor. Both classes carry an on/off
attribute, `fp8`, because colocated sampling and training share one module and `sampling`
switches float8 on for the sampler's passes only (`for_sampling`); off, a layer runs
`nn.Linear`'s own forward, so the trainer's passes are those of an unconverted model.

- `sampling`: the sampler's passes (rollouts and validation) in float8; the update, the reference
  pass and recomputed log-probs in the model's dtype. The rollout's log-probs then differ from the
  trainer's, so `algorithm.old_log_probs=auto` recomputes them (the plan refuses `rollout`), and
  `rollout_correction/*` logs the gap.
- `all`: every pass in float8: the sampler, the reference, the recomputed log-probs, the update's
  forward and its backward (gradients to the inputs, so the LoRA adapters' gradients flow through
  float8 GEMMs of the frozen base). With full fine-tuning (`model.lora.rank=0`) the trained
  layers' weight gradients are float8 GEMMs too (torchao's training recipe).

Use float8 with `model.compile=true`: uncompiled, the per-call casts are separate kernels.

Where: `TrainEngine` converts its module after the LoRA injection and before sharding and
compilation; a separate rollout replica converts its own copy the same way
(`diffrl.workers.rollout_worker`). The weights stay parameters in the model's dtype with the
names of `nn.Linear` (the float8 copies are buffers that are not saved), so weight sync,
checkpoints, export, LoRA merges and FSDP2 sharding see the model they would without float8;
what replaces a frozen weight (a LoRA merge, a replica's weight sync) refreshes its cast.

torchao is imported only when `model.fp8` is on (`diffrl.config.plan.FP8_TORCHAO` names the release;
`pip install 'diffrl[fp8]'`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager

import torch

from diffrl.config.plan import torchao_problem
from diffrl.models.base import ModelAdapter
from diffrl.models.blocks import find_blocks

NONE, SAMPLING, ALL = "none", "sampling", "all"
#: float8 tensor cores: Ada (8.9: L4, L40S) and Hopper (9.0: H100, H200) and newer.
MIN_CAPABILITY = (8, 9)
#: A path component of an adaptive norm's modulation layer (its input is one vector per sample).
_MODULATION = re.compile(r"^(norm.*|.*_mod|.*modulation.*)$")
#: `torch._scaled_mm` needs both GEMM dimensions of the weight in multiples of this.
_ALIGN = 16


def fp8_linear_names(transformer: torch.nn.Module, block_class_names: tuple[str, ...]) -> list[str]:
    """Qualified names (in `transformer.named_modules()`) of the linear layers `model.fp8` converts
    (the module docstring says which and why), in module order."""
    names = {module: name for name, module in transformer.named_modules()}
    adapters = _adapter_modules(transformer)
    selected = []
    for block in find_blocks(transformer, block_class_names):
        prefix = names[block]
        for name, module in block.named_modules():
            if type(module) is not torch.nn.Linear or module in adapters:
                continue
            if any(_MODULATION.match(part) for part in name.split(".")):
                continue
            if module.in_features % _ALIGN or module.out_features % _ALIGN:
                continue
            selected.append(f"{prefix}.{name}" if prefix else name)
    return selected


def _adapter_modules(transformer: torch.nn.Module) -> set[torch.nn.Module]:
    """Every module inside a peft tuner layer's adapter containers (`lora_A`, `lora_B`, ...)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    found: set[torch.nn.Module] = set()
    for module in transformer.modules():
        if isinstance(module, BaseTunerLayer):
            for attr in module.adapter_layer_names:
                container = getattr(module, attr, None)
                if isinstance(container, torch.nn.Module):
                    found.update(container.modules())
    return found


def check_device(mode: str, device: torch.device | str) -> None:
    """Raise ValueError unless `device` runs float8 GEMMs: a CUDA GPU of compute capability 8.9+."""
    device = torch.device(device)
    fix = "set model.fp8=none"
    if device.type != "cuda":
        raise ValueError(
            f"model.fp8={mode} runs float8 GEMMs on a GPU with float8 tensor cores (compute capability "
            f"8.9 or newer: L4, L40S, H100, H200, B200), but this worker's device is {device}: {fix}"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ValueError(
            f"model.fp8={mode} needs float8 tensor cores (compute capability 8.9 or newer: L4, L40S, "
            f"H100, H200, B200), but {torch.cuda.get_device_name(device)} has compute capability "
            f"{capability[0]}.{capability[1]}: {fix}"
        )


def require_torchao(mode: str) -> None:
    """Raise ValueError naming the install command when torchao is missing or too old."""
    problem = torchao_problem(mode)
    if problem:
        raise ValueError(problem)


def convert(
    transformer: torch.nn.Module,
    block_class_names: tuple[str, ...],
    mode: str,
    scaling: str = "rowwise",
    cast_once: bool = True,
) -> list[str]:
    """Swap the `fp8_linear_names` layers of `transformer` for switchable float8 linears, in place
    (frozen weights cast once where `cast_once`, the module docstring says which class); float8 is
    on from now for `all` and off (until `fp8_gemms` or `for_sampling` turns it on) for `sampling`.
    Returns the converted names. No device check: `prepare` is the run's entry point."""
    if mode not in (SAMPLING, ALL):
        raise ValueError(f"model.fp8={mode!r}: convert only for {SAMPLING!r} or {ALL!r}")
    from diffrl.train.fp8_frozen import FrozenFloat8Linear

    selected = fp8_linear_names(transformer, block_class_names)
    if not selected:
        raise ValueError(
            f"model.fp8={mode}: {type(transformer).__name__} has no linear layer to run in float8 inside "
            f"its blocks ({', '.join(block_class_names)}; in and out features must be multiples of {_ALIGN}): "
            "set model.fp8=none"
        )
    enabled = mode == ALL
    torchao_config = None
    for name in selected:
        linear = transformer.get_submodule(name)
        if cast_once and not linear.weight.requires_grad:
            swapped = FrozenFloat8Linear.from_linear(linear, scaling, enabled=enabled)
        else:
            if torchao_config is None:
                require_torchao(mode)
                from torchao.float8 import Float8LinearConfig

                from diffrl.train.fp8_linear import apply_inductor_workaround

                apply_inductor_workaround()
                torchao_config = Float8LinearConfig.from_recipe_name(scaling)
            from diffrl.train.fp8_linear import to_float8

            swapped = to_float8(linear, torchao_config, enabled=enabled)
        transformer.set_submodule(name, swapped)
    return selected


def prepare(
    adapter: ModelAdapter,
    mode: str,
    *,
    scaling: str = "rowwise",
    cast_once: bool = True,
    reference: torch.nn.Module | None = None,
) -> list[str]:
    """`model.fp8` for a model adapter's transformer (and a full fine-tuning run's frozen reference
    copy): check the device, convert. Nothing for `none`. Returns the converted names."""
    if mode == NONE:
        return []
    check_device(mode, adapter.device)
    names = convert(adapter.transformer, adapter.block_class_names, mode, scaling, cast_once)
    if reference is not None:
        convert(reference, adapter.block_class_names, mode, scaling, cast_once)
    return names


def refresh_cast_weights(module: torch.nn.Module, changed: Iterable[str]) -> int:
    """Re-cast the float8 copies of `module`'s cast-once layers whose weight is among `changed`
    (state-dict names, e.g. a weight sync's): their 16-bit weight was replaced in place. Returns
    how many were re-cast."""
    from diffrl.train.fp8_frozen import FrozenFloat8Linear

    changed = set(changed)
    count = 0
    for name, layer in module.named_modules():
        if isinstance(layer, FrozenFloat8Linear) and f"{name}.weight" in changed:
            layer.refresh()
            count += 1
    return count


def float8_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The converted layers of `module` (none when `model.fp8=none`, without importing torchao)."""
    return [
        m for m in module.modules() if type(m).__name__ in ("FrozenFloat8Linear", "SwitchableFloat8Linear")
    ]


@contextmanager
def fp8_gemms(module: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Inside the block, `module`'s converted layers run float8 GEMMs (`enabled`) or their 16-bit
    ones; each layer's previous setting is put back after. Compiled blocks guard on the setting,
    so each of the two settings keeps a graph of its own (no recompile after the first of each)."""
    layers = float8_layers(module)
    before = [layer.fp8 for layer in layers]
    for layer in layers:
        layer.fp8 = enabled
    try:
        yield
    finally:
        for layer, state in zip(layers, before, strict=True):
            layer.fp8 = state


def for_sampling(
    use_policy: Callable[[str], AbstractContextManager], transformer: torch.nn.Module, mode: str
) -> Callable[[str], AbstractContextManager]:
    """The sampler's policy switch (`RolloutWorker`'s `use_policy`) with float8 on for its passes
    when `mode` is `sampling`; `use_policy` itself otherwise (`all` is always on, `none` has no float8)."""
    if mode != SAMPLING:
        return use_policy

    @contextmanager
    def sampling_policy(name: str) -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(use_policy(name))
            stack.enter_context(fp8_gemms(transformer, True))
            yield

    return sampling_policy


__all__ = [
    "ALL",
    "MIN_CAPABILITY",
    "NONE",
    "SAMPLING",
    "check_device",
    "convert",
    "float8_layers",
    "for_sampling",
    "fp8_gemms",
    "fp8_linear_names",
    "prepare",
    "refresh_cast_weights",
    "require_torchao",
]
