"""`diffrl sample` as a new user meets it (issue 55): progress where its output is no terminal, the
`--image` messages worded for the flag (not for a prompt file's rows), and `--out .` / `--out dir/`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from PIL import Image

import diffrl.rollout.generate as generate_module
from diffrl.cli import main
from diffrl.rollout.line_progress import LineProgress

TOY = ["sample", "--model", "toy:shapes", "--prompt", "a red circle"]


# ------------------------------------------------------------------------------ progress
def test_sample_prints_progress_lines_where_its_output_is_no_terminal(tmp_path, capsys):
    """capsys's stdout is no terminal, as a log file or a pipe: rich's live bar drew nothing there."""
    assert main([*TOY, "-n", "2", "--steps", "2", "--out", str(tmp_path / "s")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "loading toy:shapes on cpu (float32)" in lines, lines
    assert "sampling 2 samples x 2 steps: started" in lines, lines
    assert any(line.startswith("sampling 2 samples x 2 steps: 100% after ") for line in lines), lines
    assert lines.index("sampling 2 samples x 2 steps: started") < len(lines) - 2  # before the files line


def test_line_progress_prints_at_most_one_line_per_interval_with_the_time_left():
    """The sampler's calls (2 samples x 4 steps, one advance of 2 per step) on a clock of 10 s a step."""
    printed, now = [], [0.0]
    progress = LineProgress(2, 4, every_s=15.0, clock=lambda: now[0])
    progress.print = printed.append
    with progress() as bar:
        task = bar.add_task("sampling step 0", total=8)
        for _ in range(4):
            now[0] += 10.0
            bar.advance(task, 2)
    assert printed == [
        "sampling 2 samples x 4 steps: started",
        "sampling 2 samples x 4 steps: 50% after 20 s, about 20 s left",  # 10 s < 15 s: none at 25%
        "sampling 2 samples x 4 steps: 100% after 40 s",  # 75% came 10 s after the last line
    ]


# ------------------------------------------------------------------------------ --image
@pytest.fixture
def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model loaded: the --image problem was found too late")

    monkeypatch.setattr(generate_module, "load_model", refuse)


def _png(path: Path, size=(64, 64)) -> Path:
    Image.new("RGB", size, "red").save(path)
    return path


@pytest.mark.parametrize("case", ["missing", "not_an_image", "truncated", "folder", "two_images"])
def test_image_errors_speak_of_the_flag_not_of_prompt_rows(
    tmp_path, capsys, monkeypatch, no_model_loads, case
):
    monkeypatch.chdir(tmp_path)
    good = _png(tmp_path / "cat.png")
    (tmp_path / "notes.png").write_bytes(b"not an image at all")
    data = good.read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    (tmp_path / "pictures").mkdir()
    flags, expected = {
        "missing": (
            ["--image", "dog.png"],
            f"--image 'dog.png': no such file ({tmp_path / 'dog.png'}; a relative path is taken from the "
            "current folder): fix the path",
        ),
        "not_an_image": (
            ["--image", "notes.png"],
            f"--image 'notes.png': {tmp_path / 'notes.png'} is not an image Pillow can read",
        ),
        "truncated": (["--image", "cut.png"], f"--image 'cut.png': {tmp_path / 'cut.png'} does not decode ("),
        "folder": (["--image", "pictures"], f"--image 'pictures' is a folder ({tmp_path / 'pictures'})"),
        "two_images": (
            ["--image", "cat.png", "--image", "cat.png"],
            "2 --image flags given, and the model 'tiny:flux_kontext' (FluxKontextPipeline) takes exactly 1 "
            "condition image(s) per prompt: pass --image PATH exactly 1 time(s)",
        ),
    }[case]
    argv = ["sample", "--model", "tiny:flux_kontext", "--prompt", "make it blue", "--out", "o", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    for row_word in ("row", "prompt file", "data.image_key"):
        assert row_word not in err, err


# ------------------------------------------------------------------------------ --out
@pytest.mark.parametrize("out", [".", "samples/../here/"])
def test_out_dot_and_trailing_slashes_name_the_folder(tmp_path, capsys, monkeypatch, out):
    monkeypatch.chdir(tmp_path)
    assert main([*TOY, "--steps", "1", "--out", out]) == 0
    folder = Path(os.path.abspath(out))
    assert sorted(p.name for p in folder.iterdir() if p.is_file()) == ["000_00.png", "samples.jsonl"]
    assert f"wrote 1 file(s) and samples.jsonl to {folder}" in capsys.readouterr().out
