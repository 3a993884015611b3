"""Removing and replacing entries of the config's mappings (`reward.functions`, a reward's `args`)."""

import textwrap

import pytest

from diffrl.config import ConfigError, load_config
from diffrl.config.schema import RewardFnConfig


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


def test_null_on_the_command_line_removes_a_preset_reward():
    assert set(load_config("default").reward.functions) == {"shapes"}  # what the preset ships
    cfg = load_config("default", ["reward.functions.shapes=null", "reward.functions.ocr.weight=0.5"])
    assert cfg.reward.functions == {"ocr": RewardFnConfig(weight=0.5)}


def test_null_removes_a_reward_argument_so_the_function_default_applies():
    cfg = load_config("default", ["reward.functions.shapes.args.score=null"])
    assert cfg.reward.functions["shapes"].args == {}


def test_removing_an_entry_that_does_not_exist_names_the_ones_that_do():
    with pytest.raises(ConfigError, match=r"reward.functions.shape=null .* no entry 'shape'.*'shapes'"):
        load_config("default", ["reward.functions.shape=null"])


def test_a_mapping_itself_cannot_be_null_and_the_error_says_how_to_empty_it():
    with pytest.raises(ConfigError, match=r"reward.functions=!replace \{\}"):
        load_config("default", ["reward.functions=null"])


def test_replace_on_the_command_line_drops_every_entry_below():
    cfg = load_config("default", ["reward.functions=!replace {ocr: {weight: 2}}"])
    assert cfg.reward.functions == {"ocr": RewardFnConfig(weight=2.0)}
    # without the tag a mapping merges: the preset's entry stays
    merged = load_config("default", ["reward.functions={ocr: {weight: 2}}"])
    assert set(merged.reward.functions) == {"shapes", "ocr"}


def test_replace_only_applies_to_mappings_of_entries():
    with pytest.raises(
        ConfigError, match=r"!replace on reward: only .*reward.functions, reward.functions.<name>.args"
    ):
        load_config("default", ["reward=!replace {workers: 2}"])
    with pytest.raises(ConfigError, match="must tag a mapping"):
        load_config("default", ["reward.functions=!replace ocr"])


def test_yaml_replace_and_null_through_a_base_chain(tmp_path):
    write(
        tmp_path / "ocr_only.yaml",
        """\
        base: default
        reward:
          functions: !replace
            ocr: {weight: 0.5, args: {lang: eng}}
        actor:
          optim: {lr: 1e-4}   # OmegaConf's float parsing survives the tag handling
        """,
    )
    cfg = load_config(str(tmp_path / "ocr_only.yaml"))
    assert cfg.reward.functions == {"ocr": RewardFnConfig(weight=0.5, args={"lang": "eng"})}
    assert cfg.actor.optim.lr == 1e-4
    assert cfg.rollout.n == load_config("default").rollout.n  # the rest of the base is kept

    write(
        tmp_path / "back.yaml",
        """\
        base: ocr_only.yaml
        reward:
          functions:
            ocr: null
            shapes: {weight: 2}
        """,
    )
    cfg = load_config(str(tmp_path / "back.yaml"))
    assert cfg.reward.functions == {"shapes": RewardFnConfig(weight=2.0)}
    # and the command line can take away what the file added
    with pytest.raises(ConfigError, match="no entry 'ocr'"):
        load_config(str(tmp_path / "back.yaml"), ["reward.functions.ocr=null"])


def test_yaml_null_of_a_missing_entry_names_the_file(tmp_path):
    path = write(tmp_path / "bad.yaml", "base: default\nreward:\n  functions:\n    clip: null\n")
    with pytest.raises(ConfigError, match=rf"{path}: reward.functions.clip=null .*'shapes'"):
        load_config(str(path))


def test_replace_on_a_scalar_in_yaml_is_refused(tmp_path):
    path = write(tmp_path / "bad.yaml", "rollout:\n  n: !replace 4\n")
    with pytest.raises(ConfigError, match="must tag a mapping"):
        load_config(str(path))


def test_null_still_means_none_for_optional_keys():
    cfg = load_config("default", ["rollout.sde.window_range=null"])
    assert cfg.rollout.sde.window_range is None
