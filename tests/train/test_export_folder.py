"""Where an export may be written (`diffrl.train.export_folder`): only a new folder or an earlier
export is replaced, and a crash while publishing never loses the earlier export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffrl.train import export_folder
from diffrl.train.export_folder import (
    EXPORT_INFO,
    LORA_FILE,
    STAGING_MARK,
    begin_staging,
    check_export_target,
    publish,
    write_manifest,
)


def _lora_export(folder: Path, payload: bytes = b"weights") -> Path:
    folder.mkdir(parents=True)
    (folder / LORA_FILE).write_bytes(payload)
    write_manifest(folder, kind="lora", step=1)
    (folder / "diffrl_sampling.json").write_text("{}\n")
    return folder


def _pipeline_export(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "model_index.json").write_text(
        json.dumps({"_class_name": "X", "transformer": ["a", "b"], "vae": ["c", "d"]})
    )
    for name in ("transformer", "vae"):
        (folder / name).mkdir()
        (folder / name / "config.json").write_text("{}")
    write_manifest(folder, kind="pipeline", step=1)
    return folder


def test_a_new_folder_an_empty_one_and_earlier_exports_are_accepted(tmp_path):
    assert check_export_target(tmp_path / "new") == tmp_path / "new"
    (tmp_path / "empty").mkdir()
    assert check_export_target(tmp_path / "empty") == tmp_path / "empty"
    assert check_export_target(_lora_export(tmp_path / "lora")) == tmp_path / "lora"
    assert check_export_target(_pipeline_export(tmp_path / "pipe")) == tmp_path / "pipe"


def test_dot_and_trailing_slashes_resolve_to_a_named_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(_lora_export(tmp_path / "lora"))
    assert check_export_target(".") == tmp_path / "lora"
    assert check_export_target("../lora/") == tmp_path / "lora"


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda p: (p.mkdir(), (p / "notes.txt").write_text("mine")), "no diffrl_export.json"),
        (lambda p: (p.mkdir(), (p / EXPORT_INFO).write_text("{not json")), "does not parse"),
        (lambda p: (p.mkdir(), (p / EXPORT_INFO).write_text('{"kind": "run"}')), "LoRA or pipeline"),
        (lambda p: (_lora_export(p), (p / "notes.txt").write_text("mine")), "notes.txt"),
        (lambda p: (_pipeline_export(p), (p / "checkpoints").mkdir()), "checkpoints"),
        (lambda p: p.write_text("a file"), "is a file"),
    ],
    ids=[
        "user-files",
        "bad-manifest",
        "foreign-manifest",
        "export-plus-user-file",
        "pipeline-plus-dir",
        "file",
    ],
)
def test_anything_else_is_refused_and_left_alone(tmp_path, make, reason):
    target = tmp_path / "out"
    make(target)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=reason) as err:
        check_export_target(target)
    assert str(target) in str(err.value)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_the_run_being_exported_and_folders_holding_it_are_refused_even_if_they_look_like_exports(tmp_path):
    run = tmp_path / "runs" / "r"
    checkpoint = run / "checkpoints" / "step_00000001"
    checkpoint.mkdir(parents=True)
    for target in (run, run / "checkpoints", checkpoint, tmp_path / "runs", tmp_path):
        with pytest.raises(ValueError, match="which this export reads"):
            check_export_target(target, protected=(run, checkpoint))
    write_manifest(run, kind="lora")  # a forged manifest does not make the run replaceable
    with pytest.raises(ValueError, match="which this export reads"):
        check_export_target(run, protected=(run, checkpoint))
    assert check_export_target(run / "my_lora", protected=(run, checkpoint)) == run / "my_lora"


def test_a_symlink_and_foreign_staging_or_aside_folders_are_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ValueError, match="symbolic link"):
        check_export_target(tmp_path / "link")
    (tmp_path / "out.partial").mkdir()
    (tmp_path / "out.partial" / "mine.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"out\.partial.*not a leftover"):
        check_export_target(tmp_path / "out")
    (tmp_path / "b.replaced").mkdir()
    (tmp_path / "b.replaced" / "mine.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"b\.replaced.*not an earlier diffrl export"):
        check_export_target(tmp_path / "b")
    assert (tmp_path / "out.partial" / "mine.txt").read_text() == "mine"
    assert (tmp_path / "b.replaced" / "mine.txt").read_text() == "mine"


def test_publish_replaces_an_earlier_export_and_a_crashed_export_is_cleaned_up(tmp_path):
    out = _lora_export(tmp_path / "out", b"old")
    leftover = begin_staging(out)
    (leftover / "half").write_bytes(b"half-written")  # a crashed export's staging folder
    check_export_target(out)
    staging = begin_staging(out)
    assert not (staging / "half").exists() and (staging / STAGING_MARK).is_file()
    _lora_export(staging / "tmp", b"new")
    for file in (staging / "tmp").iterdir():
        file.rename(staging / file.name)
    (staging / "tmp").rmdir()
    publish(staging, out)
    assert (out / LORA_FILE).read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert not (out / STAGING_MARK).exists()


def test_a_crash_between_the_two_renames_keeps_the_earlier_export(tmp_path, monkeypatch):
    out = _lora_export(tmp_path / "out", b"old")
    staging = begin_staging(out)
    _lora_export(staging / "inner", b"new")
    real_rename, calls = Path.rename, []

    def crash_on_second_rename(self, target):
        calls.append(self)
        if len(calls) == 2:
            raise OSError("simulated crash")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", crash_on_second_rename)
    with pytest.raises(OSError, match="simulated crash"):
        publish(staging, out)
    monkeypatch.undo()
    aside = export_folder.replaced_path(out)
    assert (aside / LORA_FILE).read_bytes() == b"old"  # the earlier export, whole, renamed aside
    # The next export accepts both leftovers as diffrl's own and replaces them.
    check_export_target(out)
    staging = begin_staging(out)
    _lora_export(staging / "x", b"newer")
    publish(staging, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
