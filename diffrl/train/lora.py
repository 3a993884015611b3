"""LoRA adapters on a model adapter's transformer, through diffusers' own PEFT integration."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from diffusers.training_utils import cast_training_params
from peft import LoraConfig as PeftLoraConfig
from peft.tuners.lora import LoraLayer

from diffrl.config.schema import LoraConfig
from diffrl.models.base import ModelAdapter
from diffrl.seeding import LORA_INIT_STREAM, derive_seed
from diffrl.train.fp8_frozen import FrozenFloat8Linear


def target_modules(lora: LoraConfig, family: type[ModelAdapter]) -> list[str]:
    """The module names LoRA adapts: `model.lora.target_modules`, else the family's declared list."""
    return list(lora.target_modules or family.default_lora_target_modules)


def inject_lora(adapter: ModelAdapter, lora: LoraConfig, names: Sequence[str], seed: int = 0) -> list[str]:
    """Add one LoRA adapter per name (same config each) and make the first the active, trained one.

    Target modules default to the family's declared list. The trained adapter's weights are fp32. The random initialisation draws from a
    generator seeded by `seed` (peft draws from torch's global RNG, so it is forked around it). Returns the target module names. The
    trainer and a separate rollout worker call this with the same config, so their parameter
    names match and weights can be streamed between them.
    """
    if lora.rank <= 0:
        raise ValueError(f"model.lora.rank={lora.rank}: LoRA needs rank > 0 (rank 0 means full fine-tuning)")
    targets = target_modules(lora, type(adapter))
    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=targets,
        init_lora_weights=True if lora.init == "default" else lora.init,
    )
    for index, name in enumerate(names):
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(LORA_INIT_STREAM, seed, index))
            # peft warns when a second adapter joins the first: that is the point here.
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            try:
                adapter.transformer.add_adapter(config, adapter_name=name)
            except ValueError as err:
                raise ValueError(
                    f"cannot add LoRA adapter {name!r} with target modules {targets}: {err}"
                ) from None
    adapter.transformer.set_adapter(names[0])  # only the active adapter's tensors require grad
    # fp32 weights for the trained adapter (AdamW's master weights; diffusers creates them in the
    # base dtype), computed in the model's dtype (ModelAdapter.run_transformer)
    cast_training_params(adapter.transformer, torch.float32)
    adapter.lora_autocast = adapter.dtype in (torch.bfloat16, torch.float16)
    return targets


@contextmanager
def merged_lora(transformer: torch.nn.Module, name: str) -> Iterator[None]:
    """Run `transformer` as its base weights plus LoRA adapter `name`, merged: inside the block
    every targeted layer's base weight is replaced by W + ΔW (peft's `get_delta_weight`, summed in
    fp32 and cast to W's dtype) and the adapters are off, so each layer is one matmul instead of
    three. For forward passes without gradients (rollouts, validation, the `old` policy's
    velocities); nothing in the block may update the weights.

    The original weight tensors are put back afterwards, untouched: nothing is added to them and
    subtracted again (peft's merge/unmerge), which would leave rounding drift in the base weights
    and break exact resume. The cost is one extra copy of the targeted weights while the block
    runs. With a 16-bit base the merged weight is rounded to that dtype, so an update much smaller
    than W's own precision is lost at sampling time (the trained fp32 adapter keeps it).
    """
    layers = [m for m in transformer.modules() if isinstance(m, LoraLayer) and name in m.lora_A]
    if not layers:
        raise ValueError(f"no LoRA adapter named {name!r} in the transformer: nothing to merge")
    swapped = []
    with torch.no_grad():
        for layer in layers:
            base = layer.get_base_layer()
            weight = base.weight
            if not isinstance(weight, torch.Tensor) or type(weight.data) is not torch.Tensor:
                raise ValueError(
                    f"model.lora.merge_inference needs unsharded weights, but {type(layer).__name__} holds a "
                    f"{type(weight.data).__name__}: set actor.strategy=none (one worker), or "
                    "model.lora.merge_inference=false"
                )
            delta = layer.get_delta_weight(name).to(torch.float32)
            merged = (weight.to(torch.float32) + delta).to(weight.dtype)
            swapped.append((base, weight, torch.nn.Parameter(merged, requires_grad=False)))
    # peft's enable_adapters also sets the adapters' requires_grad: restore them as they were
    adapter_params = [
        p for layer in layers for key in layer.adapter_layer_names for p in getattr(layer, key).parameters()
    ]
    requires_grad = [p.requires_grad for p in adapter_params]
    was_disabled = [layer.disable_adapters for layer in layers]
    for base, _, merged in swapped:
        base.weight = merged
        _recast(base)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for base, original, _ in swapped:
            base.weight = original
            _recast(base)
        for layer, disabled in zip(layers, was_disabled, strict=True):
            layer.enable_adapters(not disabled)
        for p, flag in zip(adapter_params, requires_grad, strict=True):
            p.requires_grad_(flag)


@contextmanager
def merged_adapter(adapter: ModelAdapter, name: str) -> Iterator[None]:
    """`merged_lora` on the adapter's transformer, without the autocast that fp32 adapter weights
    in a 16-bit model need (`ModelAdapter.lora_autocast`): merged, every weight is in the model's
    dtype, so the network runs as the plain base model does."""
    autocast = adapter.lora_autocast
    adapter.lora_autocast = False
    try:
        with merged_lora(adapter.transformer, name):
            yield
    finally:
        adapter.lora_autocast = autocast


def _recast(base: torch.nn.Module) -> None:
    """A cast-once float8 base layer (`model.fp8`) whose weight was just replaced casts it again."""
    if isinstance(base, FrozenFloat8Linear):
        base.refresh()


@contextmanager
def lora_policy(transformer: torch.nn.Module, name: str | None, default: str) -> Iterator[None]:
    """Run the LoRA-injected `transformer` with adapter `name` active, or with every adapter
    disabled (`name=None`: the base model, the reference policy), then with `default` again. The
    trainer (`TrainEngine.use_policy`) and a rollout replica (`RolloutWorker`) switch policies
    through this one function, so both run the same modules.

    Which tensors train never changes here: peft's `set_adapter` and `disable_adapters` also set
    `requires_grad` (only the active adapter's on), and FSDP2 fixes each parameter's
    `requires_grad` at its first unshard. A first forward under another policy (DiffusionNFT
    samples as `old` before any update) would then leave the trained adapter without gradients
    for the rest of the run, so the flags are put back as they were right after each switch."""
    flags = [(p, p.requires_grad) for p in transformer.parameters()]

    def switch(to: str | None) -> None:
        if to is None:
            transformer.disable_adapters()
        else:
            transformer.set_adapter(to)
        for param, flag in flags:
            param.requires_grad_(flag)

    switch(name)
    try:
        yield
    finally:
        if name is None:
            transformer.enable_adapters()
        switch(default)
