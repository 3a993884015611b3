"""Checkpoints never execute code and damaged ones are caught: a pickle payload planted in any file of a
checkpoint never runs, a truncated or altered file is named, resume=auto skips a damaged newest checkpoint,
and checkpoints of the old pickling format (torch.distributed.checkpoint) are refused unread."""

from __future__ import annotations

import builtins
import hashlib
import json
import logging
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from peft import LoraConfig

import diffrl.train.checkpoint as checkpoint
from diffrl.cli import main
from diffrl.config import load_config, to_yaml
from diffrl.controller.run import find_checkpoint
from diffrl.models import load_model
from diffrl.models.sd3 import SD3Adapter
from diffrl.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, step_dir

# Every kind of file a checkpoint with an optimizer and a scheduler holds: the payload test must cover each.
KINDS = {
    "manifest.json",
    "complete",
    "meta.json",
    "extra.json",
    "optim.json",
    "scheduler.json",
    "rng/rank_00000.json",
    "model/shard-00001-model-00001-of-00001.safetensors",
    "optim/shard-00001-model-00001-of-00001.safetensors",
}


class Payload:
    """Unpickling this creates `marker`: the stand-in for `os.system(...)` in a crafted checkpoint."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.open, (self.marker, "w"))


def _payload_bytes(marker: Path, as_torch_save: bool = False) -> bytes:
    if as_torch_save:
        path = marker.parent / "payload.pt"
        torch.save(Payload(marker), path)
        data = path.read_bytes()
        path.unlink()
        return data
    return pickle.dumps(Payload(marker))


def test_the_payload_runs_when_unpickled(tmp_path):
    """The payload is live: were any loader to unpickle it, the marker would appear."""
    marker = tmp_path / "ran"
    pickle.loads(_payload_bytes(marker)).close()
    assert marker.exists()
    marker.unlink()
    torch.load(_reader(_payload_bytes(marker, as_torch_save=True)), weights_only=False).close()
    assert marker.exists()


def _reader(data: bytes):
    import io

    return io.BytesIO(data)


def _transformer(tiny_dir, seed=0):
    transformer = load_model(tiny_dir, dtype="float32").transformer
    torch.manual_seed(seed)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=list(SD3Adapter.default_lora_target_modules),
        init_lora_weights="gaussian",
    )
    transformer.add_adapter(config, adapter_name="default")
    transformer.set_adapter("default")
    return transformer


def _optim(transformer):
    optimizer = torch.optim.AdamW([p for p in transformer.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    return optimizer, scheduler


def _train_step(transformer, optimizer, scheduler):
    g = torch.Generator().manual_seed(0)
    out = transformer(
        hidden_states=torch.randn(1, 16, 8, 8, generator=g),
        encoder_hidden_states=torch.randn(1, 6, 64, generator=g),
        pooled_projections=torch.randn(1, 48, generator=g),
        timestep=torch.tensor([500.0]),
        return_dict=False,
    )[0]
    out.pow(2).mean().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def saved(tiny_model, tmp_path_factory):
    """A checkpoint root with two intact checkpoints (steps 1 and 2), and the adapter weights of each."""
    tiny = tiny_model("sd3")
    root = tmp_path_factory.mktemp("ckpt")
    transformer = _transformer(tiny)
    optimizer, scheduler = _optim(transformer)
    weights = {}
    for step in (1, 2):
        _train_step(transformer, optimizer, scheduler)
        save_checkpoint(
            root,
            step,
            model=transformer,
            optimizer=optimizer,
            scheduler=scheduler,
            trainable_only=True,
            extra={"step": step},
        )
        weights[step] = {k: v.clone() for k, v in transformer.state_dict().items() if ".lora_" in k}
    return tiny, root, weights


def _copy(saved, tmp_path) -> Path:
    _, root, _ = saved
    copy = tmp_path / "checkpoints"
    shutil.copytree(root, copy)
    return copy


def _load(tiny, path, seed=5):
    transformer = _transformer(tiny, seed=seed)
    optimizer, scheduler = _optim(transformer)
    extra = load_checkpoint(
        path, model=transformer, optimizer=optimizer, scheduler=scheduler, trainable_only=True
    )
    return extra, transformer


def _forge_manifest(path: Path, name: str) -> None:
    """What an attacker who also rewrites the manifest would do: make it (and the marker) match `name`."""
    manifest = json.loads((path / "manifest.json").read_bytes())
    data = (path / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    raw = json.dumps(manifest).encode()
    (path / "manifest.json").write_bytes(raw)
    (path / "complete").write_text(hashlib.sha256(raw).hexdigest() + "\n")


def test_a_valid_checkpoint_loads_without_any_unpickling(saved, monkeypatch):
    tiny, root, weights = saved

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load unpickled something")

    for module, name in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(module, name, refuse)
    extra, transformer = _load(tiny, step_dir(root, 2))
    assert extra == {"step": 2}
    state = transformer.state_dict()
    assert all(torch.equal(state[k], v) for k, v in weights[2].items())


@pytest.mark.parametrize("forge_manifest", [False, True], ids=["payload", "payload+forged-manifest"])
def test_a_pickle_payload_in_any_file_never_runs(saved, tmp_path, forge_manifest):
    tiny, root, _ = saved
    original = step_dir(root, 2)
    names = {p.relative_to(original).as_posix() for p in original.rglob("*") if p.is_file()}
    assert names == KINDS  # every file of the checkpoint is attacked below
    marker = tmp_path / "payload_ran"
    for name in sorted(names):
        path = tmp_path / name.replace("/", "_") / original.name
        shutil.copytree(original, path)
        (path / name).write_bytes(_payload_bytes(marker, as_torch_save=name.endswith(".safetensors")))
        if forge_manifest and name not in ("manifest.json", "complete"):
            _forge_manifest(path, name)
        shown = "manifest.json" if name == "complete" else name  # the marker vouches for the manifest
        with pytest.raises(ValueError, match=rf"{shown}.*(damaged|not written by diffrl)") as err:
            _load(tiny, path)
        assert isinstance(err.value, checkpoint.CheckpointError)
        assert not marker.exists(), f"the payload in {name} ran"


@pytest.mark.parametrize(
    ("extra_file", "as_torch_save"),
    [(".metadata", False), ("model.pt", True), ("rng/rank_00000.pt", True), ("optim/__0_0.distcp", True)],
)
@pytest.mark.parametrize("forge_manifest", [False, True], ids=["planted", "planted+forged-manifest"])
def test_an_extra_pickle_file_is_refused_unread(saved, tmp_path, extra_file, as_torch_save, forge_manifest):
    tiny, root, _ = saved
    path = tmp_path / "step_00000002"
    shutil.copytree(step_dir(root, 2), path)
    marker = tmp_path / "payload_ran"
    (path / extra_file).write_bytes(_payload_bytes(marker, as_torch_save=as_torch_save))
    if forge_manifest:
        _forge_manifest(path, extra_file)
        expected = rf"lists '{extra_file}', which is not a file diffrl writes"
    else:
        expected = rf"manifest does not list: \['{extra_file}'\].*never unpickle"
    with pytest.raises(ValueError, match=expected):
        _load(tiny, path)
    assert not marker.exists()


def test_truncated_or_altered_tensor_file_is_named_and_the_model_is_untouched(saved, tmp_path):
    tiny, root, _ = saved
    name = "model/shard-00001-model-00001-of-00001.safetensors"
    for damage in ("truncate", "flip"):
        path = tmp_path / damage / "step_00000002"
        shutil.copytree(step_dir(root, 2), path)
        data = bytearray((path / name).read_bytes())
        if damage == "truncate":
            (path / name).write_bytes(data[:-100])
            expected = rf"'{name}' has {len(data) - 100} bytes, its manifest says {len(data)}"
        else:
            data[-10] ^= 0x01  # one bit of one weight: same size, other content
            (path / name).write_bytes(data)
            expected = rf"'{name}': its sha256 differs from the manifest's"
        transformer = _transformer(tiny, seed=5)
        before = {k: v.clone() for k, v in transformer.state_dict().items()}
        with pytest.raises(ValueError, match=expected):
            load_checkpoint(path, model=transformer, optimizer=None, scheduler=None, trainable_only=True)
        assert all(torch.equal(v, before[k]) for k, v in transformer.state_dict().items())


def test_missing_file_is_named(saved, tmp_path):
    tiny, root, _ = saved
    path = tmp_path / "step_00000002"
    shutil.copytree(step_dir(root, 2), path)
    (path / "rng" / "rank_00000.json").unlink()
    with pytest.raises(ValueError, match=r"missing 'rng/rank_00000.json' \(listed in its manifest\)"):
        _load(tiny, path)


def _cfg(resume: str):
    return load_config("tiny_sd3", [f"trainer.resume={resume}"])


def test_resume_auto_skips_a_damaged_newest_checkpoint_and_says_so(
    saved, tmp_path, caplog, capsys, monkeypatch
):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    tiny, _, weights = saved
    run_dir = tmp_path / "run"
    checkpoints = _copy(saved, run_dir)
    name = "optim/shard-00001-model-00001-of-00001.safetensors"
    data = bytearray((step_dir(checkpoints, 2) / name).read_bytes())
    data[-1] ^= 0xFF
    (step_dir(checkpoints, 2) / name).write_bytes(data)

    with caplog.at_level(logging.WARNING, logger="diffrl.train.checkpoint"):
        found = find_checkpoint(_cfg("auto"), run_dir)
    assert found == step_dir(checkpoints, 1)
    assert f"skipping checkpoint {step_dir(checkpoints, 2)}" in caplog.text
    assert f"'{name}': its sha256 differs" in caplog.text
    extra, transformer = _load(tiny, found)
    assert extra == {"step": 1}
    state = transformer.state_dict()
    assert all(torch.equal(state[k], v) for k, v in weights[1].items())

    # Named explicitly, the damaged checkpoint is an error (exit 2), not a silent fallback.
    args = [
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=run",
        f"trainer.resume={step_dir(checkpoints, 2)}",
    ]
    assert main(["train", "tiny_sd3", *args]) == 2
    err = capsys.readouterr().err
    assert f"failed verification: '{name}'" in err and "Traceback" not in err

    # With every checkpoint damaged, resume=auto stops instead of starting over.
    (step_dir(checkpoints, 1) / "extra.json").write_text('{"step": 1000}')
    with pytest.raises(
        ValueError, match=r"no checkpoint in .* verifies: step_00000002: .*step_00000001: .*extra.json"
    ):
        find_checkpoint(_cfg("auto"), run_dir)


def _legacy_checkpoint(path: Path, tiny, marker: Path) -> None:
    """A real format-1 checkpoint (DCP's FileSystemWriter) whose pickled .metadata carries the payload."""
    import torch.distributed.checkpoint as dcp

    state = {"model": {k: v for k, v in _transformer(tiny).state_dict().items() if ".lora_" in k}}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    assert (path / ".metadata").is_file() and list(path.glob("*.distcp"))
    (path / ".metadata").write_bytes(_payload_bytes(marker))
    (path / "meta.json").write_text(json.dumps({"format_version": 1, "trainable_only": True}))
    (path / "complete").write_text("1\n")


def test_old_dcp_checkpoints_are_refused_unread(saved, tmp_path, caplog):
    tiny, _, _ = saved
    marker = tmp_path / "payload_ran"
    checkpoints = tmp_path / "run" / "checkpoints"
    legacy = step_dir(checkpoints, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's own "no process group" warning
        _legacy_checkpoint(legacy, tiny, marker)
    with pytest.raises(
        ValueError, match=r"older diffrl \(format 1, torch.distributed.checkpoint\).*Re-train"
    ):
        _load(tiny, legacy)
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match=r"no checkpoint .* verifies"):
        latest_checkpoint(checkpoints)
    assert "format 1" in caplog.text
    assert not marker.exists()


def test_eval_of_a_damaged_checkpoint_exits_2_with_a_message(saved, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    checkpoints = _copy(saved, run_dir)
    (run_dir / "config.yaml").write_text(to_yaml(load_config("tiny_sd3", [f"trainer.output_dir={tmp_path}"])))
    marker = tmp_path / "payload_ran"
    target = step_dir(checkpoints, 2)
    (target / "scheduler.json").write_bytes(_payload_bytes(marker))

    assert main(["eval", str(target)]) == 2
    err = capsys.readouterr().err
    assert "scheduler.json" in err and "damaged" in err and "Traceback" not in err
    assert not marker.exists()


# A forged manifest vouches for these contents; each parses (or not) and does not fit what a load reads.
FORGED_JSON = [
    ("rng/rank_00000.json", None),  # a pickle payload: not JSON at all
    ("optim.json", None),
    ("extra.json", None),
    ("scheduler.json", None),
    ("rng/rank_00000.json", {"python": {"version": 3}, "numpy": {}, "torch": [1, 2]}),
    ("rng/rank_00000.json", [1, 2, 3]),
    ("optim.json", {"tensors": {"w": "exp_avg"}, "scalars": {}, "param_groups": [{}]}),
    ("optim.json", {"tensors": {}, "scalars": {}, "param_groups": "all"}),
    ("extra.json", {"step": 1000}),
    ("extra.json", {"step": 2, "data": {"epoch": 0, "position": -1, "num_records": 4}}),  # issue 55
]


@pytest.mark.parametrize(
    ("name", "content"), FORGED_JSON, ids=[f"{n}-{i}" for i, (n, _) in enumerate(FORGED_JSON)]
)
def test_a_forged_checkpoint_whose_json_does_not_parse_or_fit_fails_verification(
    saved, tmp_path, capsys, caplog, monkeypatch, name, content
):
    """Parse errors are verification failures: `verify_checkpoint` names the file (no model, no
    worker), `trainer.resume=auto` falls back to the previous checkpoint, an explicit path and
    `diffrl eval` of it exit 2; the payload never runs."""
    import diffrl.controller.evaluate
    import diffrl.controller.run as run_module

    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    checkpoints = _copy(saved, run_dir)
    (run_dir / "config.yaml").write_text(to_yaml(load_config("tiny_sd3", [f"trainer.output_dir={tmp_path}"])))
    target = step_dir(checkpoints, 2)
    marker = tmp_path / "payload_ran"
    data = _payload_bytes(marker) if content is None else json.dumps(content).encode()
    (target / name).write_bytes(data)
    _forge_manifest(target, name)

    with pytest.raises(checkpoint.CheckpointError, match=rf"{name}.*damaged"):
        checkpoint.verify_checkpoint(target)

    with caplog.at_level(logging.WARNING, logger="diffrl.train.checkpoint"):
        assert find_checkpoint(_cfg("auto"), run_dir) == step_dir(checkpoints, 1)
    assert f"skipping checkpoint {target}" in caplog.text and name in caplog.text

    def no_workers(cfg):
        raise AssertionError("the workers started: the damage was found too late")

    monkeypatch.setattr(run_module, "worker_session", no_workers)
    monkeypatch.setattr(diffrl.controller.evaluate, "worker_session", no_workers)
    train = ["train", "tiny_sd3", f"trainer.output_dir={tmp_path}", "trainer.run_name=run"]
    assert main([*train, f"trainer.resume={target}"]) == 2
    assert main(["eval", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count(name) >= 2 and "Traceback" not in err, err
    assert not marker.exists()


def _changed(old: dict, **fields) -> dict:
    return {**old, **fields}


def _group(old: dict, **fields) -> dict:
    return {**old, "param_groups": [{**old["param_groups"][0], **fields}]}


def _adapter(old: dict, **fields) -> dict:
    return {**old, "adapters": {name: {**a, **fields} for name, a in old["adapters"].items()}}


# (file, its forged content from the saved one, what the error quotes): each value is one a load
# would read and fail on (or, worse, train with), in a file that hashes right under a forged manifest.
FORGED_VALUES = [
    ("extra.json", lambda old: {**old, "data": {"epoch": 0, "position": 4, "num_records": 4}}, "position=4"),
    ("extra.json", lambda old: {**old, "data": {"epoch": "0", "position": 0}}, "epoch='0'"),
    ("extra.json", lambda old: {**old, "data": [0, 0]}, "not a mapping"),
    ("extra.json", lambda old: {**old, "data": {"epoch": 0, "position": 0, "seed": 1}}, "'seed'"),
    ("meta.json", lambda old: _changed(old, world_size=0), "world_size=0"),
    ("meta.json", lambda old: _changed(old, step=7), "says step 7"),
    ("meta.json", lambda old: _adapter(old, r=0), ".r=0"),
    ("optim.json", lambda old: _group(old, lr=-1.0), "lr=-1.0"),
    ("optim.json", lambda old: _group(old, eps=float("nan")), "eps=nan"),
    ("scheduler.json", lambda old: _changed(old, last_epoch=-5), "last_epoch=-5"),
    ("scheduler.json", lambda old: _changed(old, base_lrs=[-0.1]), "base_lrs=[-0.1]"),
]


@pytest.mark.parametrize(
    ("name", "forge", "quoted"), FORGED_VALUES, ids=[f"{n}-{q}" for n, _, q in FORGED_VALUES]
)
def test_a_forged_value_a_load_reads_fails_verification_naming_the_file_and_auto_falls_back(
    saved, tmp_path, caplog, name, forge, quoted
):
    """Issue 55: a forged extra.json data position (the sampler state) was refused only by the
    sampler, in the worker, without naming the file, and resume=auto did not fall back; so were
    meta.json, optim.json and scheduler.json values of the right JSON type but out of range."""
    checkpoints = _copy(saved, tmp_path)
    target = step_dir(checkpoints, 2)
    old = json.loads((target / name).read_text())
    (target / name).write_text(json.dumps(forge(old)))
    _forge_manifest(target, name)
    with pytest.raises(checkpoint.CheckpointError, match=rf"{name}.*damaged") as info:
        checkpoint.verify_checkpoint(target)
    assert quoted in str(info.value) and str(target) in str(info.value)
    with caplog.at_level(logging.WARNING, logger="diffrl.train.checkpoint"):
        assert latest_checkpoint(checkpoints) == step_dir(checkpoints, 1)
    assert f"skipping checkpoint {target}" in caplog.text and name in caplog.text


@pytest.mark.parametrize(
    ("name", "forge", "quoted"),
    [
        ("optim.json", lambda old: _group(old, betas="fast"), "param_groups[0].betas='fast'"),
        ("optim.json", lambda old: _group(old, betas=[0.9]), "param_groups[0].betas=[0.9]"),
        ("scheduler.json", lambda old: _changed(old, warmup=3), "['warmup']"),
    ],
    ids=["betas-text", "betas-short", "scheduler-key"],
)
def test_optimizer_and_scheduler_values_that_do_not_fit_the_live_ones_are_refused_and_load_nothing(
    saved, tmp_path, name, forge, quoted
):
    """Values valid as JSON that the live optimizer or scheduler would take and fail on at the
    first step (torch checks no types on load): refused before anything is restored."""
    tiny, _, _ = saved
    target = tmp_path / "step_00000002"
    shutil.copytree(step_dir(saved[1], 2), target)
    old = json.loads((target / name).read_text())
    (target / name).write_text(json.dumps(forge(old)))
    _forge_manifest(target, name)
    checkpoint.verify_checkpoint(target)  # it verifies: only the live objects tell
    transformer = _transformer(tiny, seed=5)
    before = {k: v.clone() for k, v in transformer.state_dict().items() if ".lora_" in k}
    optimizer, scheduler = _optim(transformer)
    with pytest.raises(checkpoint.CheckpointError, match=rf"{name} does not fit") as info:
        load_checkpoint(
            target, model=transformer, optimizer=optimizer, scheduler=scheduler, trainable_only=True
        )
    assert quoted in str(info.value)
    state = transformer.state_dict()
    assert all(torch.equal(state[k], v) for k, v in before.items())  # nothing restored
