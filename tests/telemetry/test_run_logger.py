import io
import json
import math
import sys

import numpy as np
import pytest
import torch

from diffrl.telemetry import RunLogger, check_loggers, read_jsonl, read_metrics
from diffrl.telemetry.sinks import ConsoleSink, format_duration

CONFIG = {"trainer": {"total_steps": 10}, "model": {"path": "tiny:sd3"}}


def make_logger(run_dir, loggers, total_steps=10):
    return RunLogger(run_dir, loggers, total_steps=total_steps, config=CONFIG, run_name="test-run")


def strict_json(line):
    """json.loads that rejects the NaN/Infinity literals Python would otherwise accept."""
    return json.loads(line, parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))


# ------------------------------------------------------------------------------ jsonl
def test_jsonl_lines_parse_match_and_are_flushed_before_close(tmp_path):
    logger = make_logger(tmp_path, ["jsonl"])
    logged = [
        {"rewards/mean": 0.25, "actor/loss": -0.002, "count": 3},
        {"rewards/mean": np.float32(0.5), "actor/loss": torch.tensor(0.125), "count": np.int64(4)},
    ]
    for step, metrics in enumerate(logged, start=1):
        logger.log(step, metrics)
    # still open: every line is already on disk and is strict JSON
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    records = [strict_json(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2]
    assert records[0] == {
        "step": 1,
        "time": records[0]["time"],
        "rewards/mean": 0.25,
        "actor/loss": -0.002,
        "count": 3.0,
    }
    assert (
        records[1]["rewards/mean"] == 0.5 and records[1]["actor/loss"] == 0.125 and records[1]["count"] == 4.0
    )
    assert abs(records[1]["time"] - records[0]["time"]) < 60
    logger.close()


def test_jsonl_non_finite_values_are_strings_read_back_as_floats(tmp_path):
    with make_logger(tmp_path, ["jsonl"]) as logger:
        logger.log(1, {"a": math.nan, "b": math.inf, "c": -math.inf, "d": 1.5})
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    record = strict_json(line)
    assert (record["a"], record["b"], record["c"], record["d"]) == ("NaN", "Infinity", "-Infinity", 1.5)
    back = read_metrics(tmp_path / "metrics.jsonl")[1]
    assert math.isnan(back["a"]) and back["b"] == math.inf and back["c"] == -math.inf and back["d"] == 1.5


def test_jsonl_resume_drops_steps_at_or_after_the_first_new_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = make_logger(tmp_path, ["jsonl"])
    for step in range(0, 6):  # steps 0..5; the run checkpointed at 2, then died after logging 5
        first.log(step, {"x": float(step)})
    with open(path, "a") as f:
        f.write('{"step": 6, "time": 1.0, "x"')  # a line cut by the crash
    del first  # no close(): a crashed process

    with make_logger(tmp_path, ["jsonl"]) as second:  # resumed from the step-2 checkpoint
        second.log(3, {"x": 30.0})
        second.log(4, {"x": 40.0})
    records = read_jsonl(path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["x"] for r in records] == [0.0, 1.0, 2.0, 30.0, 40.0]
    assert all(strict_json(line) for line in path.read_text().splitlines())


def test_read_metrics_merges_records_of_a_step_and_skips_a_torn_last_line(tmp_path):
    with make_logger(tmp_path, ["jsonl"]) as logger:
        logger.log(1, {"a": 1.0, "b": 2.0})
        logger.log(1, {"b": 3.0, "val/rewards/mean": 0.5})
        logger.log(2, {"a": 4.0})
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 3, "a":')
    merged = read_metrics(path)
    assert list(merged) == [1, 2]
    assert {k: v for k, v in merged[1].items() if k != "time"} == {
        "a": 1.0,
        "b": 3.0,
        "val/rewards/mean": 0.5,
    }
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=":2: not a metrics record"):
        read_jsonl(path)


def test_bad_metrics_are_rejected_with_the_name(tmp_path):
    with make_logger(tmp_path, ["jsonl"]) as logger:
        with pytest.raises(TypeError, match="'name'"):
            logger.log(1, {"name": "sd3"})
        with pytest.raises(ValueError, match="reserved"):
            logger.log(1, {"step": 1.0})
        with pytest.raises(ValueError, match="scalar"):
            logger.log(1, {"v": torch.ones(2)})
        with pytest.raises(ValueError, match="step"):
            logger.log(-1, {"v": 1.0})
    with pytest.raises(ValueError, match="unknown logger 'tensorbored'"):
        make_logger(tmp_path, ["tensorbored"])
    with pytest.raises(ValueError, match="unknown logger"):
        check_loggers(["console", "mlflow"])


# ------------------------------------------------------------------------------ tensorboard
def _accumulator(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


def test_tensorboard_scalars_and_image_round_trip(tmp_path):
    from PIL import Image

    image = np.random.default_rng(0).integers(0, 256, size=(6, 10, 3), dtype=np.uint8)
    with make_logger(tmp_path, ["tensorboard"]) as logger:
        logger.log(1, {"rewards/mean": 0.25, "actor/loss": -1.5})
        logger.log(2, {"rewards/mean": 0.75, "actor/loss": -0.5})
        logger.log_images(2, "val/samples", image)
    acc = _accumulator(tmp_path / "tensorboard")
    assert {"rewards/mean", "actor/loss"} <= set(acc.Tags()["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("rewards/mean")] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("actor/loss")] == [(1, -1.5), (2, -0.5)]
    (event,) = acc.Images("val/samples")
    assert (event.step, event.height, event.width) == (2, 6, 10)
    decoded = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
    np.testing.assert_array_equal(decoded, image)


def test_tensorboard_resume_hides_the_earlier_attempts_later_steps(tmp_path):
    first = make_logger(tmp_path, ["tensorboard"])
    for step in range(1, 6):
        first.log(step, {"x": float(step)})
    first.close()
    with make_logger(tmp_path, ["tensorboard"]) as second:
        second.log(3, {"x": 30.0})
        second.log(4, {"x": 40.0})
    acc = _accumulator(tmp_path / "tensorboard")
    assert [(e.step, e.value) for e in acc.Scalars("x")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


# ------------------------------------------------------------------------------ console
def test_console_line_has_step_key_values_and_eta(tmp_path, capsys):
    with make_logger(tmp_path, ["console"], total_steps=300) as logger:
        logger.log(
            12,
            {
                "rewards/mean": 0.613,
                "actor/loss": -0.002,
                "actor/kl": 0.0001,
                "actor/grad_norm": 0.41,
                "timing_s/step": 8.4,
                "throughput/images_per_s_per_gpu": 7.6,
                "perf/mfu/step": 0.312,
                "rewards/other": 5.0,
            },
        )
        line = capsys.readouterr().out.strip()
        assert line.startswith("step 12/300 | ")
        for text in (
            "rewards/mean 0.613",
            "actor/loss -0.002",
            "actor/kl 1.00e-04",
            "actor/grad_norm 0.41",
            "8.4 s/step",
            "7.6 img/s/gpu",
            "mfu 31.2%",
        ):
            assert text in line, (text, line)
        # first line: ETA from the step's own time, 8.4 s × 288 steps left
        assert line.endswith(f"ETA {format_duration(8.4 * 288)}") and "40m19s" in line
        logger.log(13, {"rewards/mean": 0.663, "actor/loss": math.nan})
        line = capsys.readouterr().out.strip()
        assert "rewards/mean 0.663 (+0.05)" in line and "actor/loss nan" in line
        assert "non-finite: actor/loss" in line
    summary = capsys.readouterr().out.strip()
    assert "run test-run done: steps 12-13" in summary
    assert "rewards/mean 0.613 (step 12) → 0.663 (step 13)" in summary


def test_console_validation_fields_match_the_logged_metrics(tmp_path, capsys):
    """The console shows `val/accuracy` as logged (the report's number) on the step's line; the
    closing line summarises the train reward only."""
    with make_logger(tmp_path, ["console"], total_steps=2) as logger:
        logger.log(1, {"rewards/mean": 0.5})
        logger.log(2, {"rewards/mean": 0.6, "val/rewards/mean": 0.45, "val/accuracy": 0.3125})
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert "val/rewards/mean 0.45" in line and "val/accuracy 0.3125" in line
    summary = capsys.readouterr().out.strip()
    # the closing line leaves validation to the end-of-run report, which states it once
    assert "rewards/mean 0.5 (step 1) → 0.6 (step 2)" in summary and "val/" not in summary


def test_console_eta_is_a_moving_average_of_step_intervals():
    now = [0.0]
    out = io.StringIO()
    sink = ConsoleSink(total_steps=100, run_name="r", run_dir="d", window=2, stream=out, clock=lambda: now[0])
    for step, t in [(1, 0.0), (2, 10.0), (3, 30.0), (5, 50.0)]:  # intervals 10, 20, then 20 over 2 steps = 10
        now[0] = t
        sink.log(step, {"timing_s/step": 999.0})
    lines = out.getvalue().splitlines()
    assert lines[0].endswith(f"ETA {format_duration(999.0 * 99)}")  # no interval yet
    assert lines[1].endswith("ETA 16m20s")  # 10 s × 98
    assert lines[2].endswith("ETA 24m15s")  # mean(10, 20) = 15 s × 97
    assert lines[3].endswith("ETA 23m45s")  # window 2: mean(20, 10) = 15 s × 95
    sink.close(failed=True)
    assert "stopped by an error at step 5" in out.getvalue().splitlines()[-1]


def test_all_sinks_together_and_close_is_idempotent(tmp_path, capsys):
    logger = make_logger(tmp_path, ["console", "jsonl", "tensorboard"])
    logger.log(0, {"val/rewards/mean": 0.5})
    logger.log_images(0, "val/samples", torch.zeros(4, 4, 3, dtype=torch.uint8))
    logger.close()
    logger.close()
    assert (tmp_path / "metrics.jsonl").exists() and any((tmp_path / "tensorboard").iterdir())
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(1, {})
    with pytest.raises(ValueError, match="uint8"):
        make_logger(tmp_path, ["jsonl"]).log_images(1, "x", np.zeros((4, 4, 3), np.float32))


# ------------------------------------------------------------------------------ wandb
def test_wandb_requested_but_not_installed_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(ImportError, match="pip install wandb"):
        check_loggers(["console", "wandb"])
    with pytest.raises(ImportError, match="pip install wandb"):
        make_logger(tmp_path, ["jsonl", "wandb"])
    check_loggers(["console", "jsonl", "tensorboard"])  # the others need nothing missing


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with make_logger(tmp_path, ["wandb"]) as logger:
        logger.log(1, {"rewards/mean": 0.5, "actor/loss": math.nan})
        logger.log_images(1, "val/samples", np.zeros((4, 4, 3), np.uint8))
        run_id = logger.sinks[0].run.id
    assert (tmp_path / "wandb_run_id").read_text().strip() == run_id
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))


def test_the_wandb_project_comes_from_trainer_project_name_else_the_environment(tmp_path, monkeypatch):
    """Issue 52, re-walk 11: the project could be set only by $WANDB_PROJECT. A stand-in for the
    wandb module records what `wandb.init` is given (the real package is optional)."""
    import types

    from diffrl.config import load_config

    projects = []

    class Run:
        def finish(self, exit_code=0):
            pass

    def init(**kwargs):
        projects.append(kwargs["project"])
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    cfg = load_config("default", ["trainer.project_name=my-project"])
    for project in (cfg.trainer.project_name, load_config("default").trainer.project_name):
        RunLogger(
            tmp_path, ["wandb"], total_steps=1, config=CONFIG, run_name="r", wandb_project=project
        ).close()
    monkeypatch.delenv("WANDB_PROJECT")
    RunLogger(tmp_path, ["wandb"], total_steps=1, config=CONFIG, run_name="r").close()
    assert projects == ["my-project", "from-env", "diffrl"]
