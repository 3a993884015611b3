"""model.fp8 in the config and the run plan: its values, and the runs refused before any worker
starts (no GPU, no torchao, float8 sampling with the rollout's log-probs as PPO's old ones)."""

from __future__ import annotations

import pytest

from diffrl.config import ConfigError, load_config
from diffrl.config import plan as plan_module
from diffrl.config.plan import FP8_TORCHAO, Machine, resolve_plan

GPU = Machine(accelerator="cuda")


@pytest.fixture
def torchao_present(monkeypatch):
    monkeypatch.setattr(plan_module, "torchao_problem", lambda mode: None)


def plan_of(overrides, machine=GPU):
    return resolve_plan(load_config("tiny_sd3", list(overrides)), machine)


def test_none_by_default_and_other_values_list_the_choices():
    assert load_config("tiny_sd3").model.fp8 == "none"
    assert load_config("tiny_sd3", ["model.fp8=none"]).model.fp8 == "none"
    with pytest.raises(
        ConfigError, match=r"model\.fp8='fp8' is invalid: must be one of 'none', 'sampling', 'all'$"
    ):
        load_config("tiny_sd3", ["model.fp8=fp8"])
    # YAML turns a bare off/on into a boolean: the error says so
    for word in ("off", "on"):
        with pytest.raises(ConfigError, match=r"'all'; off and on read as booleans in YAML: write none"):
            load_config("tiny_sd3", [f"model.fp8={word}"])


@pytest.mark.parametrize("mode", ["sampling", "all"])
def test_a_run_without_gpus_is_refused_with_the_fix(mode):
    with pytest.raises(
        ConfigError,
        match=rf"model\.fp8={mode} runs float8 GEMMs .* no GPU \(accelerator cpu\): set model\.fp8=none",
    ):
        plan_of([f"model.fp8={mode}"], Machine())


def test_missing_torchao_is_refused_where_torchao_runs_naming_the_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a)
    )
    # full fine-tuning trains the converted weights: torchao's float8 training linear
    with pytest.raises(
        ConfigError, match=rf"pip install torchao=={FP8_TORCHAO} \(or pip install 'diffrl\[fp8\]'\)"
    ):
        plan_of(["model.fp8=all", "model.lora.rank=0"])
    # a LoRA run's frozen base casts once with torch's own float8 GEMM: no torchao
    assert plan_of(["model.fp8=all"]).fp8 == "all"


def test_the_scaling_is_checked():
    assert load_config("tiny_sd3").model.fp8_scaling == "rowwise"
    with pytest.raises(ConfigError, match=r"model\.fp8_scaling='blockwise' is invalid"):
        load_config("tiny_sd3", ["model.fp8_scaling=blockwise"])


def test_sampling_recomputes_the_old_log_probs(torchao_present):
    rollout = ["algorithm.old_log_probs=rollout"]
    assert plan_of(rollout).old_log_probs == "rollout"
    with pytest.raises(ConfigError, match=r"model\.fp8=sampling with algorithm\.old_log_probs=rollout"):
        plan_of([*rollout, "model.fp8=sampling"])
    # auto: the sampler's float8 log-probs are not the trainer's, so the trainer recomputes them
    assert plan_of([]).old_log_probs == "rollout"
    assert plan_of(["model.fp8=sampling"]).old_log_probs == "trainer"
    # all: sampler and trainer run the same float8 GEMMs, so auto keeps the rollout's
    all_fp8 = plan_of(["model.fp8=all"])
    assert all_fp8.old_log_probs == "rollout"
    # the plan says it at start and keeps it in plan.json; a run without float8 prints as before
    assert all_fp8.fp8 == "all" and all_fp8.lines()[3].endswith(", fp8 all")
    assert all_fp8.to_dict()["fp8"] == "all"
    assert plan_of([]).fp8 == "none" and "fp8" not in plan_of([]).lines()[3]
    assert plan_of([*rollout, "model.fp8=all"]).old_log_probs == "rollout"
