"""What a run keeps of itself (issue 33, defects 5 and 6): the console output in RUN/console.log,
wall time, images/s and peak memory in summary.json, the end-of-run result printed once, and
every config a resumed run has used, with a warning naming the keys a resume changed.

One tiny run of the default job on the shipped toy model (1 step of 2 prompts x 2 samples,
validation on 6 held-out prompts before and after), then a resume with other settings.
"""

from __future__ import annotations

import contextlib
import io
import json
import resource
import time

import pytest
import yaml

from diffrl.config import load_config
from diffrl.controller import loop as loop_module
from diffrl.controller.run import train

ROWS = 6


def _run(root, overrides):
    printed = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(printed):
        run_dir = train("default", [*BASE(root), *overrides])
    return run_dir, printed.getvalue(), time.perf_counter() - started


def BASE(root):
    return [
        "trainer.total_steps=1",
        "trainer.save_freq=1",
        "trainer.test_freq=1",
        f"data.val_files=[{root / 'val.jsonl'}]",
        "data.prompts_per_step=2",
        "rollout.n=2",
        "actor.mini_batch_size=4",
        "actor.micro_batch_size=4",
        "trainer.loggers=[console,jsonl]",
        f"trainer.output_dir={root}",
        "trainer.run_name=run",
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(run dir, first start's output, its wall time, resumed start's output)."""
    from diffrl.toy.grammar import builtin_path

    root = tmp_path_factory.mktemp("records")
    rows = builtin_path("heldout", balanced=True).read_text().splitlines()[:ROWS]
    (root / "val.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.MonkeyPatch.context() as patch:  # a step "longer" than 0.2 s gets progress lines
        patch.setattr(loop_module, "LONG_STEP_S", 0.2)
        run_dir, first, wall = _run(root, [])
    summary = json.loads((run_dir / "summary.json").read_text())
    log_after_first = (run_dir / "console.log").read_text()
    _, second, _ = _run(root, ["trainer.total_steps=2", "actor.optim.lr=1e-2"])
    return run_dir, first, wall, summary, log_after_first, second


def test_the_console_output_is_saved_in_the_run_folder(runs):
    run_dir, first, _, _, log_after_first, second = runs
    for line in first.splitlines():
        assert line in log_after_first, line
    assert first.splitlines()[0].startswith("run directory:")
    # a resume appends: both starts are in the log
    log = (run_dir / "console.log").read_text()
    assert log.startswith(log_after_first) and second.splitlines()[0] in log


def test_summary_records_wall_time_images_per_second_and_peak_memory(runs):
    _, _, wall, summary, _, _ = runs
    assert summary["images"] == 2 * 2  # data.prompts_per_step x rollout.n, one step
    assert 0 < summary["wall_s"] < wall
    assert summary["images_per_s"] == pytest.approx(summary["images"] / summary["wall_s"], rel=1e-3)
    # in-process worker: its peak resident memory is this process's, which the OS reports in KiB
    peak_now_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    assert 0.05 < summary["peak_rss_gb"] <= peak_now_gb + 1e-3


def test_the_end_of_run_result_is_printed_once(runs):
    _, first, _, _, _, _ = runs
    after_training = first[first.index("step 1/1") :].split("\n", 1)[1]
    assert after_training.count("val/accuracy") == 1, after_training  # the table's mean row
    assert after_training.count("held-out accuracy per category") == 1, after_training
    assert after_training.count("val/rewards/mean") == 0, after_training


def test_a_resume_with_other_settings_keeps_every_config_and_warns_about_the_changes(runs):
    run_dir, _, _, _, _, second = runs
    warning = next(line for line in second.splitlines() if line.startswith("warning: this start"))
    assert "actor.optim.lr: 0.0004 -> 0.01" in warning, warning
    assert "trainer.total_steps: 1 -> 2" in warning, warning
    assert str(run_dir / "configs") in warning
    first = yaml.safe_load((run_dir / "configs" / "step_00000000.yaml").read_text())
    resumed = yaml.safe_load((run_dir / "configs" / "step_00000001.yaml").read_text())
    assert first["actor"]["optim"]["lr"] == load_config("default").actor.optim.lr == 4e-4
    assert resumed["actor"]["optim"]["lr"] == 1e-2
    assert yaml.safe_load((run_dir / "config.yaml").read_text()) == resumed


def test_runs_latest_links_to_the_run_started_last(runs):
    """Issue 33, defect 10: the README's run names did not exist; `runs/latest` does."""
    run_dir, _, _, _, _, _ = runs
    link = run_dir.parent / "latest"
    assert link.is_symlink() and link.resolve() == run_dir.resolve()
    assert (link / "export" / "pytorch_lora_weights.safetensors").is_file()


def test_a_long_training_step_prints_progress_lines(runs):
    """Issue 33, defect 7: a step of up to a minute showed nothing until it ended."""
    _, first, _, _, _, _ = runs
    lines = first.splitlines()
    heartbeat = [line for line in lines if line.startswith("step 1: ")]
    assert any("elapsed" in line for line in heartbeat) and heartbeat[-1].startswith("step 1: done in"), lines
    assert lines.index(heartbeat[-1]) < next(i for i, line in enumerate(lines) if line.startswith("step 1/1"))


def _tree(folder):
    """Every file under `folder` with its bytes: what a refused start must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("resume", ["auto", "off"])
def test_a_start_over_a_run_whose_checkpoints_are_gone_is_refused_and_keeps_its_records(
    runs, tmp_path, resume
):
    """A run folder with a history (config.yaml, metrics.jsonl, configs/) but no checkpoint left:
    starting it from step 0 again would truncate its metrics and overwrite configs/step_00000000.yaml,
    the only record of its first settings. The start is refused, naming the folder, and changes nothing.
    (total_steps=5: a run that had not finished; a finished one is reported as such and left alone.)"""
    import shutil

    from diffrl.config import ConfigError

    run_dir = tmp_path / "run"
    shutil.copytree(runs[0], run_dir, symlinks=True)
    shutil.copy(runs[0].parent / "val.jsonl", tmp_path)
    shutil.rmtree(run_dir / "checkpoints")
    before = _tree(run_dir)
    assert "metrics.jsonl" in before and "configs/step_00000000.yaml" in before
    with pytest.raises(ConfigError, match="no checkpoint to resume from") as err:
        _run(tmp_path, [f"trainer.resume={resume}", "trainer.total_steps=5"])
    assert str(run_dir) in str(err.value) and "another trainer.run_name" in str(err.value)
    assert _tree(run_dir) == before
