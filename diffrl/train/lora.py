"""LoRA adapters on a model adapter's transformer, through diffusers' own PEFT integration."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from diffusers.training_utils import cast_training_params
from peft import LoraConfig as PeftLoraConfig

from diffrl.config.schema import LoraConfig
from diffrl.models.base import ModelAdapter
from diffrl.seeding import LORA_INIT_STREAM, derive_seed


def inject_lora(adapter: ModelAdapter, lora: LoraConfig, names: Sequence[str], seed: int = 0) -> list[str]:
    """Add one LoRA adapter per name (same config each) and make the first the active, trained one.

    Target modules default to the family's declared list. The trained adapter's weights are fp32. The random initialisation draws from a
    generator seeded by `seed` (peft draws from torch's global RNG, so it is forked around it). Returns the target module names. The
    trainer and a separate rollout worker call this with the same config, so their parameter
    names match and weights can be streamed between them.
    """
    if lora.rank <= 0:
        raise ValueError(f"model.lora.rank={lora.rank}: LoRA needs rank > 0 (rank 0 means full fine-tuning)")
    targets = list(lora.target_modules or adapter.default_lora_target_modules)
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
