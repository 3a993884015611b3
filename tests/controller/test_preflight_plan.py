"""A run resolves its plan once (diffrl.config.plan via diffrl.controller.preflight.run_plan):
it prints the plan as one block after the run's first line, keeps it as RUN/plan.json, hands it
to its workers, and never changes the config it loaded."""

from __future__ import annotations

import copy
import json

import diffrl.controller.run as run_module
import diffrl.workers.roles as roles
from diffrl.config import load_config
from diffrl.config.plan import PLAN_FILE
from diffrl.controller.preflight import machine_facts, run_plan
from diffrl.train.engine import TrainEngine


def test_a_run_prints_and_keeps_its_plan_hands_it_to_its_workers_and_leaves_the_config(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    loaded: list = []

    def load_and_keep(*args, **kwargs):
        cfg = load_config(*args, **kwargs)
        loaded.append((cfg, copy.deepcopy(cfg)))
        return cfg

    strategies: list = []

    class RecordingEngine(TrainEngine):
        def __init__(self, *args, **kwargs):
            strategies.append(kwargs.get("strategy"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(run_module, "load_config", load_and_keep)
    monkeypatch.setattr(roles, "TrainEngine", RecordingEngine)
    run_dir = run_module.train(
        "tiny_sd3",
        [
            "trainer.total_steps=1",
            "trainer.test_freq=0",
            "trainer.save_freq=1",
            "trainer.val_before_train=false",
            "trainer.check_at_start=false",
            "actor.loss.kl_coef=0.01",
            f"trainer.output_dir={tmp_path}",
            "trainer.run_name=planned",
        ],
    )
    ((cfg, as_loaded),) = loaded
    assert cfg == as_loaded and cfg.actor.strategy == "auto"  # nothing wrote a decision into it
    plan = run_plan(cfg)
    assert json.loads((run_dir / PLAN_FILE).read_text()) == plan.to_dict()
    assert (plan.strategy, plan.old_log_probs, plan.reference) == ("none", "rollout", "trainer")
    assert strategies == ["none"]  # the worker's engine took the plan's strategy, not its own
    lines = capsys.readouterr().out.splitlines()
    first = lines.index(f"run directory: {run_dir}")
    assert lines[first + 1 : first + 1 + len(plan.lines())] == plan.lines()
    assert lines[first + 1].startswith("plan: colocated: 1 worker sample and train; staleness K=0")


def test_machine_facts_read_the_model_only_where_the_strategy_needs_its_size(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    one = machine_facts(load_config("tiny_sd3"))
    assert one.weight_bytes is None and one.accelerator in ("cpu", "cuda")
    two = machine_facts(load_config("tiny_sd3", ["trainer.n_gpus_per_node=2"]))
    assert two.weight_bytes > 0 and two.device_bytes > 0
    assert run_plan(load_config("tiny_sd3", ["trainer.n_gpus_per_node=2"])).strategy == "ddp"  # tiny: fits
