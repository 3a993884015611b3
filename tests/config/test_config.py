import dataclasses
import textwrap

import pytest

from diffrl.config import Config, ConfigError, load_config, preset_names, to_yaml
from diffrl.config.plan import resolve_plan
from diffrl.config.schema import RewardFnConfig


@pytest.mark.parametrize("name", preset_names())
def test_every_shipped_preset_loads_and_validates(name):
    cfg = load_config(name)
    assert isinstance(cfg, Config)
    assert cfg.model.path is not None


def test_defaults_are_a_valid_config():
    # The schema's own defaults (no preset) must satisfy every rule, or every preset inherits a trap.
    Config().validate()


def test_overrides_reach_the_dataclass():
    cfg = load_config(
        "default",
        [
            "rollout.sde.noise_level=0.9",
            "actor.optim.lr=1e-5",
            "actor.optim.betas=[0.8,0.95]",
            "model.lora.target_modules=[to_q,to_k]",
            "rollout.sde.window_range=null",
            "reward.functions.ocr.weight=0.5",
            "reward.functions.ocr.args.lang=eng",
            "trainer.ray_address=auto",
        ],
    )
    assert cfg.rollout.sde.noise_level == 0.9
    assert cfg.actor.optim.lr == 1e-5
    assert cfg.actor.optim.betas == [0.8, 0.95]
    assert cfg.model.lora.target_modules == ["to_q", "to_k"]
    assert cfg.rollout.sde.window_range is None
    assert cfg.reward.functions["ocr"] == RewardFnConfig(weight=0.5, required=True, args={"lang": "eng"})
    assert cfg.trainer.ray_address == "auto"
    # Overrides change only what they name: everything else is the preset's value.
    untouched = load_config("default")
    assert cfg.rollout.n == untouched.rollout.n
    assert cfg.reward.functions.keys() - {"ocr"} == untouched.reward.functions.keys()


def test_preset_values_override_schema_defaults_and_nothing_else():
    preset = load_config("shapes_flow_grpo")
    defaults = Config()
    assert preset.rollout.pipeline.height != defaults.rollout.pipeline.height  # the preset shrinks it
    assert preset.actor.loss == defaults.actor.loss  # and does not mention the loss


def test_yaml_file_source(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            rollout:
              n: 4
            data:
              prompts_per_step: 2
            actor:
              mini_batch_size: 8
              micro_batch_size: 4
            """
        )
    )
    cfg = load_config(str(path), ["trainer.total_steps=3", "model.path=tiny:sd3"])
    assert (cfg.rollout.n, cfg.data.prompts_per_step, cfg.trainer.total_steps) == (4, 2, 3)
    assert cfg.images_per_step == 8


def test_a_one_key_file_without_base_is_refused_at_once_saying_to_add_base_default(tmp_path, capsys):
    """Issue 33, defect 4: a file without `base:` starts from the schema's defaults (no model); it
    used to print a config with an empty model.path, and `diffrl train` failed 16 s later with
    "model.path is empty" and no word about `base:`."""
    from diffrl.cli import main

    path = tmp_path / "my_experiment.yaml"
    path.write_text("actor:\n  optim: {lr: 1.0e-4}\n")
    assert main(["config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "names no `base:`" in err and "base: default" in err and str(path) in err, err
    # with the line it asks for, the file is the default job with one change
    path.write_text("base: default\nactor:\n  optim: {lr: 1.0e-4}\n")
    cfg, default = load_config(str(path)), load_config("default")
    assert cfg.actor.optim.lr == 1e-4
    assert dataclasses.replace(cfg.actor.optim, lr=default.actor.optim.lr) == default.actor.optim
    assert cfg.model == default.model and cfg.rollout == default.rollout


def test_base_chains_merge_outermost_first(tmp_path):
    """`base:` merges the named preset or file first; a relative path is relative to the naming file;
    the command line still wins; a loop is an error naming the chain."""
    (tmp_path / "mid.yaml").write_text(
        "base: shapes_flow_grpo\nrollout:\n  n: 16\nactor:\n  optim:\n    lr: 1.0e-5\n"
    )
    (tmp_path / "top.yaml").write_text("base: mid.yaml\nactor:\n  loss:\n    mode: grpo_guard\n")
    cfg = load_config(str(tmp_path / "top.yaml"), ["actor.optim.lr=2e-5"])
    base = load_config("shapes_flow_grpo")
    assert cfg.model.path == base.model.path  # from shapes_flow_grpo
    assert cfg.rollout.n == 16  # from mid.yaml
    assert cfg.actor.loss.mode == "grpo_guard"  # from top.yaml
    assert cfg.actor.optim.lr == 2e-5  # the command line wins
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(
        ConfigError, match=r"`base` chain loops back on itself: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"
    ):
        load_config(str(tmp_path / "a.yaml"))
    (tmp_path / "c.yaml").write_text("base: nope.yaml\n")
    with pytest.raises(FileNotFoundError, match=r"base 'nope\.yaml' does not exist"):
        load_config(str(tmp_path / "c.yaml"))


def test_unknown_key_lists_valid_keys_with_did_you_mean():
    with pytest.raises(ConfigError) as err:
        load_config("default", ["rollout.sde.noise_levle=1"])
    msg = str(err.value)
    assert "rollout.sde.noise_levle" in msg
    assert "Did you mean 'noise_level'?" in msg
    for key in ("type", "noise_level", "window_size", "window_range", "window_strategy"):
        assert key in msg


def test_unknown_section_lists_top_level_keys():
    with pytest.raises(ConfigError) as err:
        load_config("default", ["rollotu.n=3"])
    msg = str(err.value)
    assert "Did you mean 'rollout'?" in msg
    assert "model, rollout, actor, algorithm, reward, data, trainer" in msg


def test_unknown_key_in_a_yaml_file_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("actor:\n  optim:\n    learning_rate: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    msg = str(err.value)
    assert str(path) in msg and "actor.optim.learning_rate" in msg and "lr" in msg


def test_wrong_type_names_key_value_and_expected_type():
    with pytest.raises(ConfigError) as err:
        load_config("default", ["rollout.n=many"])
    assert str(err.value) == "command line: rollout.n='many' has the wrong type: expected int"
    with pytest.raises(
        ConfigError, match=r"rollout\.sde\.noise_level=None has the wrong type: expected float"
    ):
        load_config("default", ["rollout.sde.noise_level=null"])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("actor.loss.clip_ratio=0", r"actor\.loss\.clip_ratio=0\.0 is invalid: must be > 0"),
        ("actor.loss.clip_ratio=-1e-4", r"actor\.loss\.clip_ratio=-0\.0001 is invalid: must be > 0"),
        (
            "rollout.sde.type=euler",
            r"rollout\.sde\.type='euler' is invalid: must be one of 'sde', 'cps', 'dance_sde'",
        ),
        ("rollout.sde.noise_level=0", r"rollout\.sde\.noise_level=0\.0 is invalid: must be > 0"),
        (
            "model.dtype=fp8",
            r"model\.dtype='fp8' is invalid: must be one of 'float32', 'bfloat16', 'float16'",
        ),
        (
            "actor.optim.betas=[0.9]",
            r"actor\.optim\.betas=\[0\.9\] is invalid: must be two numbers in \[0, 1\)",
        ),
        (
            "algorithm.sample_source=offline",
            r"algorithm\.sample_source='offline' is invalid: must be online for policy-gradient training",
        ),
        (
            "actor.loss.awm_weighting=huber",
            r"actor\.loss\.awm_weighting='huber' is invalid: must be one of 'uniform'",
        ),
        (
            "algorithm.timestep_fraction=1.5",
            r"algorithm\.timestep_fraction=1\.5 is invalid: must be in \(0, 1\]",
        ),
        (
            "trainer.loggers=[console,mlflow]",
            r"trainer\.loggers='mlflow' is invalid: must be one of 'console'",
        ),
        (
            "algorithm.train_step_range=[3,3]",
            r"algorithm\.train_step_range=\[3, 3\] is invalid: must be \[lo, hi\) with 0 <= lo < hi",
        ),
        (
            "algorithm.train_step_range=[0,2]",
            r"algorithm\.train_step_range=\[0, 2\] is invalid: .*actor\.loss\.mode=flow_grpo does not use it",
        ),
        ("model.attn_backend=flash2", r"model\.attn_backend='flash2' is invalid: must be one of .*'native'"),
        ("actor.loss.mode=grpo", r"actor\.loss\.mode='grpo' is invalid: .*flow_grpo"),
        ("actor.loss.mode=kl", r"actor\.loss\.mode='kl' is invalid: kl is the KL-to-reference term"),
        ("algorithm.adv_estimator=grpo", r"algorithm\.adv_estimator='grpo' is invalid: .*flow_grpo"),
    ],
)
def test_out_of_range_values_name_key_value_and_allowed(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config("shapes_flow_grpo", [override])


def test_auto_recomputes_old_log_probs_wherever_the_sampler_cannot_match_the_update():
    # eager as compiled: the exactness conditions decide, not the compilation
    assert load_config("shapes_flow_grpo", []).reuses_rollout_log_probs
    for override in (
        "algorithm.rollout_correction.is_level=step",  # needs a second log-prob
        "algorithm.timestep_fraction=0.5",  # DanceGRPO's step subsets: forwards of fewer rows
        "rollout.micro_batch_size=12",  # sampler micro-batches do not split into the trainer's (32)
    ):
        assert not load_config("shapes_flow_grpo", [override]).reuses_rollout_log_probs, override
    with pytest.raises(ConfigError, match=r"has no effect when the trainer reuses.*old_log_probs=recompute"):
        load_config(
            "shapes_flow_grpo",
            ["algorithm.rollout_correction.is_level=step", "algorithm.old_log_probs=rollout"],
        )


def test_train_step_range_is_for_the_losses_that_noise_clean_samples():
    for preset in ("shapes_nft", "shapes_awm"):
        cfg = load_config(preset, ["algorithm.train_step_range=[0,2]"])
        assert cfg.algorithm.train_step_range == [0, 2]
        with pytest.raises(ConfigError, match=r"ends after the rollout's 10 steps.*use hi <= 10"):
            load_config(preset, ["algorithm.train_step_range=[0,11]"])
    with pytest.raises(ConfigError, match=r"actor\.loss\.mode=dpo does not use it"):
        load_config("shapes_dpo", ["algorithm.train_step_range=[0,2]"])


def test_cps_noise_level_is_at_most_one():
    with pytest.raises(
        ConfigError, match=r"rollout\.sde\.noise_level=1\.5 is invalid: must be <= 1 for type=cps"
    ):
        load_config("default", ["rollout.sde.type=cps", "rollout.sde.noise_level=1.5"])
    assert (
        load_config(
            "default", ["rollout.sde.type=sde", "rollout.sde.noise_level=1.5"]
        ).rollout.sde.noise_level
        == 1.5
    )


def test_reward_names_and_args_are_checked_before_anything_loads():
    with pytest.raises(ConfigError, match=r"unknown reward 'jpeg_compresibility'.*jpeg_compressibility"):
        load_config("default", ["reward.functions.jpeg_compresibility.weight=1"])
    with pytest.raises(ConfigError, match=r"language"):
        load_config("default", ["reward.functions.ocr.args.language=eng"])


def test_window_must_fit_the_steps():
    # window_size larger than the number of steps
    with pytest.raises(ConfigError, match=r"rollout\.sde\.window_size=11 is invalid: must be <= .* 10"):
        load_config("shapes_flow_grpo", ["rollout.sde.window_range=null", "rollout.sde.window_size=11"])
    # a window range reaching past the last step
    with pytest.raises(ConfigError, match=r"rollout\.sde\.window_range=\[2, 12\] is invalid: must end .*=10"):
        load_config("shapes_flow_grpo", ["rollout.sde.window_range=[2,12]"])
    # exactly fitting is fine
    cfg = load_config("shapes_flow_grpo", ["rollout.sde.window_range=[4,10]", "rollout.sde.window_size=6"])
    assert cfg.rollout.sde_window_range == (4, 10) and cfg.rollout.sde_window_size == 6


def test_batch_sizes_must_nest():
    # shapes_base: 8 prompts × 4 samples = 32 trajectories per step, mini-batch 32, micro 32
    with pytest.raises(ConfigError, match=r"actor\.micro_batch_size=12 is invalid: .*mini_batch_size=32"):
        load_config("shapes_base", ["actor.micro_batch_size=12"])
    with pytest.raises(
        ConfigError, match=r"actor\.mini_batch_size=12 is invalid: must be a multiple of rollout\.n=8"
    ):
        load_config("shapes_base", ["rollout.n=8", "actor.mini_batch_size=12", "actor.micro_batch_size=4"])
    with pytest.raises(ConfigError, match=r"actor\.mini_batch_size=64 is invalid: must divide .* = 32"):
        load_config("shapes_base", ["actor.mini_batch_size=64"])
    # micro-batches are per worker: 2 workers × 16 no longer divide a mini-batch of 16
    with pytest.raises(ConfigError, match=r"actor\.micro_batch_size=16 is invalid: × the 2 worker"):
        load_config(
            "shapes_base",
            [
                "actor.mini_batch_size=16",
                "actor.micro_batch_size=16",
                "trainer.n_gpus_per_node=2",
                "actor.strategy=fsdp2",
            ],
        )
    with pytest.raises(
        ConfigError, match=r"actor\.strategy='none' is invalid: must be auto, ddp or fsdp2 with 2 workers"
    ):
        load_config(
            "shapes_base",
            ["actor.micro_batch_size=8", "trainer.n_gpus_per_node=2", "actor.strategy=none"],
        )
    with pytest.raises(
        ConfigError, match=r"data\.prompts_per_step=3 is invalid: must be a multiple of the 2 worker"
    ):
        load_config(
            "shapes_base",
            [
                "trainer.n_gpus_per_node=2",
                "actor.strategy=fsdp2",
                "data.prompts_per_step=3",
                "actor.mini_batch_size=8",
            ],
        )
    with pytest.raises(ConfigError, match=r"rollout\.n=1 is invalid: must be >= 2"):
        load_config("shapes_base", ["rollout.n=1", "actor.mini_batch_size=4", "actor.micro_batch_size=4"])


def test_derived_values_are_computed_from_the_keys():
    cfg = load_config(
        "default",
        [
            "data.prompts_per_step=6",
            "rollout.n=4",
            "actor.mini_batch_size=8",
            "actor.micro_batch_size=4",
            "actor.epochs=2",
            "trainer.seed=7",
            "data.seed=11",
        ],
    )
    derived = cfg.derived()
    assert derived["images_per_step"] == 24
    assert derived["optimizer_steps_per_step"] == 24 // 8 * 2
    assert derived["rollout_seed"] == 7 and derived["data_seed"] == 11


def test_unknown_preset_suggests_the_closest():
    with pytest.raises(
        ConfigError, match=r"unknown preset 'defualt'\. Did you mean 'default'\? Available presets:"
    ):
        load_config("defualt")


def test_missing_yaml_file():
    with pytest.raises(FileNotFoundError, match=r"config file 'nope/run.yaml' does not exist"):
        load_config("nope/run.yaml")


def test_malformed_override():
    with pytest.raises(ConfigError, match=r"override 'rollout.n' is not key=value"):
        load_config("default", ["rollout.n"])


def test_printed_config_is_complete_and_reloadable(tmp_path):
    cfg = load_config("default", ["rollout.sde.noise_level=0.85"])
    text = to_yaml(cfg)
    path = tmp_path / "printed.yaml"
    path.write_text(text)
    assert load_config(str(path)) == cfg
    # every schema section and key appears in the printout
    for section in dataclasses.fields(Config):
        assert f"{section.name}:\n" in text


def test_resume_off_survives_yaml_booleans(tmp_path):
    # YAML 1.1 reads a bare `off` as false; the key still means "off".
    assert load_config("default", ["trainer.resume=off"]).trainer.resume == "off"
    path = tmp_path / "run.yaml"
    path.write_text("base: default\ntrainer:\n  resume: off\n")
    assert load_config(str(path)).trainer.resume == "off"
    assert load_config(
        "default", ["trainer.resume=/runs/x/checkpoints/step_00000002"]
    ).trainer.resume.endswith("2")


def test_lora_inits_that_rewrite_the_base_weights_are_refused():
    with pytest.raises(
        ConfigError, match=r"model\.lora\.init='pissa' is invalid: must be one of 'default', 'gaussian'"
    ):
        load_config("default", ["model.lora.init=pissa"])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("+actor.optim.lr=1e-4", "write it as 'actor.optim.lr=1e-4'"),
        ("++reward.functions.ocr.weight=1", "write it as 'reward.functions.ocr.weight=1'"),
        ("~reward.functions.shapes", "remove the entry with reward.functions.shapes=null"),
        ("~trainer.run_name", "unset it with trainer.run_name=null"),  # an Optional key
    ],
)
def test_hydra_prefixes_get_a_message_that_says_to_drop_them(override, expected, capsys):
    """Issue 33, defect 13: `+key=value` was answered with a misleading "Did you mean"."""
    from diffrl.cli import main

    assert main(["config", "default", override]) == 2
    err = capsys.readouterr().err
    assert "Hydra's prefix" in err and expected in err and "Did you mean" not in err, err
    # and the override it suggests works (a tilde's key=null removes the preset's entry)
    fixed = expected.split("'")[1] if "write it as" in expected else expected.rsplit(" ", 1)[1]
    assert main(["config", "default", fixed]) == 0


def test_a_tilde_on_a_key_that_always_has_a_value_suggests_no_null(capsys):
    """`~trainer.seed` suggested trainer.seed=null, which the schema then refused (an int)."""
    from diffrl.cli import main

    assert main(["config", "default", "~trainer.seed"]) == 2
    err = capsys.readouterr().err
    assert "trainer.seed always has a value" in err and "=null" not in err, err


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["trainer.async_mode=bounded"],
            r"trainer\.async_mode='bounded' is invalid: needs trainer\.placement=separate",
        ),
        (
            ["trainer.placement=separate", "trainer.async_mode=bounded", "trainer.max_staleness=0"],
            r"trainer\.max_staleness=0 is invalid: must be an integer >= 1 .*set trainer\.max_staleness=1 or more",
        ),
        (
            ["trainer.placement=separate", "trainer.async_mode=one_step_off", "trainer.max_staleness=3"],
            r"trainer\.max_staleness=3 is invalid: only applies to trainer\.async_mode=bounded \(this run's is "
            r"one_step_off.*set trainer\.async_mode=bounded, or leave it at 2",
        ),
        (
            [
                "trainer.placement=separate",
                "trainer.async_mode=bounded",
                "rollout.log_prob_passes=rollout",
            ],
            r"rollout\.log_prob_passes='rollout' is invalid: cannot run the recomputed old log-probs on the "
            r"replicas with trainer\.async_mode=bounded.*rollout\.log_prob_passes=auto",
        ),
    ],
    ids=["colocated", "zero", "not_bounded", "old_log_probs_on_replicas"],
)
def test_bounded_staleness_settings_are_checked_naming_the_value_and_the_fix(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config("tiny_sd3", overrides)


def test_bounded_staleness_keeps_the_old_log_probs_on_the_trainer_and_the_reference_on_the_replicas():
    separate = ["trainer.placement=separate", "actor.loss.kl_coef=0.01"]
    one_step_off = load_config("tiny_sd3", [*separate, "trainer.async_mode=one_step_off"])
    bounded = load_config("tiny_sd3", [*separate, "trainer.async_mode=bounded", "trainer.max_staleness=3"])
    assert resolve_plan(one_step_off).rollout_passes == ("default", "reference")
    assert resolve_plan(bounded).rollout_passes == ("reference",)
    assert bounded.trainer.max_staleness == 3
    # the sampler's log-probs stay the behaviour policy's: the trainer recomputes the old ones
    assert not bounded.reuses_rollout_log_probs


def test_fsdp2_settings_that_would_do_nothing_are_refused():
    """actor.param_offload is FSDP2's CPU offload: refused where the strategy does not shard; on one
    worker FSDP2 runs on a one-rank group (diffrl.config.plan), so there it is taken."""
    with pytest.raises(
        ConfigError,
        match=r"actor\.param_offload=True is invalid: does nothing with actor\.strategy=ddp: .*actor\.strategy=fsdp2",
    ):
        load_config(
            "shapes_flow_grpo",
            ["actor.param_offload=true", "trainer.n_gpus_per_node=2", "actor.strategy=ddp"],
        )
    for workers in ("1", "2"):
        cfg = load_config(
            "shapes_flow_grpo", ["actor.param_offload=true", f"trainer.n_gpus_per_node={workers}"]
        )
        assert cfg.actor.param_offload and cfg.world_size == int(workers)
    assert load_config("shapes_flow_grpo", ["actor.strategy=fsdp2"]).actor.strategy == "fsdp2"
