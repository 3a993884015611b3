"""The run-health watchdog and trainer.keep_best in whole `diffrl train` runs of the tiny SD3 on CPU:
a signal in trainer.health.stop_on stops the run cleanly (checkpoint, exports, exit status 3), and
a keep_best run trains exactly as a plain one, keeps the best validation's checkpoint past the
pruning, remembers its score across a resume, and exports it (RUN/export_best, `diffrl export
--best`). The signals themselves are tested on planted metrics in tests/telemetry/test_health.py."""

import json
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from diffrl.cli import main
from diffrl.controller.loop import TrainingLoop
from diffrl.telemetry import read_metrics
from diffrl.telemetry.health import HealthStop

sys.path.insert(0, str(Path(__file__).parent))  # health_helpers, for the reward's import path

COMMON = ["trainer.check_at_start=false", "trainer.loggers=[jsonl]"]
NOT_COMPARABLE = ("timing", "throughput", "perf/", "time")
WEIGHTS = "pytorch_lora_weights.safetensors"
PLANTED_METRIC, PLANTED = "val/planted", {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.25}  # best at step 2


def comparable(row: dict) -> dict:
    """Everything but wall-clock measurements."""
    return {k: v for k, v in row.items() if not k.startswith(NOT_COMPARABLE) and "seconds" not in k}


def test_a_signal_in_stop_on_stops_the_run_with_its_checkpoint_exports_and_exit_status_3(
    tmp_path, monkeypatch, capsys
):
    """A reward of the prompt alone gives every group one reward: zero_reward_spread at step 1
    (patience 1). The run stops after step 1 of 3, with step 1's checkpoint, both exports (the
    base model's validation at step 0 is the best: step 1's scores the same), and exit status 3."""
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    code = main(
        [
            "train",
            "tiny_sd3",
            *COMMON,
            f"trainer.output_dir={tmp_path}",
            "trainer.run_name=stopped",
            "trainer.total_steps=3",
            "trainer.save_freq=0",  # only the final checkpoint: the stop's is the watchdog's own
            "trainer.test_freq=1",
            "trainer.keep_best=true",
            "trainer.keep_checkpoints=1",
            "reward.functions.jpeg_compressibility.weight=0",
            "reward.functions.python.args.function=health_helpers:prompt_only",
            "trainer.health.stop_on=[zero_reward_spread]",
            "trainer.health.patience=1",
        ]
    )
    out = capsys.readouterr()
    assert code == HealthStop.EXIT_STATUS == 3
    run = tmp_path / "stopped"
    metrics = read_metrics(run / "metrics.jsonl")
    assert sorted(metrics) == [0, 1]
    assert metrics[1]["rewards/zero_std_ratio"] == 1.0 and metrics[1]["health/zero_reward_spread"] == 1.0
    assert out.out.count("warning: health: zero_reward_spread: step 1:") == 1
    assert "stopped: zero_reward_spread (trainer.health.stop_on): step 1:" in out.err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["health"] == {"zero_reward_spread": 1}
    assert summary["stopped"].endswith(f"{run / 'checkpoints' / 'step_00000001'}")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best", "step_00000001"]
    assert summary["best"] == {
        "metric": "val/rewards/mean",
        "score": metrics[0]["val/rewards/mean"],
        "step": 0,
    }
    assert metrics[1]["val/rewards/mean"] == metrics[0]["val/rewards/mean"]  # a tie is no new best
    assert json.loads((run / "export" / "diffrl_export.json").read_text())["step"] == "final"
    assert json.loads((run / "export_best" / "diffrl_export.json").read_text())["step"] == 0


def test_a_keep_best_run_trains_as_a_plain_one_and_a_resume_remembers_its_best(tmp_path, monkeypatch):
    """Steps 0..3, validated at each: a plain run, and a keep_best run stopped after step 2 and
    resumed to step 3. Every logged number is the same; the best checkpoint is the validation with
    the highest best_metric of the plain run's (the first of ties), kept beside the newest step
    checkpoint only (keep_checkpoints=1), and both exports of it hold the same weights.

    best_metric is a score planted in each validation's metrics (`PLANTED`: the real ones drift
    one way or the other by host, by float rounding), which rises over steps 0..2 and falls at
    step 3: steps 1 and 2 each replace the best, and the resumed start must remember step 2's score
    (a tracker that forgot it would keep step 3, its first validation)."""
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    validate = TrainingLoop.validate

    def planted(self):
        return {**validate(self), PLANTED_METRIC: PLANTED[self.step]}

    monkeypatch.setattr(TrainingLoop, "validate", planted)
    base = [*COMMON, f"trainer.output_dir={tmp_path}", "trainer.save_freq=2", "trainer.test_freq=1"]
    assert main(["train", "tiny_sd3", *base, "trainer.run_name=plain", "trainer.total_steps=3"]) == 0
    kept = [
        *base,
        "trainer.run_name=kept",
        "trainer.keep_best=true",
        f"trainer.best_metric={PLANTED_METRIC}",
        "trainer.keep_checkpoints=1",
    ]
    assert main(["train", "tiny_sd3", *kept, "trainer.total_steps=2"]) == 0
    assert main(["train", "tiny_sd3", *kept, "trainer.total_steps=3"]) == 0  # resumes step 2
    run = tmp_path / "kept"
    plain, got = read_metrics(tmp_path / "plain" / "metrics.jsonl"), read_metrics(run / "metrics.jsonl")
    assert sorted(got) == [0, 1, 2, 3]
    for step in got:
        assert comparable(got[step]) == pytest.approx(comparable(plain[step]), rel=1e-6, abs=1e-9), step

    scores = [PLANTED[step] for step in range(4)]
    best_step = scores.index(max(scores))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best"] == {"metric": PLANTED_METRIC, "score": max(scores), "step": best_step}
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best", "step_00000003"]
    extra = json.loads((run / "checkpoints" / "best" / "extra.json").read_text())
    assert extra["step"] == best_step and extra["best"]["score"] == max(scores)

    manifest = json.loads((run / "export_best" / "diffrl_export.json").read_text())
    assert manifest["step"] == best_step
    out = tmp_path / "best_again"
    assert main(["export", str(run), "--best", "--out", str(out)]) == 0
    exported, again = load_file(run / "export_best" / WEIGHTS), load_file(out / WEIGHTS)
    assert exported.keys() == again.keys() and all((exported[k] == again[k]).all() for k in exported)
    final = load_file(run / "export" / WEIGHTS)
    assert any((exported[k] != final[k]).any() for k in final)  # step 2's weights, not step 3's
