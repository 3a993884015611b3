import pytest
import torch

from diffrl.config.schema import LoraConfig
from diffrl.models import load_model
from diffrl.train.lora import inject_lora, lora_policy, merged_adapter, merged_lora


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


def _distinct_adapters(adapter):
    """Non-zero, different trained and old adapters (LoRA's B starts at zero, so both start as the
    base model)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in adapter.transformer.named_parameters():
            if ".lora_" in name:
                p.add_(
                    (0.05 if ".default." in name else 0.03) * torch.randn(p.shape, generator=g).to(p.dtype)
                )


@pytest.mark.parametrize("name", ["default", "old"])
def test_merged_lora_runs_the_adapter_merged_and_restores_everything(tiny_model, name):
    """Inside `merged_lora(t, name)` the network computes what adapter `name` computes unmerged
    (fp32: to rounding), every targeted layer runs without its adapters, and afterwards the very
    same weight tensors, values, requires_grad flags and the active adapter are back."""
    adapter = load_model(tiny_model("sd3"), dtype="float32")
    inject_lora(adapter, LoraConfig(rank=4, alpha=8), ["default", "old"])
    _distinct_adapters(adapter)
    transformer = adapter.transformer
    params = dict(transformer.named_parameters())
    values = {n: p.detach().clone() for n, p in params.items()}
    flags = {n: p.requires_grad for n, p in params.items()}
    with torch.no_grad():
        transformer.set_adapter(name)
        unmerged = _velocity(adapter)
        transformer.set_adapter("default")
        base_of = {n: m.get_base_layer() for n, m in transformer.named_modules() if hasattr(m, "lora_A")}
        calls = []
        hooks = [
            m.register_forward_hook(lambda _m, _i, _o: calls.append(1))
            for n, m in transformer.named_modules()
            if ".lora_A." in n or ".lora_B." in n
        ]
        with merged_lora(transformer, name):
            assert all(base.weight is not params[f"{n}.base_layer.weight"] for n, base in base_of.items())
            merged = _velocity(adapter)
        for h in hooks:
            h.remove()
    assert not calls  # no LoRA matmul ran inside the block
    torch.testing.assert_close(merged, unmerged, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        active = _velocity(adapter)  # the trained adapter, unmerged: the block left it active
    if name == "old":  # the two adapters differ, so the comparison above could have failed
        assert (merged - active).abs().max() > 1e-3
    else:
        torch.testing.assert_close(merged, active, rtol=1e-5, atol=1e-5)
    after = dict(transformer.named_parameters())
    assert after.keys() == params.keys() and all(after[n] is params[n] for n in params)
    assert all(torch.equal(after[n], values[n]) for n in params)
    assert {n: p.requires_grad for n, p in after.items()} == flags
    assert transformer.active_adapters() == ["default"]


def test_merged_lora_names_a_missing_adapter(tiny_model):
    adapter = load_model(tiny_model("sd3"), dtype="float32")
    inject_lora(adapter, LoraConfig(rank=4, alpha=4), ["default"])
    with (
        pytest.raises(ValueError, match="no LoRA adapter named 'old'"),
        merged_lora(adapter.transformer, "old"),
    ):
        pass


def test_merged_adapter_runs_a_bf16_model_without_the_adapters_autocast(tiny_model):
    """A bf16 model with fp32 adapters computes under autocast; merged, every weight is bf16 and the
    network runs as the base model does (no autocast), close to the unmerged result, and the
    autocast setting is back afterwards."""
    adapter = load_model(tiny_model("sd3"), dtype="bfloat16")
    with torch.no_grad():
        base = _velocity(adapter).float()
    inject_lora(adapter, LoraConfig(rank=4, alpha=8), ["default"])
    _distinct_adapters(adapter)
    assert adapter.lora_autocast
    with torch.no_grad():
        unmerged = _velocity(adapter).float()
        with merged_adapter(adapter, "default"):
            assert not adapter.lora_autocast
            merged = _velocity(adapter).float()
    assert adapter.lora_autocast
    assert ((merged - unmerged).norm() / unmerged.norm()) < 0.02  # bf16 rounding (~0.013 here) ...
    assert ((base - unmerged).norm() / unmerged.norm()) > 0.05  # ... against the adapter's own effect


@pytest.mark.parametrize("name", ["old", None])
def test_switching_policies_never_changes_which_tensors_train(tiny_model, name):
    """peft's set_adapter / disable_adapters flip requires_grad; lora_policy puts the flags back at
    once, inside the switch and after it, while the other adapter (or none) really runs."""
    adapter = load_model(tiny_model("sd3"), dtype="float32")
    inject_lora(adapter, LoraConfig(rank=4, alpha=4), ["default", "old"])
    with torch.no_grad():
        for param_name, param in adapter.transformer.named_parameters():
            if ".lora_B.old." in param_name:
                param.normal_(0.0, 0.5)  # `old` differs from `default` (whose B is 0: the base)
    before = {n: p.requires_grad for n, p in adapter.transformer.named_parameters()}
    assert any(before.values()) and not any(v for n, v in before.items() if ".old." in n)
    with torch.no_grad():
        default = _velocity(adapter)
        with lora_policy(adapter.transformer, name, "default"):
            inside = {n: p.requires_grad for n, p in adapter.transformer.named_parameters()}
            switched = _velocity(adapter)
    assert inside == before
    assert {n: p.requires_grad for n, p in adapter.transformer.named_parameters()} == before
    if name == "old":
        assert not torch.equal(switched, default)  # the old adapter ran
    else:
        torch.testing.assert_close(switched, default)  # default's B = 0: disabled is the base too
