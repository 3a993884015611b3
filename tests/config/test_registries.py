"""The config's tables are filled by the code that defines what they name (diffrl.config.registries),
whatever module a process imports first: `LossConfig` then holds every algorithm's settings, and
`reward.functions` and `model.path=tiny:`/`toy:` are checked against the registered ones."""

import json
import subprocess
import sys
from dataclasses import fields

import pytest

from diffrl.config import ConfigError, load_config
from diffrl.config.registries import ALGORITHMS, SHIPPED_MODEL_DIRS, TINY_MODELS, settings_keys
from diffrl.config.sections.actor import LossConfig, SharedLossConfig


def test_loss_config_holds_the_shared_keys_then_every_algorithms_settings():
    expected = [f.name for f in fields(SharedLossConfig)]
    for spec in ALGORITHMS.values():
        expected += settings_keys(spec)
    assert [f.name for f in fields(LossConfig)] == expected
    assert {"mix_beta", "dpo_beta", "awm_weighting"} <= set(expected)  # three algorithms' own keys


@pytest.mark.parametrize("first", ["diffrl.config.sections.actor", "diffrl.algos.nft", "diffrl.sde"])
def test_the_tables_are_full_whichever_module_a_process_imports_first(first):
    code = (
        f"import importlib, json; importlib.import_module({first!r})\n"
        "from dataclasses import fields\n"
        "from diffrl.config.sections.actor import LossConfig\n"
        "from diffrl.config import registries as r\n"
        "print(json.dumps({'loss': [f.name for f in fields(LossConfig)], 'algorithms': r.ALGORITHMS.names(),"
        " 'estimators': r.ADVANTAGE_ESTIMATORS.names(), 'tiny': sorted(r.TINY_MODELS),"
        " 'reward_checks': len(r._reward_checks)}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    seen = json.loads(done.stdout)
    assert seen["loss"] == [f.name for f in fields(LossConfig)]
    assert seen["algorithms"] == ALGORITHMS.names()
    assert seen["estimators"] == ["flow_grpo"]
    assert {"toy", "toy_edit"} <= set(seen["tiny"])  # the shapes world's, registered by diffrl.toy
    assert seen["reward_checks"] == 1


def test_an_unknown_reward_is_refused_by_the_registered_check():
    with pytest.raises(ConfigError, match="no_such_reward"):
        load_config("default", ["reward.functions.no_such_reward.weight=1"])


def test_the_shapes_world_registers_its_models_as_a_users_task_would():
    from diffrl.models import resolve_model_path
    from diffrl.toy import PRETRAINED_DIR

    assert TINY_MODELS["toy"] == "diffrl.toy.model" and PRETRAINED_DIR in SHIPPED_MODEL_DIRS
    assert resolve_model_path("toy:shapes") == PRETRAINED_DIR / "shapes"
    with pytest.raises(ValueError, match=r"no shipped model 'nope'; shipped: \['shapes', 'shapes_edit'\]"):
        resolve_model_path("toy:nope")
