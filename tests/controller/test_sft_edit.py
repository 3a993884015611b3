"""`diffrl sft` of an image-edit model on CPU: the shapes edit task's toy model (pixel-space FLUX.1
Kontext), each image with its condition image, rendered afresh every step."""

import json
import math
import shlex

import numpy as np
import pytest
from PIL import Image

from diffrl.cli import main
from diffrl.controller.sft import sft
from diffrl.data.images import load_image_rows
from diffrl.seeding import SFT_STREAM, derive_seed
from diffrl.telemetry import read_metrics
from diffrl.toy import SHAPES_EDIT
from diffrl.toy.edit import EditExample, builtin_edit_path, draw_example, render_example, write_edit_file
from diffrl.toy.edit_verify import verify_edit

ROWS = [json.loads(line)["edit"] for line in builtin_edit_path("train").read_text().splitlines()][::40]


def test_rendered_rows_are_the_target_then_the_source_of_a_fresh_layout():
    seeds = [derive_seed(SFT_STREAM, 42, 3, i, 1) for i in range(len(ROWS))]
    pairs = load_image_rows(SHAPES_EDIT, ROWS, 32, 32, seeds)
    assert pairs.shape == (len(ROWS), 2, 32, 32, 3) and pairs.dtype == np.uint8
    for row, seed, (target, source) in zip(ROWS, seeds, pairs, strict=True):
        example = draw_example(EditExample.from_dict(row).edit, 32, np.random.default_rng(seed))
        assert example.edit == EditExample.from_dict(row).edit
        want_source, want_target = render_example(example, 32)
        assert np.array_equal(source, want_source) and np.array_equal(target, want_target)
        assert verify_edit(target, example).correct and verify_edit(source, example).score == 0.0
    # a fresh layout, not the row's own
    row_target = render_example(EditExample.from_dict(ROWS[0]), 32)[1]
    assert not np.array_equal(pairs[0, 0], row_target)


def _overrides(tmp_path) -> list[str]:
    val = write_edit_file(tmp_path / "val" / "val.jsonl", "heldout", 1)  # one row per kind
    return [
        f"trainer.output_dir={tmp_path / 'runs'}",
        "trainer.run_name=edit",
        "trainer.total_steps=2",
        "trainer.test_freq=2",
        "trainer.save_freq=2",
        "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]",
        "data.prompts_per_step=4",
        "actor.mini_batch_size=4",
        "actor.micro_batch_size=4",
        "rollout.micro_batch_size=5",
        "rollout.pipeline.num_inference_steps=2",
        f"data.val_files=[{val}]",
    ]


def test_shapes_edit_sft_trains_the_edit_model_and_exports_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    run_dir = sft("shapes_edit_sft", _overrides(tmp_path))
    metrics = read_metrics(run_dir / "metrics.jsonl")
    losses = [metrics[s]["actor/loss"] for s in range(1, 3)]
    assert all(math.isfinite(x) for x in losses)
    for kind in ("recolor", "reshape", "add", "remove", "move"):
        assert 0.0 <= metrics[2][f"val/{kind}/accuracy"] <= 1.0  # the shapes_edit verifier, per kind
    index = json.loads((run_dir / "model" / "model_index.json").read_text())
    assert index["_class_name"] == "FluxKontextPipeline" and index["vae"] == [None, None]
    # the printed `diffrl sample` command edits a training row's source image, and works as printed
    printed = [line for line in capsys.readouterr().out.splitlines() if "diffrl sample " in line]
    argv = shlex.split(printed[0][printed[0].index("diffrl sample ") :])[1:]
    assert "--image" in argv
    assert main(argv) == 0, capsys.readouterr().err
    samples = sorted((run_dir / "samples").glob("*.png"))
    assert samples and Image.open(samples[0]).size == (32, 32)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.path=tiny:toy"], "takes no condition image: use an edit model"),
        (["sft.images=shapes"], "sft.images=shapes renders scenes without one"),
        (["rollout.pipeline.width=64"], "set rollout.pipeline.height = width"),
        (["data.train_files=[builtin:edit_shapes.jsonl]"], "needs an 'edit' column"),
    ],
)
def test_wrong_setups_fail_before_starting(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=message):
        sft("shapes_edit_sft", [*_overrides(tmp_path), *overrides])
    assert not (tmp_path / "runs").exists()
