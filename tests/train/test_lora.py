import pytest
import torch

from diffrl.config.schema import LoraConfig
from diffrl.models import load_model
from diffrl.train.lora import inject_lora


def _velocity(adapter):
    cond = adapter.encode_prompts(["a red circle"], [""], max_sequence_length=8)
    latents = torch.randn(1, *adapter.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    return adapter.velocity(latents, torch.tensor([500.0]), cond, 4.5, height=32, width=32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_lora_weights_are_fp32_and_compute_in_the_models_dtype(tiny_model, dtype):
    """The trained adapter holds fp32 (master) weights and gradients, and its layers compute in the
    model's dtype: a bf16 model's LoRA matmuls give bf16 outputs, as they would in a bf16 model
    without fp32 weights; an fp32 model is left as it is."""
    adapter = load_model(tiny_model("sd3"), dtype=dtype)
    inject_lora(adapter, LoraConfig(rank=4, alpha=4), ["default", "old"])
    trained = {n: p for n, p in adapter.transformer.named_parameters() if p.requires_grad}
    assert trained and all(".default." in n for n in trained)
    assert {p.dtype for p in trained.values()} == {torch.float32}
    frozen_lora = [p for n, p in adapter.transformer.named_parameters() if ".old." in n]
    assert {p.dtype for p in frozen_lora} == {getattr(torch, dtype)}

    seen = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
        for n, m in adapter.transformer.named_modules()
        if n.endswith("lora_A.default")
    ]
    v = _velocity(adapter)
    for h in hooks:
        h.remove()
    assert seen and set(seen) == {getattr(torch, dtype)}
    v.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trained.values())
