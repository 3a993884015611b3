"""Every user error of `diffrl train` / `diffrl eval` exits 2 before any model loads, with a message
naming the value and the fix, and leaves no run folder behind (or an existing run untouched)."""

import json
import os
import shutil
import socket
import sys

import pytest

from diffrl.cli import main
from diffrl.controller import run as run_module
from diffrl.controller import run_folder

FAST = [
    "trainer.total_steps=1",
    "trainer.save_freq=1",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
]


@pytest.fixture(autouse=True)
def shared_cache(tmp_path_factory, monkeypatch):
    """One tiny-model cache for the module: building tiny:sd3 once is the slow part."""
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path_factory.getbasetemp() / "run_errors_cache"))


def train(tmp_path, *overrides, name="r"):
    return main(
        ["train", "tiny_sd3", f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}", *overrides]
    )


def refused(tmp_path, capsys, *overrides, name="r"):
    """Run, expect exit 2 and no run folder; return stderr."""
    assert train(tmp_path, *overrides, name=name) == 2
    err = capsys.readouterr().err
    assert not (tmp_path / name).exists(), sorted(p.name for p in (tmp_path / name).iterdir())
    return err


# ---------------------------------------------------------------------------- (4) prompt size
def test_a_line_without_newlines_is_refused_naming_file_line_and_limit(tmp_path, capsys):
    data = tmp_path / "huge.txt"
    data.write_bytes(b"a red circle\n" + b"x" * (2 << 20))  # a 2 MB second line
    err = refused(tmp_path, capsys, f"data.train_files=[{data}]")
    assert f"{data}:2: the line is longer than 1048576 bytes" in err and "MAX_ROW_BYTES" in err


def test_a_prompt_longer_than_the_limit_is_refused(tmp_path, capsys):
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"prompt": "a cat"}) + "\n" + json.dumps({"prompt": "b" * 12000}) + "\n")
    err = refused(tmp_path, capsys, f"data.train_files=[{data}]")
    assert f"{data}:2: the prompt 'prompt' has 12000 characters, more than the limit of 10000" in err


# ------------------------------------------------------------------------ (8) inputs and config
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor.optim.lr=inf", "actor.optim.lr=inf is invalid: must be a finite number"),
        ("actor.optim.betas=[0.9,nan]", "actor.optim.betas[1]=nan is invalid"),
        ("rollout.pipeline.height=40", "rollout.pipeline.height=40 does not fit the model"),
        ("rollout.pipeline.width=288", "multiples of 16 (VAE factor 8 x patch 2) and at most 256"),
        ("reward.functions.http.args.url=ftp://nowhere", "url='ftp://nowhere' is invalid"),
        ("trainer.loggers=[console,wandb]", "pip install wandb"),
    ],
)
def test_bad_values_exit_2_before_any_model_loads(tmp_path, capsys, monkeypatch, override, message):
    monkeypatch.setitem(sys.modules, "wandb", None)  # find_spec -> None: wandb "not installed"
    monkeypatch.setattr(run_module, "worker_session", _no_workers)
    err = refused(tmp_path, capsys, override)
    assert message in err, err


def _no_workers(cfg, plan=None):
    raise AssertionError("the workers started: the error was found too late")


def test_run_name_cannot_leave_the_output_dir(tmp_path, capsys):
    out = tmp_path / "a" / "b"
    assert main(["train", "tiny_sd3", f"trainer.output_dir={out}", "trainer.run_name=../../x"]) == 2
    assert "trainer.run_name='../../x' is invalid: must be a plain folder name" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not out.exists()


def test_unreachable_scorer_is_found_in_seconds(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run_module, "worker_session", _no_workers)
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    err = refused(tmp_path, capsys, f"reward.functions.http.args.url=http://127.0.0.1:{port}")
    assert f"the scorer at args.url='http://127.0.0.1:{port}' did not answer /health" in err
    assert "diffrl serve-reward" in err


def test_damaged_model_weights_are_found_before_loading(tmp_path, capsys, tiny_model, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(tiny_model("sd3"), model)
    weights = model / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(os.urandom(4096))
    monkeypatch.setattr(run_module, "worker_session", _no_workers)
    err = refused(tmp_path, capsys, f"model.path={model}")
    assert f"{weights} is not a readable safetensors file" in err


def test_a_bad_resume_checkpoint_is_refused(tmp_path, capsys, monkeypatch):
    junk = tmp_path / "junk" / "step_00000001"
    junk.mkdir(parents=True)
    (junk / "model.safetensors").write_bytes(b"not a checkpoint")
    monkeypatch.setattr(run_module, "worker_session", _no_workers)
    err = refused(tmp_path, capsys, f"trainer.resume={junk}")
    assert str(junk) in err and "incomplete" in err


def test_eval_out_must_be_a_folder(tmp_path, capsys):
    out = tmp_path / "eval.json"
    out.write_text("{}")
    assert main(["eval", "toy:shapes", "--out", str(out)]) == 2
    assert f"--out {str(out)!r} is a file" in capsys.readouterr().err
    assert out.read_text() == "{}"


# ------------------------------------------------------------------- (6) (7) an existing run
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A one-step run with its checkpoint (built once; tests copy it)."""
    out = tmp_path_factory.mktemp("finished")
    env = pytest.MonkeyPatch()  # module-scoped: the function-scoped monkeypatch cannot serve here
    env.setenv("DIFFRL_CACHE", str(tmp_path_factory.getbasetemp() / "run_errors_cache"))
    assert main(["train", "tiny_sd3", f"trainer.output_dir={out}", "trainer.run_name=done", *FAST]) == 0
    yield out / "done"
    env.undo()


def snapshot(run_dir):
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def test_a_failed_resume_leaves_the_run_as_it_was(tmp_path, capsys, finished_run, monkeypatch):
    run_dir = tmp_path / "done"
    shutil.copytree(finished_run, run_dir)
    before = snapshot(run_dir)
    monkeypatch.setattr(run_module, "worker_session", _no_workers)
    assert train(tmp_path, *FAST, "trainer.total_steps=2", "model.lora.rank=8", name="done") == 2
    err = capsys.readouterr().err
    assert "was saved with model.lora.rank=4" in err and "set model.lora.rank=4" in err
    assert snapshot(run_dir) == before  # config.yaml, metrics.jsonl, checkpoints: untouched
    monkeypatch.undo()
    # and the run is still usable: its config still describes its checkpoint
    from diffrl.controller.evaluate import resolve_target

    cfg, checkpoint, _ = resolve_target(str(run_dir), [])
    assert cfg.model.lora.rank == 4 and checkpoint.name == "step_00000001"


def test_a_resume_with_other_lora_target_modules_is_refused_at_start(
    tmp_path, capsys, finished_run, monkeypatch
):
    """Issue 51, probe 5: other model.lora.target_modules failed only inside the worker's load, as a
    worker traceback after the run had started. The run's own list (the family's default, null in
    the config) and the same list written out both resume; any other is exit 2 naming both, before
    trainer.check_at_start's check (which loads the model and samples) runs."""
    run_dir = tmp_path / "done"
    shutil.copytree(finished_run, run_dir)
    before = snapshot(run_dir)
    monkeypatch.setattr(run_module, "worker_session", _no_workers)
    assert (
        train(tmp_path, *FAST, "trainer.total_steps=2", "model.lora.target_modules=[to_q,to_k]", name="done")
        == 2
    )
    printed = capsys.readouterr()
    err = printed.err
    assert "was saved with LoRA on ['attn.add_k_proj'" in err and "this config adapts ['to_k', 'to_q']" in err
    # refused from the checkpoint's small files before the start-up check loads the model (re-probe)
    assert "setup check (diffrl check --quick)" not in printed.out + printed.err
    assert "set model.lora.target_modules=[attn.add_k_proj," in err
    assert snapshot(run_dir) == before
    from diffrl.models.sd3 import SD3Adapter

    same = ",".join(reversed(SD3Adapter.default_lora_target_modules))  # the default, in another order
    with pytest.raises(AssertionError, match="the workers started"):  # accepted: it goes on to start them
        train(tmp_path, *FAST, "trainer.total_steps=2", f"model.lora.target_modules=[{same}]", name="done")


def test_a_run_folder_in_use_is_refused_naming_the_pid(tmp_path, capsys, finished_run, monkeypatch):
    run_dir = tmp_path / "done"
    shutil.copytree(finished_run, run_dir)
    before = snapshot(run_dir)
    holder = run_folder._lock(run_dir)  # another run owns the folder (flock: per open file)
    try:
        monkeypatch.setattr(run_module, "worker_session", _no_workers)
        assert train(tmp_path, *FAST, "trainer.total_steps=2", name="done") == 2
    finally:
        os.close(holder)
    err = capsys.readouterr().err
    assert f"run folder {run_dir} is in use by another run (PID {os.getpid()})" in err
    assert snapshot(run_dir) == before  # metrics.jsonl not truncated


def test_a_failed_start_after_creating_the_folder_removes_it(tmp_path, capsys, monkeypatch):
    def broken_workers(cfg, plan=None):
        raise ValueError("workers could not start: fix X")

    monkeypatch.setattr(run_module, "worker_session", broken_workers)
    assert "fix X" in refused(tmp_path, capsys, *FAST)


def test_a_start_whose_folder_is_removed_under_its_lock_starts_over(tmp_path, monkeypatch):
    """The race of a failed first start: start B opens and locks RUN/.lock just as start A (which
    made the folder and failed) removes it. B must not run in a vanished folder: it notices the
    file it locked is gone, makes the folder again, and locks the new file."""
    run_dir = tmp_path / "r"
    real_lock = run_folder._lock
    calls = []

    def lock_then_lose_the_folder(path):
        fd = real_lock(path)
        calls.append(path)
        if len(calls) == 1:
            shutil.rmtree(path)  # A's cleanup, between B's lock and B's check
        return fd

    monkeypatch.setattr(run_folder, "_lock", lock_then_lose_the_folder)
    fd, created = run_folder._create_and_lock(run_dir)
    try:
        assert len(calls) == 2 and created  # the second round made the folder again
        held, current = os.fstat(fd), os.stat(run_dir / run_folder.LOCK_FILE)
        assert (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino)
        with pytest.raises(ValueError, match="in use by another run"):
            real_lock(run_dir)  # and that file is the one locked
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- non-finite steps
def test_consecutive_non_finite_steps_stop_the_run(tmp_path, capsys):
    # lr=1e30 sends the weights to inf in the first optimizer step; every later loss is nan.
    code = train(
        tmp_path, *FAST, "trainer.total_steps=4", "actor.optim.lr=1e30", "trainer.max_nonfinite_steps=2"
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "step 2: actor/loss=nan" in err and "trainer.max_nonfinite_steps=2" in err
    steps = [json.loads(line)["step"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert set(steps) == {1}  # the failing step is neither logged nor checkpointed as if it were fine
    assert [p.name for p in (tmp_path / "r" / "checkpoints").iterdir()] == ["step_00000001"]


def test_a_scorer_that_answers_health_with_an_error_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    from diffrl.rewards.server import start_reward_server

    monkeypatch.setattr(run_module, "worker_session", _no_workers)
    with start_reward_server("jpeg_compressibility") as server:  # a wrong path: HTTP 404, not a 200
        err = refused(tmp_path, capsys, f"reward.functions.http.args.url={server.url}/wrong")
    assert "answered /health, but not with its status" in err and "HTTP 404" in err, err
    assert "Traceback" not in err and "start it" not in err


@pytest.mark.parametrize("token_env", [None, "WRONG_SCORER_TOKEN"])
def test_a_scorer_that_refuses_the_token_is_reported_as_a_token_error(
    tmp_path, capsys, monkeypatch, token_env
):
    """Issue 55: a 401 from the scorer read "did not answer /health ... start it"."""
    from diffrl.rewards.server import start_reward_server

    monkeypatch.setattr(run_module, "worker_session", _no_workers)
    monkeypatch.setenv("WRONG_SCORER_TOKEN", "not-the-servers-token")
    overrides = [] if token_env is None else [f"reward.functions.http.args.token_env={token_env}"]
    with start_reward_server("jpeg_compressibility", token="the-servers-token") as server:
        err = refused(tmp_path, capsys, f"reward.functions.http.args.url={server.url}", *overrides)
    assert "HTTP 401" in err and "start it" not in err and "did not answer" not in err, err
    if token_env is None:
        assert "requires a token and this client sends none: set args.token_env" in err, err
    else:
        assert (
            "token in the environment variable WRONG_SCORER_TOKEN (args.token_env) is not the server" in err
        ), err


def _kept_checkpoints(root, *steps):
    """Step directories that `complete_checkpoints` lists (the marker and meta.json a save writes)."""
    from diffrl.train.checkpoint import COMPLETE_MARKER, step_dir

    for step in steps:
        path = step_dir(root, step)
        path.mkdir(parents=True)
        (path / COMPLETE_MARKER).write_text("")
        (path / "meta.json").write_text(json.dumps({"step": step}))
    return [step_dir(root, step) for step in steps]


def test_a_resume_past_total_steps_is_refused_naming_the_checkpoint_that_fits(tmp_path):
    """`diffrl sft shapes_sft trainer.total_steps=3500` after a run stopped past 4000 would train
    nothing and export step 4000's weights under the 3500 the user asked for."""
    from diffrl.config import ConfigError, load_config

    early, late = _kept_checkpoints(tmp_path / "checkpoints", 3500, 4000)
    cfg = load_config("tiny_sd3", ["trainer.total_steps=3500"])
    with pytest.raises(ConfigError) as refused_resume:
        run_folder._check_not_past_total(cfg, late)
    message = str(refused_resume.value)
    assert "trainer.total_steps=3500 is below step 4000" in message and f"trainer.resume={early}" in message
    run_folder._check_not_past_total(cfg, early)  # the step itself resumes (and exports) as it should
    lone = _kept_checkpoints(tmp_path / "other", 4000)[0]
    with pytest.raises(ConfigError, match="start a new run"):
        run_folder._check_not_past_total(cfg, lone)


def test_a_worker_failure_is_one_line_on_the_console_and_whole_in_console_log(tmp_path, capsys, monkeypatch):
    """Issue 51, probe 8: a worker's failure printed its remote traceback (and this process's) on
    the console. Now one line names the worker, the method and the cause, and RUN/console.log holds
    the tracebacks. The failure comes in the third optimizer step (step 2 or 3 of the run: one or
    two a step), after the run has recorded step 1."""
    from diffrl.train.engine import TrainEngine

    real, calls = TrainEngine.optim_step, []

    def fails_later(self):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("planted failure in the optimizer step")
        return real(self)

    monkeypatch.setattr(TrainEngine, "optim_step", fails_later)
    assert train(tmp_path, *FAST, "trainer.total_steps=4", name="failing") == 1
    err = capsys.readouterr().err.strip().splitlines()
    log = tmp_path / "failing" / "console.log"
    assert err[-1].startswith("diffrl train: worker rank 0 (of 1) failed in ")
    assert err[-1].endswith(
        f"RuntimeError: planted failure in the optimizer step (its traceback and last log lines: {log})"
    )
    assert not any("Traceback" in line for line in err)
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "in fails_later" in text


def test_a_model_config_that_declares_more_memory_than_the_machine_is_refused(tmp_path, capsys, tiny_model):
    """Issue 51, probe 1: a transformer config declaring a huge position-embedding table made the
    load allocate 320 GB and die with an allocator traceback. The components are built on the meta
    device from their configs first; one past the process's memory (and its weight files) is exit 2
    naming the file and the tensor. A sane model passes (every other run here)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model("sd3"), model)
    config = model / "transformer" / "config.json"
    values = json.loads(config.read_text())
    values["pos_embed_max_size"] = 200_000  # (200,000²) patches x 32 channels of fp32: 4.8 TiB
    config.write_text(json.dumps(values))
    err = refused(tmp_path, capsys, f"model.path={model}")
    assert f"{config} declares a SD3Transformer2DModel of 4,768.4 GiB" in err
    assert "pos_embed.pos_embed, has shape [1, 40000000000, 32]" in err and "Traceback" not in err
