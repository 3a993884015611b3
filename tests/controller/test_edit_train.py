"""Image-edit training end to end on CPU: the tiny edit presets (`tiny_flux_kontext`,
`tiny_qwen_image_edit`, and Qwen-Image-Edit-Plus through the latter) run two steps of `diffrl train`
on the built-in edit dataset (condition images from the prompt rows), after the start-up check (ODE
sampler = the family's pipeline with the same images; sampled log-probs = the trainer's); bad
condition images fail before any model loads, naming the row and the fix."""

from __future__ import annotations

import json
import math
import re

import pytest
from edit_images import condition_image

from diffrl.cli import main
from diffrl.controller.check import check
from diffrl.controller.run import train
from diffrl.telemetry import read_metrics

SMALL = ["trainer.total_steps=2", "trainer.save_freq=2", "trainer.test_freq=2"]


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [
        ("tiny_flux_kontext", []),
        ("tiny_qwen_image_edit", []),
        ("tiny_qwen_image_edit", ["model.path=tiny:qwen_image_edit_plus"]),
        # DiffusionNFT trains on the clean samples with the conditional velocity: the condition stays
        ("tiny_flux_kontext", ["algorithm.trainer_type=direct_preference", "actor.loss.mode=diffusion_nft"]),
    ],
    ids=["flux_kontext", "qwen_image_edit", "qwen_image_edit_plus", "flux_kontext_nft"],
)
def test_a_tiny_edit_preset_trains_two_steps_end_to_end(preset, overrides, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    run_dir = train(preset, [*SMALL, *overrides, f"trainer.output_dir={tmp_path}", "trainer.run_name=edit"])
    out = capsys.readouterr().out
    # the start-up check passed: sampler = pipeline (with the images), log-probs = trainer
    assert re.search(r"setup check \(diffrl check --quick\): \d+ checks passed", out), out
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert set(metrics) == {0, 1, 2}
    for step in (1, 2):
        for key in ("rewards/mean", "actor/loss", "actor/grad_norm"):
            assert math.isfinite(metrics[step][key]), (step, key)
        assert metrics[step]["actor/grad_norm"] > 0
    assert "val/rewards/mean" in metrics[0] and "val/rewards/mean" in metrics[2]
    assert (run_dir / "export" / "pytorch_lora_weights.safetensors").is_file()
    assert "--image IMAGE" in out  # the printed sample command asks for the image to edit


def test_phase_flops_count_the_condition_tokens(tiny_model):
    from diffrl.config import load_config
    from diffrl.models import load_model
    from diffrl.telemetry.perf import phase_flops

    adapter = load_model(tiny_model("flux_kontext"), dtype="float32")
    cfg = load_config("tiny_flux_kontext", [])
    common = dict(images=4, window=1, text_len=32, recompute_old=False, trains_base_weights=False)
    with_condition = phase_flops(adapter, cfg, cond_tokens=64 * 64, **common)
    text_only = phase_flops(adapter, cfg, **common)
    pipe = cfg.rollout.pipeline
    forward = adapter.flops_per_forward(4, pipe.height, pipe.width, 32, cond_tokens=64 * 64)
    assert with_condition["gen"] == forward * pipe.num_inference_steps > 10 * text_only["gen"]


def test_the_check_passes_with_kontexts_true_cfg():
    report = check(
        "tiny_flux_kontext",
        ["rollout.pipeline.true_cfg_scale=4.0", "rollout.pipeline.negative_prompt=blurry"],
        quick=True,
    )
    assert report.exit_code == 0, report.table()
    assert "passes/sample [2] vs [2]" in report.row("guidance / true CFG").measured


def _rows_file(tmp_path, rows):
    path = tmp_path / "edit.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("model", "rows", "expected"),
    [
        # no image in a row
        (
            "tiny:flux_kontext",
            [{"prompt": "make it red"}],
            r"edit\.jsonl:1: the row has 0 condition image.*exactly 1",
        ),
        # two images where the family takes one
        (
            "tiny:qwen_image_edit",
            [{"prompt": "make it red", "image": ["a.png", "a.png"]}],
            r"edit\.jsonl:1: the row has 2 condition image.*QwenImageEditPipeline takes exactly 1",
        ),
        # four where Qwen-Image-Edit-Plus takes one to three
        (
            "tiny:qwen_image_edit_plus",
            [{"prompt": "make it red", "image": ["a.png"] * 4}],
            r"has 4 condition image.*1 to 3",
        ),
        # a missing file
        (
            "tiny:flux_kontext",
            [{"prompt": "x", "image": "nope.png"}],
            r"edit\.jsonl:1: condition image 'nope\.png' not found",
        ),
        # rows of different aspect ratios: different condition sizes cannot share a batch
        (
            "tiny:flux_kontext",
            [{"prompt": "x", "image": "a.png"}, {"prompt": "y", "image": "tall.png"}],
            r"edit\.jsonl:2: FluxKontextPipeline encodes .* at 880x1184 pixels, but .*edit\.jsonl:1's at 1184x880",
        ),
        # beyond Kontext's trained aspect ratios
        ("tiny:flux_kontext", [{"prompt": "x", "image": "wide.png"}], r"aspect ratio 4:1.*at most 2\.33:1"),
    ],
    ids=["missing_image", "two_for_one", "four_for_three", "missing_file", "mixed_sizes", "too_wide"],
)
def test_bad_condition_images_fail_before_any_model_loads(model, rows, expected, tmp_path, monkeypatch):
    condition_image(1).save(tmp_path / "a.png")
    condition_image(2, width=48, height=64).save(tmp_path / "tall.png")
    condition_image(3, width=128, height=32).save(tmp_path / "wide.png")
    data = _rows_file(tmp_path, rows)
    loads = []
    monkeypatch.setattr("diffrl.models.base.ModelAdapter.from_pretrained", lambda *a, **k: loads.append(a))
    preset = "tiny_qwen_image_edit" if "qwen" in model else "tiny_flux_kontext"
    with pytest.raises((ValueError, FileNotFoundError), match=expected):
        train(preset, [f"model.path={model}", f"data.train_files=[{data}]", f"trainer.output_dir={tmp_path}"])
    assert not loads


def test_a_text_to_image_model_reads_no_condition_images(tmp_path):
    """data.image_key is read for edit models only: for others the column stays metadata."""
    from diffrl.config import load_config
    from diffrl.controller.preflight import preflight_common

    condition_image(1).save(tmp_path / "a.png")
    data = _rows_file(tmp_path, [{"prompt": "a red circle", "image": "a.png"}])
    cfg = load_config("tiny_sd3", [f"data.train_files=[{data}]", "data.val_files=[]"])
    (record,), _ = preflight_common(cfg)
    assert record.images == () and record.metadata["image"] == "a.png"


def test_diffrl_sample_edits_the_image_given_with_image(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    condition_image(1).save(tmp_path / "source.png")
    base = ["sample", "--model", "tiny:flux_kontext", "--prompt", "make it red", "--steps", "2"]
    size = ["--height", "32", "--width", "32"]
    assert main([*base, *size, "--image", str(tmp_path / "source.png"), "--out", str(tmp_path / "out")]) == 0
    (row,) = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert row["images"] == [str(tmp_path / "source.png")] and (tmp_path / "out" / row["file"]).is_file()
    capsys.readouterr()
    assert main([*base, *size, "--out", str(tmp_path / "none")]) == 2
    assert "edits images: give the image to edit with --image PATH" in capsys.readouterr().err
    text_only = [
        "sample",
        "--model",
        "tiny:sd3",
        "--prompt",
        "a cat",
        "--image",
        str(tmp_path / "source.png"),
    ]
    assert main([*text_only, "--out", str(tmp_path / "sd3")]) == 2
    assert "takes no condition image" in capsys.readouterr().err


def test_a_kontext_run_trains_on_edit_preservation(tmp_path, monkeypatch):
    """Issue 35 item 3: the source images reach the rewards through the run's own paths (the
    rollout's reward workers, validation): two steps of tiny_flux_kontext with edit_preservation
    as the reward, with a reward that reads no sources beside it. (The start-up check, whose
    reward rows get the sources too, is the next test's: it would double this one's time.)"""
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    rewards = [
        "reward.functions.jpeg_compressibility.weight=0.01",
        "reward.functions.edit_preservation.weight=1",
        "reward.functions.edit_preservation.args.threshold=48",
    ]
    fast = ["trainer.check_at_start=false", "trainer.save_freq=100"]  # no checkpoint or export either
    run_dir = train(
        "tiny_flux_kontext", [*SMALL, *rewards, *fast, f"trainer.output_dir={tmp_path}", "trainer.run_name=k"]
    )
    metrics = read_metrics(run_dir / "metrics.jsonl")
    for step in (1, 2):
        kept = metrics[step]["rewards/edit_preservation/mean"]
        assert 0.0 <= kept <= 1.0 and math.isfinite(
            metrics[step]["rewards/edit_preservation/kept_fraction_mean"]
        )
        assert math.isfinite(metrics[step]["rewards/jpeg_compressibility/mean"])
        assert metrics[step]["rewards/edit_preservation/failed_batches"] == 0
        assert metrics[step]["actor/grad_norm"] > 0
    for step in (0, 2):  # validation scores the sources too
        assert 0.0 <= metrics[step]["val/rewards/edit_preservation/mean"] <= 1.0


def test_the_checks_reward_rows_give_each_sample_its_prompts_source(tmp_path):
    """`diffrl check`'s reward rows score the ODE samples with each sample's condition images, as
    the run's reward workers do (a rollout stand-in: two prompts, two samples each)."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from diffrl.config import load_config
    from diffrl.controller.check_resources import reward_rows
    from diffrl.data.images import read_condition_image

    cfg = load_config("tiny_flux_kontext", ["reward.functions.edit_preservation.weight=1"])
    images = []
    for seed in (1, 2):
        condition_image(seed, 32, 32).save(tmp_path / f"{seed}.png")
        images.append((read_condition_image(f"{seed}.png", tmp_path, "edit.jsonl:1", "image"),))
    pixels = torch.stack(
        [torch.from_numpy(np.array(condition_image(s, 32, 32))).permute(2, 0, 1) for s in (1, 1, 2, 3)]
    )
    rollout = SimpleNamespace(
        samples=SimpleNamespace(pixels=pixels, prompt_index_B=torch.tensor([0, 0, 1, 1])),
        sample_prompts=lambda: ["make it red"] * 4,
        sample_metadata=lambda: [{}] * 4,
    )
    rows = {row.check: row for row in reward_rows(cfg, rollout, images)}
    assert not rows["reward edit_preservation"].failed and not rows["reward jpeg_compressibility"].failed
    # without the images (a caller that forgot them) the row fails with the reward's own message
    rows = {row.check: row for row in reward_rows(cfg, rollout)}
    assert (
        rows["reward edit_preservation"].failed
        and "this batch has none" in rows["reward edit_preservation"].note
    )


def test_a_reward_that_needs_sources_with_a_text_to_image_model_fails_before_any_model_loads(
    tmp_path, monkeypatch
):
    loads = []
    monkeypatch.setattr("diffrl.models.base.ModelAdapter.from_pretrained", lambda *a, **k: loads.append(a))
    with pytest.raises(
        ValueError,
        match=r"reward.functions.edit_preservation scores each result against its source image.*takes no condition images.*reward.functions.edit_preservation=null",
    ):
        train("tiny_sd3", ["reward.functions.edit_preservation.weight=1", f"trainer.output_dir={tmp_path}"])
    assert not loads
