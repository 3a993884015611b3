"""`diffrl export` and `diffrl sample --lora` on real (tiny) training runs, checked against plain diffusers.

For a tiny SD3 and a tiny FLUX, one Flow-GRPO step with a large learning rate (so the LoRA moves the
samples visibly) writes a checkpoint and the end-of-run export. The reference is the engine's own
samples: the run's model built as the trainer builds it, the checkpoint loaded, sampled by
diffrl's sampler. Against it:
- the exported LoRA loaded by diffusers' `load_lora_weights` (what `diffrl sample --lora` does):
  identical pixels;
- the merged pipeline loaded by `DiffusionPipeline.from_pretrained`: pixels within 1 level of 255,
  because merging computes W + s·B·A once in fp32 where the LoRA forward computes x·W + s·(x·A)·B;
  the two round differently in the last bits, which can move a pixel across a rounding boundary.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.cli import main
from diffrl.config import load_config
from diffrl.controller.run import train
from diffrl.models import load_model
from diffrl.rollout.generate import generate
from diffrl.train.checkpoint import latest_checkpoint, load_checkpoint
from diffrl.train.engine import TrainEngine
from diffrl.train.export_folder import LORA_FILE

PROMPTS = ["a red circle", "two blue squares"]
SAMPLE = dict(n=2, steps=4, guidance_scale=4.5, height=32, width=32, max_sequence_length=16, seed=3)


def _pixels(folder) -> np.ndarray:
    files = sorted(folder.glob("*.png"))
    assert len(files) == len(PROMPTS) * SAMPLE["n"]
    return np.stack([np.asarray(Image.open(f)).astype(np.int16) for f in files])


@pytest.fixture(scope="module", params=["sd3", "flux"])
def run(request, tmp_path_factory):
    """The run directory of a one-step LoRA run on the tiny model of `family`."""
    family = request.param
    root = tmp_path_factory.mktemp(f"export_{family}")
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path_factory.getbasetemp() / "diffrl_cache"))
    overrides = [
        f"model.path=tiny:{family}",
        "trainer.total_steps=1",
        "trainer.save_freq=1",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]",
        f"trainer.output_dir={root}",
        "trainer.run_name=run",
        "actor.optim.lr=2e-2",  # one Adam step moves every LoRA B entry by ~lr: visible in pixels
    ]
    if family == "flux":
        overrides.append("rollout.pipeline.guidance_scale=3.5")  # FLUX's distilled guidance, no CFG pass
    yield train("tiny_sd3", overrides)
    monkeypatch.undo()


def _engine_samples(run_dir, out):
    """The engine's own samples: the model as the trainer builds it, with the newest checkpoint."""
    cfg = load_config(str(run_dir / "config.yaml"), job="eval")
    adapter = load_model(cfg.model.path, dtype=cfg.model.dtype)
    engine = TrainEngine(adapter, cfg.model, cfg.actor, total_optim_steps=1, seed=cfg.trainer.seed)
    load_checkpoint(
        latest_checkpoint(run_dir / "checkpoints"),
        model=engine.transformer,
        optimizer=None,
        scheduler=None,
        trainable_only=True,
        restore_rng=False,
    )
    engine.transformer.eval()
    with torch.no_grad():
        generate(adapter, PROMPTS, out, **SAMPLE)
    return _pixels(out)


def test_export_lora_and_merged_pipeline_reproduce_the_engine(run, tmp_path, capsys):
    run_dir = run
    cfg = load_config(str(run_dir / "config.yaml"), job="eval")
    expected = _engine_samples(run_dir, tmp_path / "engine")
    generate(cfg.model.path, PROMPTS, tmp_path / "base", dtype="float32", device="cpu", **SAMPLE)
    base = _pixels(tmp_path / "base")
    assert np.abs(expected - base).max() > 8, (
        "the trained LoRA must change the samples for this test to mean anything"
    )

    # diffrl export RUN --out DIR: the LoRA, loaded by diffusers' load_lora_weights in `diffrl sample --lora`
    assert main(["export", str(run_dir), "--out", str(tmp_path / "lora")]) == 0
    assert "exported the LoRA of" in capsys.readouterr().out
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    # ... and the end-of-run export (RUN/export) is the same adapter.
    for name, lora in (("with_lora", tmp_path / "lora"), ("end", run_dir / "export")):
        generate(cfg.model.path, PROMPTS, tmp_path / name, dtype="float32", device="cpu", lora=lora, **SAMPLE)
        assert np.abs(_pixels(tmp_path / name) - expected).max() == 0, name

    # --merge: a whole diffusers pipeline, loaded by DiffusionPipeline.from_pretrained (load_model).
    assert main(["export", str(run_dir), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    info = json.loads((tmp_path / "merged" / "diffrl_export.json").read_text())
    assert info["kind"] == "pipeline" and info["merged"] and info["step"] == 1
    generate(
        str(tmp_path / "merged"), PROMPTS, tmp_path / "from_merged", dtype="float32", device="cpu", **SAMPLE
    )
    assert np.abs(_pixels(tmp_path / "from_merged") - expected).max() <= 1


def test_plain_diffusers_load_lora_weights_gives_the_engine_transformer(run, tmp_path):
    """Without diffrl's loader: the pipeline class's own from_pretrained + load_lora_weights."""
    from diffusers import DiffusionPipeline

    run_dir = run
    assert (
        main(["export", str(run_dir / "checkpoints" / "step_00000001"), "--out", str(tmp_path / "lora")]) == 0
    )
    cfg = load_config(str(run_dir / "config.yaml"), job="eval")
    adapter = load_model(cfg.model.path, dtype="float32")
    engine = TrainEngine(adapter, cfg.model, cfg.actor, total_optim_steps=1, seed=cfg.trainer.seed)
    load_checkpoint(
        run_dir / "checkpoints" / "step_00000001",
        model=engine.transformer,
        optimizer=None,
        scheduler=None,
        trainable_only=True,
        restore_rng=False,
    )
    from diffrl.models import resolve_model_path

    pipe = DiffusionPipeline.from_pretrained(resolve_model_path(cfg.model.path), dtype=torch.float32)
    pipe.load_lora_weights(tmp_path / "lora")
    trained = {n: p for n, p in engine.transformer.named_parameters() if "lora_" in n}
    # diffusers names the loaded adapter default_0; everything else must match one to one.
    loaded = {
        n.replace(".default_0.", ".default."): p
        for n, p in pipe.transformer.named_parameters()
        if "lora_" in n
    }
    assert loaded.keys() == trained.keys() and loaded
    assert all(torch.equal(p, trained[n]) for n, p in loaded.items())
    assert any(p.abs().max() > 0 for n, p in loaded.items() if ".lora_B." in n)
    layer = next(m for m in pipe.transformer.modules() if getattr(m, "scaling", None))
    assert layer.scaling["default_0"] == cfg.model.lora.alpha / cfg.model.lora.rank


@pytest.mark.parametrize(
    ("argv_tail", "expected"),
    [
        (["--device", "cuda:7"], "--device 'cuda:7'"),
        (["--device", "tpu"], "--device 'tpu'"),
        (["--lora", "/nonexistent/lora"], "--lora '/nonexistent/lora' does not exist"),
    ],
)
def test_sample_rejects_bad_devices_and_lora_dirs_before_loading(argv_tail, expected, capsys):
    argv = ["sample", "--model", "/nonexistent/model", "--prompt", "x", "--out", "/tmp/unused", *argv_tail]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_sample_lora_dir_that_is_a_run_says_to_export_it(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("{}\n")
    argv = [
        "sample",
        "--model",
        "/nonexistent",
        "--prompt",
        "x",
        "--out",
        str(tmp_path / "o"),
        "--lora",
        str(tmp_path),
    ]
    assert main(argv) == 2
    assert f"diffrl export {tmp_path} --out DIR" in capsys.readouterr().err
    # a run that ended writes its final LoRA to RUN/export: the hint names that folder
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / LORA_FILE).write_bytes(b"")
    assert main(argv) == 2
    assert f"pass --lora {tmp_path / 'export'}" in capsys.readouterr().err


def test_export_of_something_that_is_not_a_run(tmp_path, tiny_model, capsys):
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "neither a run directory" in capsys.readouterr().err
    assert main(["export", str(tiny_model("sd3")), "--out", str(tmp_path / "o")]) == 2
    assert "not a run: there are no trained weights" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("{}\n")
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "o")]) == 2
    assert "has no complete checkpoint" in capsys.readouterr().err


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("run", ["sd3"], indirect=True)  # the folder rules do not depend on the family
def test_export_out_replaces_only_an_earlier_export(run, tmp_path, capsys, monkeypatch):
    """`--out` naming the run, its checkpoints, the folder of runs, a folder of the user's own files
    or a file is refused with exit 2 naming it, and nothing anywhere changes; a new folder, `.` inside
    an earlier export and the earlier export itself are written, the last replaced whole."""
    import shutil

    runs = tmp_path / "runs"
    run_dir = runs / "r"
    shutil.copytree(run, run_dir, symlinks=True)  # a copy: a regression must not wipe the module's run
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("years of work")
    (tmp_path / "a_file").write_text("a file")
    before = _files(tmp_path)
    for out in (run_dir, run_dir / "checkpoints", run_dir / "checkpoints" / "step_00000001", runs):
        assert main(["export", str(run_dir), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "which this export reads" in err and str(out) in err and "Traceback" not in err
    for out, reason in (
        (tmp_path / "mine", "not an earlier diffrl export"),
        (tmp_path / "a_file", "is a file"),
    ):
        assert main(["export", str(run_dir), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert reason in err and str(out) in err
    assert _files(tmp_path) == before

    from safetensors.torch import load_file

    assert main(["export", str(run_dir), "--out", str(tmp_path / "lora")]) == 0
    first = {k: v.clone() for k, v in load_file(tmp_path / "lora" / LORA_FILE).items()}  # not mmapped
    names = sorted(_files(tmp_path / "lora"))
    (tmp_path / "lora" / LORA_FILE).unlink()  # so the replacement shows
    (tmp_path / "lora" / LORA_FILE).write_bytes(b"stale")
    monkeypatch.chdir(tmp_path / "lora")
    assert main(["export", str(run_dir), "--out", "."]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert sorted(_files(tmp_path / "lora")) == names
    again = load_file(tmp_path / "lora" / LORA_FILE)
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "lora", "mine", "runs"]


@pytest.mark.parametrize("run", ["sd3"], indirect=True)
def test_export_of_a_training_run_whose_newest_checkpoint_is_pruned_while_loading_takes_the_next(
    run, tmp_path, capsys, monkeypatch
):
    """`diffrl export RUN` of a run still training: it picks step 1, and while it loads it the run
    publishes step 2 and prunes step 1 (trainer.keep_checkpoints=1). The export loads step 2 instead
    of failing, and its manifest names it."""
    import shutil

    from diffrl.train import checkpoint as checkpoint_module

    # the fixture's run trained again, to step 2, in a folder of its own (keeps both checkpoints)
    run_dir = train(str(run / "config.yaml"), ["trainer.total_steps=2", f"trainer.output_dir={tmp_path}"])
    checkpoints = run_dir / "checkpoints"
    step_1, step_2 = checkpoints / "step_00000001", checkpoints / "step_00000002"
    saving = checkpoints / ".tmp-step_00000002"
    step_2.rename(saving)  # step 2 still being written when the export looks
    real_load, calls = checkpoint_module.load_checkpoint, []

    def load_while_the_run_saves_and_prunes(path, **kwargs):
        calls.append(Path(path).name)
        if len(calls) == 1:
            saving.rename(step_2)
            shutil.rmtree(step_1)
            raise FileNotFoundError(f"{path}/model: No such file or directory")
        return real_load(path, **kwargs)

    monkeypatch.setattr(checkpoint_module, "load_checkpoint", load_while_the_run_saves_and_prunes)
    assert main(["export", str(run_dir), "--out", str(tmp_path / "lora")]) == 0, capsys.readouterr().err
    assert calls == ["step_00000001", "step_00000002"]
    info = json.loads((tmp_path / "lora" / "diffrl_export.json").read_text())
    assert info["checkpoint"] == str(step_2) and info["step"] == 2


def test_sample_lora_stops_naming_a_module_the_pipeline_did_not_bind(run, tmp_path, capsys):
    """`diffrl sample --lora`: a tensor of the file that diffusers' loader leaves unbound (here a
    module renamed to one the transformer does not have, as a key conversion that skips a module
    would leave it) stops the command naming the module, instead of sampling without it."""
    from safetensors.torch import load_file, save_file

    lora = tmp_path / "lora"
    shutil.copytree(run / "export", lora)
    tensors = load_file(lora / LORA_FILE)
    moved = sorted({k.rsplit(".lora_", 1)[0] for k in tensors if ".lora_" in k})[0]
    renamed = {
        k.replace(f"{moved}.", f"{moved}_gone.", 1) if k.startswith(f"{moved}.") else k: v
        for k, v in tensors.items()
    }
    save_file(renamed, lora / LORA_FILE)
    argv = ["sample", "--model", "tiny:sd3" if "sd3" in str(run) else "tiny:flux", "--lora", str(lora)]
    argv += ["--prompt", PROMPTS[0], "-n", "1", "--steps", "2", "--height", "32", "--width", "32"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{moved.split('.', 1)[1]}_gone" in err and "missing from the pipeline" in err, err
    assert not list((tmp_path / "out").glob("*.png")), "nothing is sampled without the module"
