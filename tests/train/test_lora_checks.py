"""No LoRA module goes missing silently in a checkpoint or an export: a save or a load that leaves a
trained module's tensors out, a load that does not bind them, an export file that lacks them and a
merge that passes over them each stop naming the module (diffrl.models.lora_check). Each test drops one module's tensors at
the step it guards (monkeypatched) and checks that nothing passes without a word."""

from __future__ import annotations

import peft.utils
import pytest
from diffusers import StableDiffusion3Pipeline
from peft import LoraConfig

import diffrl.train.checkpoint_load as checkpoint_load
import diffrl.train.checkpoint_state as checkpoint_state
from diffrl.models import load_model
from diffrl.models.lora_check import AdapterMismatchError
from diffrl.models.sd3 import SD3Adapter
from diffrl.train.checkpoint import load_checkpoint, save_checkpoint
from diffrl.train.export import export_full, export_lora

LOST = "transformer_blocks.0.attn.to_out.0"


def _transformer(tiny_model):
    transformer = load_model(tiny_model("sd3"), dtype="float32").transformer
    config = LoraConfig(r=2, lora_alpha=2, target_modules=list(SD3Adapter.default_lora_target_modules))
    transformer.add_adapter(config, adapter_name="default")
    return transformer


def _save(root, transformer):
    return save_checkpoint(
        root, 1, model=transformer, optimizer=None, scheduler=None, trainable_only=True, extra={}
    )


def _load(path, transformer):
    return load_checkpoint(
        path, model=transformer, optimizer=None, scheduler=None, trainable_only=True, restore_rng=False
    )


def _misses_lost(real):
    def predicate(module, adapter_name=None):
        keep = real(module, adapter_name)
        return lambda key: keep(key) and not key.startswith(LOST + ".")

    return predicate


def test_a_load_that_binds_no_tensor_of_a_module_stops_naming_it(tiny_model, tmp_path, monkeypatch):
    transformer = _transformer(tiny_model)
    path = _save(tmp_path, transformer)
    _load(path, transformer)  # a whole load passes
    real = checkpoint_load.set_model_state_dict

    def binds_all_but_lost(model, state, options):
        return real(model, {k: v for k, v in state.items() if not k.startswith(LOST + ".")}, options=options)

    monkeypatch.setattr(checkpoint_load, "set_model_state_dict", binds_all_but_lost)
    with pytest.raises(
        AdapterMismatchError, match=rf"missing from the model after loading, of modules {LOST}\."
    ) as err:
        _load(path, transformer)
    assert str(path) in str(err.value)
    assert sorted(err.value.missing) == [f"{LOST}.lora_A.default.weight", f"{LOST}.lora_B.default.weight"]


def test_a_checkpoint_whose_filter_misses_a_trained_module_stops_naming_it(tiny_model, tmp_path, monkeypatch):
    """A key filter that does not know a module (Qwen-Image's `to_out.0` in verl-omni#658) would
    leave it out of the save and of the load alike, so the two would agree: what trains decides."""
    transformer = _transformer(tiny_model)
    path = _save(tmp_path / "whole", transformer)
    monkeypatch.setattr(
        checkpoint_state, "adapter_key_predicate", _misses_lost(checkpoint_state.adapter_key_predicate)
    )
    for step in (lambda: _save(tmp_path / "new", transformer), lambda: _load(path, transformer)):
        with pytest.raises(
            AdapterMismatchError, match=rf"2 trained tensor\(s\) are left out .* of modules {LOST}\."
        ) as err:
            step()
        assert "LoRA state of SD3Transformer2DModel" in str(err.value)
    assert not (tmp_path / "new").exists() or not any((tmp_path / "new").glob("step_*"))


def test_an_export_whose_file_lacks_a_module_stops_naming_it(tiny_model, tmp_path, monkeypatch):
    transformer = _transformer(tiny_model)
    export_lora(transformer, tmp_path / "whole", pipeline_class=StableDiffusion3Pipeline)  # passes
    real = peft.utils.get_peft_model_state_dict

    def drops_lost(model, *args, **kwargs):
        return {k: v for k, v in real(model, *args, **kwargs).items() if not k.startswith(LOST + ".")}

    monkeypatch.setattr(peft.utils, "get_peft_model_state_dict", drops_lost)
    with pytest.raises(
        AdapterMismatchError, match=rf"missing from the exported file, of modules transformer\.{LOST}\."
    ) as err:
        export_lora(transformer, tmp_path / "lossy", pipeline_class=StableDiffusion3Pipeline)
    assert "pytorch_lora_weights.safetensors" in str(err.value)
    assert sorted(err.value.missing) == [
        f"transformer.{LOST}.lora_A.weight",
        f"transformer.{LOST}.lora_B.weight",
    ]


def test_an_export_file_with_a_tensor_of_another_shape_stops_naming_it(tiny_model, tmp_path, monkeypatch):
    transformer = _transformer(tiny_model)
    real = peft.utils.get_peft_model_state_dict

    def reshapes_lost(model, *args, **kwargs):
        state = real(model, *args, **kwargs)
        return {k: (v[:1].clone() if k.startswith(LOST + ".lora_A") else v) for k, v in state.items()}

    monkeypatch.setattr(peft.utils, "get_peft_model_state_dict", reshapes_lost)
    with pytest.raises(
        AdapterMismatchError,
        match=rf"1 tensor\(s\) of another shape, of modules transformer\.{LOST} \(trained \[2, ",
    ) as err:
        export_lora(transformer, tmp_path / "lossy", pipeline_class=StableDiffusion3Pipeline)
    assert err.value.differing == [f"transformer.{LOST}.lora_A.weight"]


def test_a_merged_export_whose_merge_passes_over_a_module_stops_naming_it(tiny_model, tmp_path, monkeypatch):
    from diffusers.loaders.peft import PeftAdapterMixin

    transformer = _transformer(tiny_model)
    export_full(transformer, tmp_path / "whole", merge=True)  # passes
    real = PeftAdapterMixin.fuse_lora

    def fuse_all_but_lost(self, *args, **kwargs):
        lost = self.get_submodule(LOST)
        lost.merge = lambda safe_merge=False, adapter_names=None: None  # this layer's merge does nothing
        try:
            return real(self, *args, **kwargs)
        finally:
            del lost.merge

    monkeypatch.setattr(PeftAdapterMixin, "fuse_lora", fuse_all_but_lost)
    with pytest.raises(
        AdapterMismatchError, match=rf"missing from the merged weights, of modules {LOST}\."
    ) as err:
        export_full(transformer, tmp_path / "lossy", merge=True)
    assert sorted(err.value.missing) == [f"{LOST}.lora_A.default.weight", f"{LOST}.lora_B.default.weight"]
    assert not (tmp_path / "lossy").exists()
