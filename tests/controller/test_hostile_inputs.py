"""Hostile inputs, second round (issue 32): a FIFO or device where a file belongs, a model directory
whose JSON does not parse, an output place that cannot be written, sizes beyond what the machine
holds. Each is an exit 2 at once, naming the path or key, before any worker starts; no run folder.

The commands run in a thread with a deadline, so one that blocks (the old behaviour on a FIFO)
fails the test instead of hanging it; the FIFO is then given a writer that closes, to end the wait.

An unwritable place and a full disk are conditions the machine must allow (`unwritable_folder`,
`tmpfs`): a case that cannot get its condition skips, or fails under CI (`CI=true`), and the
suite's summary counts these cases and says why any skipped (tests/conftest.py).
"""

import contextlib
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import NoReturn

import pytest

from diffrl.cli import main
from diffrl.controller import run as run_module

FAST = [
    "trainer.total_steps=1",
    "trainer.save_freq=1",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
]
DEADLINE_S = 60.0


@pytest.fixture(autouse=True)
def shared_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path_factory.getbasetemp() / "run_errors_cache"))


@pytest.fixture
def no_workers(monkeypatch):
    def refuse(cfg):
        raise AssertionError("the workers started: the error was found too late")

    monkeypatch.setattr(run_module, "worker_session", refuse)


def _unblock(fifos):
    for fifo in fifos:
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the reader sees end of file


def exit_code(argv, fifos=(), deadline=DEADLINE_S):
    """`diffrl <argv>`'s exit status, failing the test if it has not ended within `deadline`."""
    result = {}
    thread = threading.Thread(target=lambda: result.update(code=main(argv)), daemon=True)
    thread.start()
    thread.join(deadline)
    if thread.is_alive():
        for _ in range(100):
            _unblock(fifos)
            thread.join(0.1)
            if not thread.is_alive():
                break
        pytest.fail(f"diffrl {' '.join(map(str, argv))} was still running after {deadline:g} s (blocked)")
    return result["code"]


def train_refused(tmp_path, capsys, *overrides, source="tiny_sd3", fifos=()):
    argv = [
        "train",
        source,
        f"trainer.output_dir={tmp_path / 'out'}",
        "trainer.run_name=r",
        *FAST,
        *overrides,
    ]
    assert exit_code(argv, fifos) == 2
    assert not (tmp_path / "out" / "r").exists()
    return capsys.readouterr().err


# ------------------------------------------------------------------- (3) non-regular files
def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


@pytest.mark.parametrize(
    "where", ["train_txt", "train_jsonl", "val_parquet", "dev_zero", "config", "index", "component"]
)
def test_a_fifo_or_device_where_a_file_belongs_is_refused_at_once(
    tmp_path, capsys, tiny_model, no_workers, where
):
    overrides, source = [], "tiny_sd3"
    if where in ("train_txt", "train_jsonl", "val_parquet"):
        named = _fifo(
            tmp_path / {"train_txt": "p.txt", "train_jsonl": "p.jsonl", "val_parquet": "p.parquet"}[where]
        )
        key = "data.val_files" if where.startswith("val") else "data.train_files"
        overrides, kind = [f"{key}=[{named}]"], "a FIFO (named pipe)"
    elif where == "dev_zero":
        named = tmp_path / "zero.txt"
        named.symlink_to("/dev/zero")  # endless, a read never ends
        overrides, kind = [f"data.train_files=[{named}]"], "a character device"
    elif where == "config":
        named, kind = _fifo(tmp_path / "run.yaml"), "a FIFO (named pipe)"
        source = str(named)
    else:
        model = tmp_path / "model"
        shutil.copytree(tiny_model("sd3"), model)
        named = model / ("model_index.json" if where == "index" else "scheduler/scheduler_config.json")
        named.unlink()
        _fifo(named)
        overrides, kind = [f"model.path={model}"], "a FIFO (named pipe)"
    err = train_refused(tmp_path, capsys, *overrides, source=source, fifos=[named])
    assert f"{named} is {kind}, not a regular file" in err, err


def test_sample_prompts_file_fifo_is_refused_at_once(tmp_path, capsys, tiny_model):
    fifo = _fifo(tmp_path / "prompts.txt")
    argv = [
        "sample",
        "--model",
        str(tiny_model("sd3")),
        "--prompts-file",
        str(fifo),
        "--out",
        str(tmp_path / "s"),
    ]
    assert exit_code(argv, [fifo]) == 2
    assert f"{fifo} is a FIFO (named pipe), not a regular file" in capsys.readouterr().err


# ------------------------------------------------------------------- (4) broken model JSON
@pytest.mark.parametrize(
    "name",
    ["model_index.json", "transformer/config.json", "scheduler/scheduler_config.json", "vae/config.json"],
)
def test_a_model_json_that_does_not_parse_is_named_with_what_is_wrong(
    tmp_path, capsys, tiny_model, no_workers, name
):
    model = tmp_path / "model"
    shutil.copytree(tiny_model("sd3"), model)
    broken = model / name
    text = broken.read_text()
    cut = text.index(",")  # drop the first comma: "Expecting ',' delimiter"
    broken.write_text(text[:cut] + text[cut + 1 :])
    with pytest.raises(json.JSONDecodeError) as parser:
        json.loads(broken.read_text())
    err = train_refused(tmp_path, capsys, f"model.path={model}")
    where = f"line {parser.value.lineno} column {parser.value.colno}"
    assert f"{broken} is not valid JSON: {parser.value.msg} at {where}" in err, err
    assert "the model directory is damaged" in err


# ------------------------------------------------------------------- conditions a case needs
# Under CI a case whose condition cannot be made fails instead of skipping: a reliability test
# must not pass by not running. Elsewhere it skips; either way it records what it needs, which
# tests/conftest.py's summary counts (the report's user_properties reach pytest-xdist's controller).
UNDER_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
CONDITION = "reliability_condition"  # the user_properties key tests/conftest.py reads


def needs(request, condition: str) -> None:
    request.node.user_properties.append((CONDITION, condition))


def cannot_make(what: str, why: str) -> NoReturn:
    message = f"cannot make {what} here: {why.rstrip('.')}"
    if UNDER_CI:
        pytest.fail(
            f"{message}. Under CI (CI=true) this reliability case must run, not skip: run the job as "
            "root with mount rights (CAP_SYS_ADMIN; a container started with --privileged or --cap-add "
            "SYS_ADMIN)",
            pytrace=False,
        )
    pytest.skip(message)


@contextlib.contextmanager
def tmpfs(path, options: str, what: str):
    """A tmpfs mounted at `path` (made here) with `options` for the block: the one way to a real
    full disk (ENOSPC) here, which needs mount rights (`cannot_make` where they are refused).
    Unmounted lazily, so a process still inside cannot keep it."""
    path.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
        )
        why = mounted.stderr.decode().strip() or f"mount exited {mounted.returncode}"
    except OSError as err:  # no mount command at all
        mounted, why = None, str(err)
    if mounted is None or mounted.returncode:
        cannot_make(what, why)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(disk) -> None:
    """Write to `disk` until it is full, to its last block."""
    with contextlib.suppress(OSError), open(disk / "filler", "wb", buffering=0) as filler:
        while True:
            filler.write(b"x" * 4096)


def making_a_file_fails(folder: Path) -> str | None:
    """The OS's reason (strerror) when no file can be made in `folder`; None when one can (it is
    removed at once)."""
    probe = folder / f".diffrl-test-write-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as err:
        return err.strerror
    os.close(fd)
    os.unlink(probe)
    return None


def mounted_as(path: Path, fstype: str) -> bool:
    """Whether a file system of type `fstype` is mounted at `path` (Linux's /proc/self/mountinfo)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) > 4 and parts[4] == str(path) and rest.split()[:1] == [fstype]:
            return True
    return False


@pytest.fixture
def unwritable_folder(tmp_path, request):
    """(a folder no file can be made in, the OS's reason), by the first way this machine allows;
    none needs a mount on Linux, root included (root writes through permissions, so chmod alone
    would not do for it):
    - /sys where sysfs is mounted there: the kernel makes no file in it for anyone ("Permission
      denied"; "Read-only file system" where it is mounted read-only, as in most containers);
    - for a user other than root, a folder of ours without write permission (chmod 555);
    - a read-only tmpfs (mount rights)."""
    needs(request, "a folder no file can be made in")
    sys_root = Path("/sys")
    reason = making_a_file_fails(sys_root) if mounted_as(sys_root, "sysfs") else None
    if reason:
        yield sys_root, reason
        return
    if os.geteuid() != 0:
        folder = tmp_path / "no_write"
        folder.mkdir()
        folder.chmod(0o555)
        try:
            reason = making_a_file_fails(folder)
            if reason:
                yield folder, reason
                return
        finally:
            folder.chmod(0o755)  # so that pytest can remove it
    with tmpfs(tmp_path / "ro", "ro,size=1m", "a folder no file can be made in (a read-only tmpfs)") as ro:
        yield ro, making_a_file_fails(ro)


# ------------------------------------------------------------------- (5) unwritable outputs
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished")
    env = pytest.MonkeyPatch()
    env.setenv("DIFFRL_CACHE", str(tmp_path_factory.getbasetemp() / "run_errors_cache"))
    assert main(["train", "tiny_sd3", f"trainer.output_dir={out}", "trainer.run_name=done", *FAST]) == 0
    yield out / "done"
    env.undo()


@pytest.fixture
def no_model_loads(monkeypatch, no_workers):
    import diffrl.controller.evaluate
    import diffrl.models
    import diffrl.rollout.generate

    def refuse(*args, **kwargs):
        raise AssertionError("the model loaded: the unwritable output was found too late")

    monkeypatch.setattr(diffrl.models, "load_model", refuse)
    monkeypatch.setattr(diffrl.rollout.generate, "load_model", refuse)
    monkeypatch.setattr(diffrl.controller.evaluate, "worker_session", refuse)


@pytest.mark.parametrize("command", ["train", "sft", "export", "eval", "sample"])
@pytest.mark.parametrize("place", ["unwritable", "a_file", "under_a_file"])
def test_an_unwritable_output_place_is_refused_before_any_work_naming_it(
    tmp_path, capsys, request, finished_run, tiny_model, no_model_loads, command, place
):
    blocker = tmp_path / "taken"
    blocker.write_text("keep me")
    if place == "unwritable":  # a folder no file can be made in, by the first way this machine allows
        folder, reason = request.getfixturevalue("unwritable_folder")
        out = folder / "out"
    else:
        out = {"a_file": blocker, "under_a_file": blocker / "out"}[place]
    argv = {
        "train": ["train", "tiny_sd3", f"trainer.output_dir={out}", *FAST],
        "sft": ["sft", "shapes_sft", f"trainer.output_dir={out}", "trainer.total_steps=1"],
        "export": ["export", str(finished_run), "--out", str(out)],
        "eval": ["eval", str(finished_run), "--out", str(out)],
        "sample": ["sample", "--model", str(tiny_model("sd3")), "--prompt", "a cat", "--out", str(out)],
    }[command]
    assert exit_code(argv) == 2
    err = capsys.readouterr().err
    key = "trainer.output_dir=" if command in ("train", "sft") else "--out "
    why = {
        "unwritable": "cannot be written: making a file in",
        "a_file": "is a file, not a folder",
        "under_a_file": f"lies under {blocker}, which is a file",
    }[place]
    assert f"{key}{str(out)!r} {why}" in err, err
    if place == "unwritable":
        assert f"making a file in {folder} failed ({reason})" in err, err
    assert blocker.read_text() == "keep me"


# ------------------------------------------------------------------- (2) sizes without a bound
@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "rollout.pipeline.num_inference_steps=1000000000",
            "rollout.pipeline.num_inference_steps=1000000000 is more than the 1000 noise levels",
        ),
        (
            "rollout.val.num_inference_steps=1001",
            "rollout.val.num_inference_steps=1001 is more than the 1000 noise levels",
        ),
        (
            "data.prompts_per_step=1000000000",
            "data.prompts_per_step=1000000000 x rollout.n=4 = 4000000000 images per step",
        ),
        ("rollout.val.n=1000000000", "rollout.val.n=1000000000 x "),
        ("model.lora.rank=1000000", "model.lora.rank=1000000 is more than the transformer's width 32"),
        (
            "rollout.pipeline.max_sequence_length=1000000000",
            "rollout.pipeline.max_sequence_length=1000000000 is more text tokens than "
            "StableDiffusion3Pipeline's text encoder takes (512)",
        ),
    ],
)
def test_a_size_beyond_what_the_model_or_machine_holds_exits_2_naming_the_key(
    tmp_path, capsys, no_workers, override, message
):
    """The bound comes from the model's files (1000 timesteps, width 4 x 8 in tiny:sd3's configs)
    or the machine's memory (`os.sysconf`): a billion of anything is refused within the deadline,
    before any worker starts (it used to take the machine's memory, or spin, until killed)."""
    err = train_refused(tmp_path, capsys, override, "trainer.test_freq=1")
    assert message in err, err
    if "images" in message:
        assert "GiB" in err and "more than this machine's" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "1000000000"], "--steps=1000000000 is more than the 1000 noise levels"),
        (["--steps", "1001"], "--steps=1001 is more than the 1000 noise levels"),
        (
            ["--max-sequence-length", "1000000000"],
            "--max-sequence-length=1000000000 is more text tokens than StableDiffusion3Pipeline's "
            "text encoder takes (512): set --max-sequence-length <= 512",
        ),
    ],
)
def test_sample_sizes_beyond_what_the_model_holds_exit_2_before_it_loads(
    tmp_path, capsys, tiny_model, no_model_loads, flags, message
):
    """`diffrl sample` checks its size flags against the model directory's files (tiny:sd3's
    scheduler has 1000 timesteps; SD3's T5 takes 512 tokens, the diffusers pipeline's own check)."""
    model = tiny_model("sd3")
    trained = json.loads((model / "scheduler" / "scheduler_config.json").read_text())["num_train_timesteps"]
    assert trained == 1000
    argv = ["sample", "--model", str(model), "--prompt", "a cat", "--out", str(tmp_path / "s"), *flags]
    assert exit_code(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err


# ----------------------------------------------------- (2b) memory limits: cgroup v1, sample sizes
GIB = 1 << 30
MIB = 1 << 20


@pytest.fixture
def cgroup_v1_8gib(tmp_path, monkeypatch):
    """The probe's machine: 23.5 GiB of physical memory, the process in a cgroup-v1 memory cgroup
    limited to 8 GiB (fake /proc and /sys files under a temporary root), no rlimits."""
    import diffrl.models.memory as memory

    root = tmp_path / "root"
    files = {
        "proc/self/mountinfo": "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n",
        "proc/self/cgroup": "4:memory:/job\n0::/\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
        "sys/fs/cgroup/memory/job/memory.limit_in_bytes": f"{8 * GIB}\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    monkeypatch.setattr(memory, "ROOT", root)
    monkeypatch.setattr(memory, "physical_memory_bytes", lambda: int(23.5 * GIB))
    monkeypatch.setattr(memory, "rlimits", lambda: [])
    return root


def test_a_step_beyond_a_cgroup_v1_limit_is_refused_naming_the_limit(
    tmp_path, capsys, cgroup_v1_8gib, no_workers
):
    """tiny_sd3 at 32x32 (its VAE: 16 latent channels, 8x; window 2) keeps 3*32*32 pixel bytes and
    4*16*4*4 latent bytes x (2*2 + 1) = 8192 bytes an image, x rollout.n=4: 8 GiB holds 262144
    prompts a step. 300000 fit the 23.5 GiB the check used to see."""
    err = train_refused(tmp_path, capsys, "data.prompts_per_step=300000")
    assert "data.prompts_per_step=300000 x rollout.n=4 = 1200000 images" in err, err
    assert "more than this machine's 8.0 GiB (cgroup v1 memory.limit_in_bytes of" in err, err
    assert "set data.prompts_per_step <= 262144" in err, err


# tiny:flux's VAE: block_out_channels [8, 8, 16, 16] (8x), 16 latent channels; float32 on the CPU.
# A sample at H x W keeps its uint8 pixels (3HW bytes) and two fp32 latents (2 x 4 x 16 HW/64 bytes),
# and its decoding holds 4 full-resolution tensors of 8 channels (4 x 8 x HW x 4 bytes): at 1024^2,
# 5 MiB kept and 128 MiB decoding; per pixel, 133 bytes for one sample alone.
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--height", "8192", "--width", "8192"],  # 133 x 8192^2 > 8 GiB; sqrt(8 GiB / 133) = 8036
            "--height 8192 --width 8192: one sample needs at least 8.3 GiB, more than this machine's 8.0 GiB "
            "(cgroup v1 memory.limit_in_bytes of {root}/sys/fs/cgroup/memory/job): pass --height 8032 "
            "--width 8032 or less (the same aspect ratio)",
        ),
        (
            ["-n", "64", "--micro-batch-size", "64", "--height", "1024", "--width", "1024"],
            # (8192 MiB - 64 x 5 MiB) / 128 MiB = 61.5
            "--micro-batch-size 64: decoding 64 of the 64 samples at once needs at least 8.3 GiB, more than "
            "this machine's 8.0 GiB (cgroup v1 memory.limit_in_bytes of {root}/sys/fs/cgroup/memory/job): "
            "pass --micro-batch-size 61 or less",
        ),
        (
            ["-n", "2000", "--height", "1024", "--width", "1024"],  # (8192 - 8 x 128) / 5 = 1433.6
            "-n 2000: 1 prompt(s) x 2000 = 2000 samples need at least 10.8 GiB, more than this machine's 8.0 GiB",
        ),
    ],
    ids=["size", "micro_batch", "n"],
)
def test_sample_beyond_the_memory_limit_exits_2_before_the_model_loads(
    tmp_path, capsys, tiny_model, no_model_loads, cgroup_v1_8gib, flags, message
):
    """The probe's `diffrl sample` runs: 8192^2 printed nothing for 150 s, and 64 samples decoded at
    once at 1024^2 were killed by the kernel after 183 s; both are refused at once, naming the flag,
    the bound and the largest value that fits."""
    model = tiny_model("flux")
    argv = [
        "sample",
        "--model",
        str(model),
        "--prompt",
        "a cat",
        "--out",
        str(tmp_path / "s"),
        "--device",
        "cpu",
    ]
    assert exit_code([*argv, *flags]) == 2
    err = capsys.readouterr().err
    assert message.format(root=cgroup_v1_8gib) in err, err
    if "-n 2000" in message:
        assert "pass -n 1433 or less" in err, err
    assert not (tmp_path / "s").exists()


# ------------------------------------------------------------------- (6) a full disk
@pytest.fixture
def full_disk(tmp_path, request):
    """A tiny tmpfs filled up to its last block."""
    needs(request, "a full disk")
    with tmpfs(tmp_path / "disk", "size=256k", "a full disk (a tmpfs)") as disk:
        fill(disk)
        yield disk


def test_a_fresh_run_on_a_full_disk_says_so_and_leaves_no_folder(tmp_path, capsys, full_disk, no_workers):
    out = full_disk / "runs"
    assert exit_code(["train", "tiny_sd3", f"trainer.output_dir={out}", "trainer.run_name=r", *FAST]) == 2
    err = capsys.readouterr().err
    assert "the disk is full (No space left on device)" in err and "Traceback" not in err, err
    assert not (out / "r").exists(), sorted(p.name for p in (out / "r").iterdir())


def test_a_save_on_a_full_disk_says_so_keeps_the_logged_step_and_leaves_no_temporary_folder(
    tmp_path, capsys, monkeypatch
):
    import errno

    import diffrl.train.checkpoint as checkpoint

    write, calls = checkpoint._write_durable, []

    def fills_up(path, data):  # the disk fills while the second checkpoint's metadata is written
        if str(path).endswith("meta.json"):
            calls.append(path)
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return write(path, data)

    monkeypatch.setattr(checkpoint, "_write_durable", fills_up)
    argv = [
        "train",
        "tiny_sd3",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=r",
        *FAST,
        "trainer.total_steps=2",
    ]
    assert exit_code(argv) == 2
    captured = capsys.readouterr()
    assert (
        "the disk is full (No space left on device) writing" in captured.err
        and "Traceback" not in captured.err
    )
    assert "no steps logged" not in captured.out
    run = tmp_path / "r"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000001"]  # no .tmp-step_*
    from diffrl.telemetry import read_metrics

    assert sorted(read_metrics(run / "metrics.jsonl")) == [1, 2]  # the trained step is logged
    assert not (run / "summary.json").exists()  # written only when a run ends whole


@pytest.fixture
def small_disk(tmp_path, request):
    """A 16 MiB tmpfs (room for a tiny run), and a function that fills it to its last block."""
    needs(request, "a disk to fill")
    with tmpfs(tmp_path / "small_disk", "size=16m", "a disk to fill (a tmpfs)") as disk:
        yield disk, lambda: fill(disk)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_resume_on_a_full_disk_says_so_and_changes_nothing(tmp_path, capsys, small_disk):
    """Issue 32, item 6: a resume (trainer.resume=auto) on a full disk ended in a traceback. It is an
    exit 2 saying the disk is full, where, and that what was there is intact; every file of the
    run (summary.json, metrics.jsonl, config.yaml, the checkpoint) is byte-identical afterwards."""
    disk, fill = small_disk
    out = disk / "runs"
    argv = [
        "train",
        "tiny_sd3",
        f"trainer.output_dir={out}",
        "trainer.run_name=r",
        "trainer.loggers=[jsonl]",
        *FAST,
    ]
    assert exit_code(argv) == 0
    run = out / "r"
    assert (run / "summary.json").is_file() and (run / "checkpoints" / "step_00000001").is_dir()
    before = _tree(run)
    fill()
    capsys.readouterr()
    assert exit_code([*argv, "trainer.total_steps=2", "trainer.resume=auto"]) == 2
    err = capsys.readouterr().err
    assert "the disk is full (No space left on device) writing" in err and "Traceback" not in err, err
    assert str(run) in err, err  # where
    assert "intact" in err, err  # what was kept
    after = _tree(run)
    assert sorted(after) == sorted(before), set(after) ^ set(before)  # no .tmp-*, no new file
    changed = [name for name in before if before[name] != after[name]]
    assert changed in ([], [".lock"]), changed  # the lock holds the PID of whoever owns the folder


# ------------------------------------------------------------------- a reward that fails at once
FAILING_REWARDS = """
import torch


def not_finite(pixels, prompts, metadata):
    return torch.full((len(prompts),), float("nan"))


def raises(pixels, prompts, metadata):
    return 1 / 0
"""


@pytest.mark.parametrize(
    ("reward", "settings", "said"),
    [
        # in the first step (no validation before it)
        ("not_finite", FAST, "returned non-finite scores for samples [0, 1, 2, 3"),
        # in the validation before the first step
        (
            "raises",
            ["trainer.total_steps=1"],
            "ZeroDivisionError: division by zero (raised at {file}:10 in raises)",
        ),
    ],
    ids=["nan-in-step-1", "raises-in-validation"],
)
def test_a_failing_reward_with_the_start_check_off_exits_2_naming_it_and_leaves_no_run_folder(
    tmp_path, capsys, monkeypatch, reward, settings, said
):
    """Issue 55: with trainer.check_at_start=false, a required reward that returns NaN or raises
    ended the run with exit 1, a traceback, and an empty run folder left behind (its config.yaml
    was written, so the failed start counted as a run). A failure before the run logs its first
    record removes the folder it made, and `latest` names the run it named before."""
    module = tmp_path / f"failing_rewards_{reward}.py"  # one name each: Python keeps what it imported
    module.write_text(FAILING_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    (out / "earlier").mkdir(parents=True)
    (out / "latest").symlink_to("earlier")
    argv = [
        "train",
        "tiny_sd3",
        f"trainer.output_dir={out}",
        "trainer.run_name=r",
        "trainer.check_at_start=false",
        f"reward.functions.python.args.function={module.stem}:{reward}",
        *settings,
    ]
    assert exit_code(argv) == 2
    err = capsys.readouterr().err
    assert "error: required reward 'python' failed" in err and "Traceback" not in err, err
    assert said.format(file=module) in err, err
    assert "reward.functions.python.required=false" in err  # the fix
    assert sorted(p.name for p in out.iterdir()) == ["earlier", "latest"]
    assert os.readlink(out / "latest") == "earlier"
