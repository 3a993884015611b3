"""family_presets / check_families (GPU benchmarks) on CPU: the edit families' presets get a
generated prompt file whose rows carry condition images that diffrl's loader and the family's
rules accept; text-to-image families keep the built-in prompts."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import check_families
import family_presets as fp

EDIT_PRESETS = {"flux_kontext": "flux_kontext_lora", "qwen_image_edit": "qwen_image_edit_lora"}
PIPELINES = {"flux_kontext": "FluxKontextPipeline", "qwen_image_edit": "QwenImageEditPipeline"}


def _model_dir(path: Path, pipeline_class: str) -> Path:
    """A model directory as far as `edits_images` reads it: its model_index.json."""
    path.mkdir()
    (path / "model_index.json").write_text(json.dumps({"_class_name": pipeline_class}))
    return path


@pytest.mark.parametrize("family", sorted(EDIT_PRESETS))
def test_edit_families_run_their_presets(family):
    import random_pipelines

    preset = EDIT_PRESETS[family]
    assert fp.FAMILIES[family] == (family, (preset,))
    assert check_families.PRESETS[family] == preset
    assert family in random_pipelines.FAMILIES
    # Each preset's batch splits over its GPUs: one GPU's share is 2 prompts.
    overrides = fp.one_gpu_overrides(preset, global_batch=False)
    assert "data.prompts_per_step=2" in overrides


#: The 2026 families (issue 49) and their LoRA presets; FLUX.2 [klein] 4B and 9B share one.
NEW_FAMILY_PRESETS = {
    "flux2_klein_4b": "flux2_klein_lora",
    "flux2_klein_9b": "flux2_klein_lora",
    "flux2_dev": "flux2_dev_lora",
    "zimage_turbo": "zimage_turbo_lora",
    "qwen_image21": "qwen_image21_lora",
}


@pytest.mark.parametrize("family", sorted(NEW_FAMILY_PRESETS))
def test_2026_families_run_their_presets_on_full_size_pipelines(family):
    import random_pipelines

    preset = NEW_FAMILY_PRESETS[family]
    assert fp.FAMILIES[family] == (family, (preset,))
    assert family in random_pipelines.FAMILIES and family in random_pipelines.TEXT_ENCODERS
    # `diffrl check` on the GPU runs each one's preset, but FLUX.2 [dev] (113 GB) not on a 64 GB disk
    assert check_families.PRESETS.get(family) == (None if family == "flux2_dev" else preset)
    # 8-GPU presets: one GPU's share is 2 prompts (x 16 samples) and a 16-sample mini-batch
    overrides = fp.one_gpu_overrides(preset, global_batch=False)
    assert {"data.prompts_per_step=2", "actor.mini_batch_size=16"} <= set(overrides)


@pytest.mark.parametrize("family", sorted(EDIT_PRESETS))
def test_edit_presets_read_generated_rows_with_condition_images(family, tmp_path):
    from diffrl.config.loader import load_config
    from diffrl.controller.preflight import condition_rows
    from diffrl.data import load_prompts
    from diffrl.models import adapter_class
    from diffrl.models.conditions import check_condition_rows

    preset, model = EDIT_PRESETS[family], _model_dir(tmp_path / "model", PIPELINES[family])
    # The run's overrides, as the benchmarks pass them: one GPU's batch (8 would not split over the
    # preset's own 8 GPUs) and a CPU smoke run's size.
    run = [*fp.one_gpu_overrides(preset, False), "rollout.n=4", "actor.mini_batch_size=8"]
    run += ["rollout.pipeline.height=64", "rollout.pipeline.width=96"]
    prompts = fp.prompts_for(model, preset, tmp_path / "run", run)
    assert prompts == str(tmp_path / "run" / "edit_prompts" / "96x64" / "prompts.jsonl")
    assert fp.prompts_for(model, preset, tmp_path / "run", run) == prompts  # written once

    records = load_prompts([prompts], image_key="image")
    assert len(records) == fp.EDIT_ROWS
    assert all([(i.width, i.height) for i in r.images] == [(96, 64)] for r in records)
    assert len({r.images[0].key for r in records}) == fp.EDIT_ROWS  # one picture per row
    rule = adapter_class(PIPELINES[family]).condition_rule
    check_condition_rows(rule, condition_rows(records), "data.train_files", "image")

    cfg = load_config(
        preset, [f"model.path={model}", *fp.one_gpu_overrides(preset, False, prompt_file=prompts)]
    )
    assert list(cfg.data.train_files) == [prompts]
    # At the preset's own resolution (512²), as a GPU run writes them.
    default = fp.prompts_for(model, preset, tmp_path / "run")
    assert load_prompts([default], image_key="image")[0].images[0].width == 512


def test_text_to_image_models_keep_the_builtin_prompts(tmp_path):
    model = _model_dir(tmp_path / "model", "FluxPipeline")
    assert fp.prompts_for(model, "flux_dev_lora", tmp_path / "run") == fp.PROMPTS
    assert not (tmp_path / "run").exists()
