import json
import shutil

import pytest

from diffrl.models import ADAPTERS, adapter_class, load_model, read_model_index


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model\.path='.*nope' is not a directory"):
        load_model(tmp_path / "nope")


def test_empty_path():
    with pytest.raises(ValueError, match=r"model\.path is empty"):
        load_model("")


def test_directory_without_model_index(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model_index\.json is missing"):
        load_model(tmp_path)


def test_unsupported_pipeline_class_lists_the_supported_ones(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(
        ValueError,
        match=r"StableDiffusionXLPipeline.*supported: Flux2KleinPipeline, Flux2Pipeline, FluxKontextPipeline, FluxPipeline, HunyuanVideo15Pipeline, "
        r"QwenImage21Pipeline, QwenImageEditPipeline, "
        r"QwenImageEditPlusPipeline, QwenImagePipeline",
    ):
        load_model(tmp_path)


def test_missing_component_is_named(tiny_model, tmp_path):
    copy = tmp_path / "incomplete"
    shutil.copytree(tiny_model("sd3"), copy)
    shutil.rmtree(copy / "vae")
    with pytest.raises(FileNotFoundError, match=r"lacks the component folder\(s\) vae"):
        load_model(copy)


def test_bad_dtype(tiny_model):
    with pytest.raises(ValueError, match="dtype='fp8' is not one of"):
        load_model(tiny_model("sd3"), dtype="fp8")


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_every_registered_adapter_declares_its_facts(name):
    cls = adapter_class(name)
    assert cls.pipeline_class_name == name
    assert cls.block_class_names and cls.default_lora_target_modules
    from diffrl.schedules import PIPELINE_CONVENTIONS

    assert cls.schedule_convention in PIPELINE_CONVENTIONS


def test_tiny_model_paths_build_once_into_the_cache(tmp_path, monkeypatch):
    from diffrl.models import resolve_model_path

    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path))
    first = resolve_model_path("tiny:sd3")
    assert (first / "model_index.json").is_file() and first.parent == tmp_path / "tiny"
    stamp = (first / "model_index.json").stat().st_mtime_ns
    assert resolve_model_path("tiny:sd3") == first  # cached: not rebuilt
    assert (first / "model_index.json").stat().st_mtime_ns == stamp
    assert type(load_model("tiny:sd3", dtype="float32")).__name__ == "SD3Adapter"
    with pytest.raises(ValueError, match=r"no tiny model 'sdxl'; choose tiny:sd3"):
        resolve_model_path("tiny:sdxl")


def test_a_hub_id_as_model_path_says_how_to_download_it(tmp_path, monkeypatch):
    """Issue 33, defect 13: a Hub id was refused without saying how to get a local directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        read_model_index("stabilityai/stable-diffusion-3.5-medium")
    message = str(err.value)
    assert "Hugging Face Hub id" in message
    assert (
        "hf download stabilityai/stable-diffusion-3.5-medium --local-dir models/stable-diffusion-3.5-medium"
        in message
    )
    assert "model.path=models/stable-diffusion-3.5-medium" in message
    # a path that is clearly a path is not called an id
    with pytest.raises(FileNotFoundError) as err:
        read_model_index(str(tmp_path / "nope"))
    assert "Hub id" not in str(err.value)
