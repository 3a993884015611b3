"""Weight export: the diffusers LoRA format loads into the real pipeline (every family's, every trained
module bound), merged weights load without peft."""

from __future__ import annotations

import warnings

import pytest
import torch
from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
from peft import LoraConfig

from diffrl.models import load_model
from diffrl.models.sd3 import SD3Adapter
from diffrl.models.tiny import FAMILY_BUILDERS
from diffrl.train.export import export_full, export_lora, iter_weights

TARGETS = list(SD3Adapter.default_lora_target_modules)


def _transformer(tiny_dir, *, lora: bool = True):
    """Tiny SD3 transformer with "default" and "old" adapters whose A and B are all non-zero.

    peft's init makes B = 0 (the adapter starts as the identity), which would let an export that
    drops or mis-scales the adapter pass; perturbing B makes the adapters change the output.
    lora_alpha = 2r gives a scale of 2, so an export that loses alpha (scale 1) fails too.
    """
    transformer = load_model(tiny_dir, dtype="float32").transformer
    if not lora:
        return transformer
    torch.manual_seed(0)
    for name in ("default", "old"):
        transformer.add_adapter(
            LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights="gaussian"),
            adapter_name=name,
        )
    transformer.set_adapter("default")
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.2)
    return transformer


def _inputs():
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(2, 16, 8, 8, generator=g),
        "encoder_hidden_states": torch.randn(2, 6, 64, generator=g),
        "pooled_projections": torch.randn(2, 48, generator=g),
        "timestep": torch.tensor([250.0, 750.0]),
    }


@torch.no_grad()
def _forward(transformer):
    return transformer(**_inputs(), return_dict=False)[0]


@pytest.mark.parametrize("adapter_name", ["default", "old"])
def test_exported_lora_loads_into_the_diffusers_pipeline(tiny_model, tmp_path, adapter_name):
    tiny = tiny_model("sd3")
    transformer = _transformer(tiny)
    transformer.set_adapter(adapter_name)
    expected = _forward(transformer)

    out = export_lora(
        transformer, tmp_path / "lora", pipeline_class=StableDiffusion3Pipeline, adapter_name=adapter_name
    )
    assert (out / "pytorch_lora_weights.safetensors").is_file()

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny, dtype=torch.float32, local_files_only=True)
    base = _forward(pipe.transformer)
    assert (base - expected).abs().max() > 1e-2  # the adapter matters at these inputs
    pipe.load_lora_weights(out)
    torch.testing.assert_close(_forward(pipe.transformer), expected, rtol=1e-5, atol=1e-5)


def test_export_lora_rejects_unknown_adapters_and_models_without_lora(tiny_model, tmp_path):
    tiny = tiny_model("sd3")
    with pytest.raises(
        ValueError, match=r"'ema' is not one of the transformer's adapters \['default', 'old'\]"
    ):
        export_lora(_transformer(tiny), tmp_path, pipeline_class=StableDiffusion3Pipeline, adapter_name="ema")
    with pytest.raises(ValueError, match=r"has none.*export_full"):
        export_lora(_transformer(tiny, lora=False), tmp_path, pipeline_class=StableDiffusion3Pipeline)
    with pytest.raises(ValueError, match="no save_lora_weights"):
        export_lora(_transformer(tiny), tmp_path, pipeline_class=SD3Transformer2DModel)


def test_export_full_merges_the_adapter_into_a_copy(tiny_model, tmp_path):
    transformer = _transformer(tiny_model("sd3"))
    expected = _forward(transformer)
    before = {k: v.clone() for k, v in transformer.state_dict().items()}

    with pytest.raises(
        ValueError, match=r"carries LoRA adapters \['default', 'old'\].*merge=True.*export_lora"
    ):
        export_full(transformer, tmp_path / "unmerged")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = export_full(transformer, tmp_path / "merged", merge=True)
    # the copy takes both named adapters on purpose: peft's "multiple adapters" warning is not the user's
    assert not [w for w in caught if "peft_config" in str(w.message)]

    merged = SD3Transformer2DModel.from_pretrained(out)
    assert not any("lora" in key for key in merged.state_dict())
    torch.testing.assert_close(_forward(merged), expected, rtol=1e-5, atol=1e-5)
    after = transformer.state_dict()  # the training module keeps its adapters, unchanged
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    torch.testing.assert_close(_forward(transformer), expected, rtol=0, atol=0)


def test_export_full_of_a_fully_fine_tuned_model_is_its_state_dict(tiny_model, tmp_path):
    transformer = _transformer(tiny_model("sd3"), lora=False)
    with torch.no_grad():
        transformer.transformer_blocks[0].attn.to_q.weight.add_(1.0)  # "trained": differs from the directory
    out = export_full(transformer, tmp_path / "full")
    saved = SD3Transformer2DModel.from_pretrained(out).state_dict()
    expected = transformer.state_dict()
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in expected)


def test_iter_weights_yields_the_state_dict(tiny_model):
    transformer = _transformer(tiny_model("sd3"))
    state = transformer.state_dict()

    everything = list(iter_weights(transformer, adapter_only=False))
    assert [name for name, _ in everything] == list(state)
    assert all(torch.equal(tensor, state[name]) for name, tensor in everything)

    lora_params = [
        name for name, _ in transformer.named_parameters() if ".lora_A." in name or ".lora_B." in name
    ]
    adapters = list(iter_weights(transformer, adapter_only=True))
    assert [name for name, _ in adapters] == lora_params
    assert all(torch.equal(tensor, state[name]) for name, tensor in adapters)
    assert all(not tensor.requires_grad for _, tensor in adapters)

    old = [name for name, _ in iter_weights(transformer, adapter_only=True, adapter_name="old")]
    assert old == [name for name in lora_params if ".old." in name]
    with pytest.raises(ValueError, match="'ema' is not one of"):
        list(iter_weights(transformer, adapter_only=True, adapter_name="ema"))
    with pytest.raises(ValueError, match="has none"):
        list(iter_weights(_transformer(tiny_model("sd3"), lora=False), adapter_only=True))


def test_export_full_of_a_model_with_non_persistent_buffers(tiny_model, tmp_path):
    """Wan's rotary tables are non-persistent buffers (in no state dict): the export still loads and matches."""
    adapter = load_model(tiny_model("wan"), dtype="float32")
    transformer = adapter.transformer
    assert {"rope.freqs_cos", "rope.freqs_sin"} <= {n for n, _ in transformer.named_buffers()} - set(
        transformer.state_dict()
    )
    torch.manual_seed(0)
    transformer.add_adapter(
        LoraConfig(r=2, lora_alpha=4, target_modules=list(adapter.default_lora_target_modules)),
        adapter_name="default",
    )
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.2)
    merged = type(transformer).from_pretrained(export_full(transformer, tmp_path / "wan", merge=True))

    cfg = transformer.config
    g = torch.Generator().manual_seed(0)
    inputs = (
        torch.randn(1, cfg.in_channels, 2, 8, 8, generator=g),
        torch.tensor([500.0]),
        torch.randn(1, 5, cfg.text_dim, generator=g),
    )
    with torch.no_grad():
        expected = transformer(*inputs, return_dict=False)[0]
        torch.testing.assert_close(merged(*inputs, return_dict=False)[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILY_BUILDERS))
def test_every_trained_lora_module_binds_in_the_familys_own_pipeline(tiny_model, tmp_path, family):
    """For each family with a tiny model: the LoRA the engine injects (the family's default target
    modules), exported, then loaded by the family's diffusers pipeline (`from_pretrained` +
    `load_lora_weights`, no diffrl in between) binds every trained module with its values; a
    module diffusers leaves unbound (its key format not recognised, a name conversion that skips
    it) fails here, naming it."""
    from diffusers import DiffusionPipeline

    from diffrl.config.sections.model import LoraConfig as DiffrlLora
    from diffrl.models.experts import load_lora_kwargs, trained_components
    from diffrl.models.lora_check import check_adapter_tensors
    from diffrl.train.export import adapter_key_predicate, lora_adapter_names
    from diffrl.train.lora import inject_lora

    tiny = tiny_model(family)
    adapter = load_model(tiny, dtype="float32")
    inject_lora(adapter, DiffrlLora(rank=2, alpha=4), ["default"], seed=0)
    trained_model = adapter.transformer
    with torch.no_grad():  # B = 0 would let an unbound module pass the value comparison
        for name, param in trained_model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.2)
    is_trained = adapter_key_predicate(trained_model, "default")
    trained = {k: v for k, v in trained_model.state_dict().items() if is_trained(k)}
    assert trained and {n for n, p in trained_model.named_parameters() if p.requires_grad} == set(trained)
    out = export_lora(trained_model, tmp_path / "lora", pipeline_class=adapter.lora_file_class)

    # the family's `loaded_components`: the edit families' processor without torchvision's video part
    extra = type(adapter).loaded_components(tiny)
    pipe = DiffusionPipeline.from_pretrained(tiny, dtype=torch.float32, local_files_only=True, **extra)
    assert type(pipe) is type(adapter.pipe)
    # one file per trained component (Wan2.2 A14B: one per expert, the second loaded into transformer_2)
    loaded = {}
    for component, _ in trained_components(adapter.transformer):
        if hasattr(pipe, "load_lora_weights"):
            pipe.load_lora_weights(out, **load_lora_kwargs(component))
        else:  # no LoRA mixin (HunyuanVideo15Pipeline): the transformer's own loader
            pipe.transformer.load_lora_adapter(out, prefix="transformer", **load_lora_kwargs(component))
        module = getattr(pipe, component)
        (loaded_name,) = lora_adapter_names(module)
        is_loaded = adapter_key_predicate(module, loaded_name)
        prefix = (
            ""
            if component == "transformer" and len(trained_components(adapter.transformer)) == 1
            else f"{component}."
        )
        loaded |= {
            prefix + k.replace(f".{loaded_name}.", ".default."): v
            for k, v in module.state_dict().items()
            if is_loaded(k)
        }
    shapes = lambda state: {k: tuple(v.shape) for k, v in state.items()}  # noqa: E731
    check_adapter_tensors(
        f"{family}: {type(pipe).__name__}.load_lora_weights",
        shapes(trained),
        shapes(loaded),
        differing=[k for k, v in trained.items() if k in loaded and not torch.equal(loaded[k], v)],
        side="the pipeline's transformer",
    )
    layer = next(m for m in pipe.transformer.modules() if getattr(m, "scaling", None))
    assert layer.scaling[loaded_name] == 4 / 2  # alpha / rank: the file's metadata was read
