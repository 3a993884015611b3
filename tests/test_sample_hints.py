"""The commands diffrl prints for using a trained model work as printed, and `diffrl sample` draws
with the settings the run or the model was trained with (issue 33, defects 1, 2 and 12).

A one-step run of the default job on the shipped toy model (32x32 pixels, no T5: one text token)
writes RUN/export; the `diffrl sample` command it prints is run as printed. The reference is
independent of the defaults: the same sampler with every setting spelled out from the run's own
config.yaml (its validation sampler), which must give the same pixels.
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import stat

import numpy as np
import pytest
from PIL import Image

from diffrl.cli import main
from diffrl.config import load_config
from diffrl.controller.run import train


def _sample_command(printed: str) -> list[str]:
    """The argv of the `diffrl sample ...` command in `printed` (one per line), without `diffrl`."""
    lines = [line for line in printed.splitlines() if "diffrl sample --" in line]  # not prose naming it
    assert len(lines) == 1, printed
    command = lines[0][lines[0].index("diffrl sample --") :]
    return shlex.split(command)[1:]


def _pixels(folder) -> np.ndarray:
    files = sorted(folder.glob("*.png"))
    assert files, f"no images in {folder}"
    return np.stack([np.asarray(Image.open(f)) for f in files])


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """(run directory, what `diffrl train` printed) of one step of the default job, tiny."""
    root = tmp_path_factory.mktemp("toy_run")
    overrides = [
        "trainer.total_steps=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "data.prompts_per_step=2",
        "rollout.n=2",
        "actor.mini_batch_size=4",
        "actor.micro_batch_size=4",
        "trainer.loggers=[jsonl]",
        f"trainer.output_dir={root}",
        "trainer.run_name=run",
    ]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_dir = train("default", overrides)
    return run_dir, printed.getvalue()


def test_the_sample_command_printed_at_the_end_of_train_works_and_uses_the_runs_sampler(
    toy_run, tmp_path, monkeypatch, capsys
):
    run_dir, printed = toy_run
    monkeypatch.chdir(tmp_path)
    argv = _sample_command(printed)
    assert main(argv) == 0, capsys.readouterr().err
    printed_pixels = _pixels(tmp_path / argv[argv.index("--out") + 1])  # an absolute path stays one

    # independent reference: every setting spelled out from the run's own config
    cfg = load_config(str(run_dir / "config.yaml"), job="eval")
    pipe = cfg.rollout.pipeline
    assert (pipe.height, pipe.width, pipe.max_sequence_length) == (32, 32, 1)
    explicit = [
        "--height", str(pipe.height),
        "--width", str(pipe.width),
        "--steps", str(cfg.rollout.val.num_inference_steps or pipe.num_inference_steps),
        "--guidance-scale", str(pipe.guidance_scale),
        "--max-sequence-length", str(pipe.max_sequence_length),
    ]  # fmt: skip
    reference_out = tmp_path / "reference"
    reference = [*argv[: argv.index("--out")], "--out", str(reference_out), *explicit]
    assert main(reference) == 0
    assert printed_pixels.shape[1:3] == (32, 32)
    np.testing.assert_array_equal(printed_pixels, _pixels(reference_out))


def test_the_sample_command_printed_by_export_merge_works(toy_run, tmp_path, monkeypatch, capsys):
    run_dir, _ = toy_run
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(run_dir), "--out", "my_model", "--merge"]) == 0
    argv = _sample_command(capsys.readouterr().out)
    assert main(argv) == 0, capsys.readouterr().err
    images = _pixels(tmp_path / argv[argv.index("--out") + 1])
    assert images.shape[1:3] == (32, 32)
    # every file of the pipeline has the mode of a file written the ordinary way (defect 8)
    (tmp_path / "probe").write_text("")
    mode = stat.S_IMODE((tmp_path / "probe").stat().st_mode)
    modes = {
        str(p): stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "my_model").rglob("*") if p.is_file()
    }
    assert set(modes.values()) == {mode}, modes


def test_exported_lora_records_the_runs_validation_sampler(toy_run):
    run_dir, _ = toy_run
    settings = json.loads((run_dir / "export" / "diffrl_sampling.json").read_text())
    cfg = load_config(str(run_dir / "config.yaml"), job="eval")
    assert settings["guidance_scale"] == cfg.rollout.pipeline.guidance_scale == 1.0  # the CFG-free job
    assert settings["steps"] == cfg.rollout.val.num_inference_steps == 10
    assert settings["max_sequence_length"] == 1 and settings["prompt_grammar"] == "shapes"


def test_sample_of_the_toy_model_needs_no_size_flags(tmp_path, capsys):
    """`toy:shapes` declares its own sampler (32x32, one text token): no flag is needed."""
    out = tmp_path / "out"
    assert main(["sample", "--model", "toy:shapes", "--prompt", "a red circle", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "32x32" in printed and "text length 1" in printed, printed
    assert _pixels(out).shape[1:3] == (32, 32)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("a red circle above a blue square", "not a shapes-world prompt"),
        ("a cat holding a sign", "not a shapes-world prompt"),
    ],
)
def test_sample_of_the_toy_model_refuses_prompts_outside_the_grammar(prompt, expected, tmp_path, capsys):
    argv = ["sample", "--model", "toy:shapes", "--prompt", prompt, "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and repr(prompt) in err, err
    assert not (tmp_path / "out").exists()


def test_sample_size_that_does_not_fit_the_model_names_the_flag_and_the_nearest(tmp_path, capsys):
    argv = ["sample", "--model", "toy:shapes", "--prompt", "a red circle", "--height", "256"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--height 256" in err and "at most 32" in err, err


def test_the_exported_lora_file_has_the_mode_of_every_other_file(toy_run):
    """Issue 33, defect 8: the LoRA was written 0600 while the run's other files are 0644."""
    run_dir, _ = toy_run
    lora = run_dir / "export" / "pytorch_lora_weights.safetensors"
    reference = run_dir / "export" / "probe"
    reference.write_text("")  # a file written the ordinary way, under this process's umask
    assert stat.S_IMODE(lora.stat().st_mode) == stat.S_IMODE(reference.stat().st_mode)
    assert stat.S_IMODE(lora.stat().st_mode) == stat.S_IMODE((run_dir / "config.yaml").stat().st_mode)
    reference.unlink()


def test_the_end_of_train_offers_only_what_runs_the_toy_model(toy_run):
    """Issue 52, re-walk 1: the run printed `pipe.load_lora_weights(RUN/export)` for toy:shapes,
    which plain diffusers cannot load. The printed lines give the reason and the `diffrl sample`
    command (run as printed above), no diffusers call; and the reason holds: diffusers' own SD3
    pipeline refuses the toy model's directory (no VAE)."""
    from diffusers import StableDiffusion3Pipeline

    from diffrl.models import resolve_model_path

    _, printed = toy_run
    assert "load_lora_weights" not in printed and "from_pretrained" not in printed, printed
    assert "plain diffusers cannot run it" in printed and "without a VAE" in printed, printed
    with pytest.raises(ValueError, match="vae"):
        StableDiffusion3Pipeline.from_pretrained(str(resolve_model_path("toy:shapes")))
