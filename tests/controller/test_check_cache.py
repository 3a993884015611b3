"""A start-up check that passed is not run again for the same setup (issue 52, re-walk 3: every
start of the SD3.5-M recipe paid 92 s for it, a loaded 2-core host 170 s on shapes_flow_grpo).

The first start runs the real quick check of the default job; later starts find its record, and
every change the check's outcome depends on runs it again (here a stand-in `check_config` counts
the runs)."""

from __future__ import annotations

import shutil

import pytest

from diffrl.config import load_config
from diffrl.controller import check as check_module
from diffrl.controller import check_cache
from diffrl.controller.check import check_at_start
from diffrl.controller.check_report import FAIL, PASS, CheckReport, CheckRow
from diffrl.controller.preflight import preflight
from diffrl.controller.run import run_plan

SMALL = ["data.prompts_per_step=2", "rollout.n=2", "actor.mini_batch_size=4", "actor.micro_batch_size=4"]


def start(overrides, tmp_path):
    cfg = load_config("default", [*SMALL, f"trainer.output_dir={tmp_path / 'runs'}", *overrides])
    train, val = preflight(cfg)
    return check_at_start(cfg, train, val, plan=run_plan(cfg))


@pytest.fixture
def counted(monkeypatch):
    """check_config replaced by one that records its calls and passes (or fails, `verdict`)."""
    calls = {"n": 0, "verdict": PASS}

    def check_config(cfg, train, val, *, quick, plan=None):
        calls["n"] += 1
        return CheckReport([CheckRow("stand-in", "1", "1", calls["verdict"])], 0.5)

    monkeypatch.setattr(check_module, "check_config", check_config)
    return calls


def test_the_same_setup_is_checked_once(tmp_path, monkeypatch, capsys):
    first = start(["trainer.run_name=a"], tmp_path)
    assert first.startswith("setup check (diffrl check --quick):") and "checks passed" in first
    assert "sampling and re-evaluating" in capsys.readouterr().err  # said before the check ran

    def must_not_run(*args, **kwargs):
        raise AssertionError("the check ran again for a setup that passed it")

    monkeypatch.setattr(check_module, "check_config", must_not_run)
    # another run name, length and logging: the run's bookkeeping, not what the check measures
    again = start(["trainer.run_name=b", "trainer.total_steps=5", "trainer.loggers=[jsonl]"], tmp_path)
    assert again.startswith("setup check: skipped, it passed with this model and these settings")
    assert "diffrl check runs it again" in again


def test_a_change_the_outcome_depends_on_checks_again(tmp_path, tiny_model, counted):
    model = tmp_path / "model"
    shutil.copytree(tiny_model("sd3"), model)
    base = [f"model.path={model}"]
    start(base, tmp_path)
    start(base, tmp_path)
    assert counted["n"] == 1
    start([*base, "rollout.sde.noise_level=0.5"], tmp_path)  # a setting
    assert counted["n"] == 2
    weights = next(model.rglob("*.safetensors"))
    weights.write_bytes(weights.read_bytes())  # the model's files (a new modification time)
    start(base, tmp_path)
    assert counted["n"] == 3
    start(base, tmp_path)
    assert counted["n"] == 3


def test_a_failed_check_is_not_remembered(tmp_path, counted):
    counted["verdict"] = FAIL
    for attempt in (1, 2):
        with pytest.raises(ValueError, match="setup check failed"):
            start([], tmp_path)
        assert counted["n"] == attempt
    assert not list(check_cache.cache_dir().glob("*.json"))
