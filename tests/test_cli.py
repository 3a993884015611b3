import ast
import shutil
import subprocess
import sys

import pytest

from diffrl.cli import main
from diffrl.config import load_config, preset_names
from diffrl.config.early_checks import may_have_gpu


def test_config_prints_the_default_resolved_config(capsys):
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "rollout:\n" in out and "noise_level: 0.7" in out
    assert "#   images_per_step: 128" in out  # derived values, as comments (32 prompts × 4 samples)


def test_config_with_overrides(capsys):
    assert main(["config", "default", "rollout.sde.noise_level=0.9", "trainer.total_steps=5"]) == 0
    out = capsys.readouterr().out
    assert "noise_level: 0.9" in out and "total_steps: 5" in out


def test_config_overrides_without_preset_use_the_default(capsys):
    assert main(["config", "trainer.total_steps=5"]) == 0
    assert "total_steps: 5" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["config", "nosuch"], "unknown preset 'nosuch'"),
        (["config", "default", "rollout.sde.noise_levle=1"], "Did you mean 'noise_level'?"),
        (
            ["config", "default", "actor.loss.clip_ratio=0"],
            "actor.loss.clip_ratio=0.0 is invalid: must be > 0",
        ),
    ],
)
def test_config_errors_exit_nonzero_with_a_message_not_a_traceback(argv, expected, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert expected in captured.err
    assert "Traceback" not in captured.err
    assert captured.out == ""


def test_presets_lists_every_preset_with_its_summary(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in preset_names():
        assert name in out
    listing = " ".join(out.split())
    assert (
        "default The default job (`diffrl train` with no arguments): DiffusionNFT on the shapes world"
        in listing
    )
    assert "shapes_flow_grpo Flow-GRPO on the shapes world on a CPU:" in listing


def test_console_script_is_installed_and_returns_exit_codes():
    exe = shutil.which("diffrl")
    assert exe is not None, "the `diffrl` console script is not installed: pip install -e ."
    ok = subprocess.run([exe, "config"], capture_output=True, text=True, check=False)
    assert ok.returncode == 0 and "trainer:" in ok.stdout
    bad = subprocess.run([exe, "config", "nosuch"], capture_output=True, text=True, check=False)
    assert bad.returncode != 0 and "unknown preset" in bad.stderr
    helped = subprocess.run([exe, "--help"], capture_output=True, text=True, check=False)
    assert helped.returncode == 0 and "presets" in helped.stdout and "config" in helped.stdout


def test_printed_config_round_trips(capsys, tmp_path):
    assert main(["config", "default", "actor.optim.lr=2e-4"]) == 0
    path = tmp_path / "printed.yaml"
    path.write_text(capsys.readouterr().out)
    assert load_config(str(path)) == load_config("default", ["actor.optim.lr=2e-4"])


@pytest.mark.parametrize(
    ("family", "suffix", "extra"), [("sd3", ".png", []), ("wan", ".gif", ["--num-frames", "5"])]
)
def test_sample_writes_files_and_a_manifest(tiny_model, tmp_path, capsys, family, suffix, extra):
    import json

    from PIL import Image

    out = tmp_path / "samples"
    argv = [
        "sample",
        "--model",
        str(tiny_model(family)),
        "--prompt",
        "a red circle",
        "--prompt",
        "a blue square",
    ]
    argv += ["-n", "2", "--out", str(out), "--steps", "3", "--height", "32", "--width", "32", *extra]
    assert main(argv) == 0
    assert "wrote 4 file(s)" in capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["sample"]) for r in rows] == [
        ("a red circle", 0),
        ("a red circle", 1),
        ("a blue square", 0),
        ("a blue square", 1),
    ]
    for row in rows:
        image = Image.open(out / row["file"])
        assert row["file"].endswith(suffix) and image.size == (32, 32)
    # the same command gives the same pixels
    first = (out / rows[0]["file"]).read_bytes()
    assert main([*argv[: -len(extra) or None], *extra]) == 0
    assert (out / rows[0]["file"]).read_bytes() == first


def test_sample_errors_are_clear(tmp_path, capsys):
    assert main(["sample", "--model", str(tmp_path / "none"), "--prompt", "x", "--out", str(tmp_path)]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["sample", "--model", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "no prompts" in capsys.readouterr().err


def test_presets_show_whole_first_sentences_and_a_verification_level(capsys):
    from diffrl.config.catalog import LEVELS, format_presets, preset_info

    for name in preset_names():
        info = preset_info(name)  # raises for a missing or unknown level
        assert info.level in LEVELS
        assert info.summary.endswith((".", ")", "!", "?")) or info.summary.endswith(tuple("0123456789")), info
    shapes_dancegrpo = preset_info("shapes_dancegrpo")  # its first sentence spans two header lines
    assert shapes_dancegrpo.summary == (
        "DanceGRPO on the shapes world: dance_sde on every step, one initial noise per prompt group, each "
        "sample training a random 60% of its steps."
    )
    assert preset_info("tiny_sd3").level == "CPU end to end in CI"
    listing = format_presets(width=80)
    assert all(len(line) <= 80 for line in listing.splitlines()[:-1])
    words = " ".join(listing.split())  # wrapping moves line breaks, never drops words
    assert shapes_dancegrpo.summary in words and "[learning verified]" in words


def test_preset_headers_without_a_valid_level_are_rejected(tmp_path):
    from diffrl.config.catalog import preset_info

    (tmp_path / "a.yaml").write_text("# Something.\nmodel:\n  path: x\n")
    (tmp_path / "b.yaml").write_text("# Something.\n# verified: works on my laptop\nmodel: {}\n")
    with pytest.raises(ValueError, match="no '# verified: <level>' line"):
        preset_info("a", tmp_path)
    with pytest.raises(ValueError, match="does not start with one of"):
        preset_info("b", tmp_path)


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["presets"],
        ["config"],
        ["train", "--help"],
        ["serve-reward", "--help"],
        # a config error of a job is found before the job's imports (issue 52: 11-21 s per error)
        ["train", "trainer.total_steps=abc"],
        ["sft", "trainer.total_steps=abc"],
        ["check", "trainer.total_steps=abc"],
    ],
)
def test_parsing_and_config_import_nothing_heavy(argv):
    """`diffrl --help`, `diffrl presets` and `diffrl config` must start fast: no torch, diffusers,
    transformers, peft or Ray at all (importing them is most of a slow start). A module that
    `diffrl.lazy` deferred and nothing used yet counts as not imported. `diffrl config` validates
    the default preset's rewards, so it is checked to have imported them (the check ran, cheaply).
    `serve-reward --help` imports the reward server (its own parser), so it is checked for printing
    that parser, not for being light."""
    code = (
        "import sys\n"
        "from diffrl.cli import main\n"
        "from diffrl.lazy import is_deferred\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "loaded = {name.split('.')[0] for name, m in list(sys.modules.items()) if not is_deferred(m)}\n"
        "heavy = sorted(loaded & {'torch', 'diffusers', 'transformers', 'peft', 'ray'})\n"
        "print('HEAVY', heavy, 'REWARDS', 'diffrl.rewards.shapes' in sys.modules, file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    if argv[0] == "serve-reward":
        assert "--port" in done.stdout and "reward.functions.http" in done.stdout, done.stdout
        return
    assert "HEAVY []" in done.stderr, done.stderr[-2000:]
    if "trainer.total_steps=abc" in argv:
        assert "trainer.total_steps='abc' has the wrong type" in done.stderr, done.stderr[-2000:]
    if argv == ["config"]:
        assert "reward:" in done.stdout, done.stdout[-2000:]
        assert "REWARDS True" in done.stderr, done.stderr[-2000:]


def _run_light(argv: list[str], cwd) -> tuple[int, list[str], str]:
    """(exit status, the heavy packages imported, stderr) of `diffrl ARGV` in a fresh interpreter."""
    code = (
        "import sys\n"
        "from diffrl.cli import main\n"
        "from diffrl.lazy import is_deferred\n"
        f"rc = main({argv!r})\n"
        "loaded = {name.split('.')[0] for name, m in list(sys.modules.items()) if not is_deferred(m)}\n"
        "print('RC', rc, 'HEAVY', sorted(loaded & {'torch', 'diffusers', 'transformers', 'peft', 'ray'}), "
        "file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120, cwd=cwd
    )
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RC "), done.stderr[-2000:]
    rc, heavy = last[3:].split(" HEAVY ")
    return int(rc), ast.literal_eval(heavy), done.stderr


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train", "model.path=/nonexistent/model"], "model.path='/nonexistent/model' is not a directory"),
        (["train", "model.path=someorg/somemodel"], "it looks like a Hugging Face Hub id"),
        (["check", "model.path=/nonexistent/model"], "is not a directory"),
        (["eval", "/nonexistent/model"], "model.path='/nonexistent/model' is not a directory"),
        (["eval", "toy:shapes", "trainer.total_steps=abc"], "trainer.total_steps='abc' has the wrong type"),
        (["eval", "RUN", "trainer.total_steps=abc"], "trainer.total_steps='abc' has the wrong type"),
        (["export", "/nonexistent/run", "--out", "x"], "is neither a run directory"),
        (["export", "RUN", "--out", "x", "--device", "cdua"], "--device 'cdua' is not a device"),
        (
            ["sample", "--model", "/nonexistent/model", "--prompt", "a circle", "--out", "x"],
            "is not a directory",
        ),
        (
            ["sample", "--model", "toy:shapes", "--prompt", "a circle", "--device", "cuda0", "--out", "x"],
            "cuda0",
        ),
        pytest.param(
            ["sample", "--model", "toy:shapes", "--prompt", "a circle", "--device", "cuda:7", "--out", "x"],
            "--device 'cuda:7': this machine has no CUDA device",
            marks=pytest.mark.skipif(may_have_gpu(), reason="a GPU driver: torch counts the devices"),
        ),
    ],
)
def test_errors_found_before_the_heavy_imports(argv, expected, tmp_path):
    """A missing model directory, a bad device name or a config error of eval/export/sample is an
    error within a second, before torch, diffusers and Ray load (issue 52, re-walk 5: 11-21 s per
    error). RUN: a run directory holding only the default job's config.yaml."""
    from diffrl.config import to_yaml

    (tmp_path / "RUN").mkdir()
    (tmp_path / "RUN" / "config.yaml").write_text(to_yaml(load_config("default")))
    rc, heavy, err = _run_light(argv, tmp_path)
    assert (rc, heavy) == (2, []), err[-2000:]
    assert expected in err, err[-2000:]
    assert not (tmp_path / "x").exists()


def test_the_early_model_check_says_what_the_model_loader_says(tmp_path):
    """The CLI's early refusal of a model directory and the loader's (diffrl.models.read_model_index,
    which runs wherever a model loads) give one message."""
    from diffrl.models import read_model_index

    (tmp_path / "empty").mkdir()
    for path in ["/nonexistent/model", "someorg/somemodel", str(tmp_path / "empty")]:
        with pytest.raises(FileNotFoundError) as loader:
            read_model_index(path)
        rc, _, err = _run_light(["train", f"model.path={path}"], tmp_path)
        assert rc == 2 and f"diffrl train: error: {loader.value}" in err, err[-2000:]


def test_the_offline_dpo_preset_sets_rollout_n_itself(tmp_path):
    """`diffrl train offline_dpo data.train_files=[pairs.jsonl]` needs no rollout.n=2; the preset is
    tiny_sd3 with the keys tests/controller/test_direct_preference.py runs offline DPO with."""
    cfg = load_config("offline_dpo", ["data.train_files=[pairs.jsonl]"])
    assert (cfg.rollout.n, cfg.actor.loss.mode, cfg.algorithm.sample_source) == (2, "dpo", "offline")
    by_hand = load_config(
        "tiny_sd3",
        [
            "algorithm.trainer_type=direct_preference",
            "algorithm.sample_source=offline",
            "actor.loss.mode=dpo",
            "rollout.n=2",
            "data.train_files=[pairs.jsonl]",
        ],
    )
    assert cfg == by_hand


def test_help_examples_align_their_descriptions_in_one_column():
    """Each example's description starts in one column, at least two spaces after its command (or
    on the next line when the command is too long), so no description reads as part of a command."""
    from diffrl.cli import EXAMPLES, build_parser

    lines = build_parser().format_help().splitlines()
    columns = set()
    for command, what in EXAMPLES:
        line = next(line for line in lines if line.endswith(what))
        column = line.index(what)
        assert line[column - 2 : column] == "  ", line
        columns.add(column)
        assert any(command in line for line in lines), command
    assert len(columns) == 1, columns
