"""The few-step student's own schedule (rollout.pipeline.sigmas): the distiller trains at its sigmas,
the run's export carries them in its sampling file, and `diffrl sample --lora RUN/export`, run as
the end of `diffrl train` prints it, samples at exactly those sigmas without flags (the reference:
the noise levels the sampler's Euler steps go between, recorded at the SDE step)."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import shutil

import pytest
import torch

from diffrl import sde
from diffrl.cli import main
from diffrl.config import load_config
from diffrl.controller.run import train
from diffrl.schedules import fixed_schedule
from diffrl.train.distillation import student_schedule

SIGMAS = [1.0, 0.6]
TINY = [
    "trainer.total_steps=1",
    "trainer.save_freq=1",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.check_at_start=false",
    "data.prompts_per_step=2",
    "rollout.n=2",
    "actor.mini_batch_size=4",
    "actor.micro_batch_size=4",
    "actor.loss.dmd_fake_updates=1",
    "trainer.loggers=[jsonl]",
    f"rollout.pipeline.sigmas=[{SIGMAS[0]},{SIGMAS[1]}]",
]


@pytest.fixture(scope="module")
def student_run(tmp_path_factory):
    """(run directory, what `diffrl train` printed) of one step of shapes_dmd with SIGMAS."""
    root = tmp_path_factory.mktemp("student")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_dir = train("shapes_dmd", [*TINY, f"trainer.output_dir={root}", "trainer.run_name=run"])
    return run_dir, printed.getvalue()


def _recorded_steps(monkeypatch) -> list[tuple[float, float]]:
    """(σ_k, σ_{k+1}) of every Euler step the sampler takes from now on (one per micro-batch)."""
    steps: list[tuple[float, float]] = []
    real = sde.step

    def recording(kind, x, v, sigma, sigma_next, *args, **kwargs):
        steps.append((round(float(sigma), 6), round(float(sigma_next), 6)))
        return real(kind, x, v, sigma, sigma_next, *args, **kwargs)

    monkeypatch.setattr(sde, "step", recording)
    return steps


def test_fixed_schedule_is_the_given_sigmas_then_zero():
    schedule = fixed_schedule([1.0, 0.75, 0.5])
    assert schedule.sigmas.tolist() == [1.0, 0.75, 0.5, 0.0]
    assert schedule.timesteps.tolist() == [1000.0, 750.0, 500.0]
    for bad in ([], [0.5, 0.75], [1.0, 0.0], [1.5]):
        with pytest.raises(ValueError, match="decreasing"):
            fixed_schedule(bad)


def test_the_sigmas_must_fit_the_steps(tmp_path):
    with pytest.raises(ValueError, match=r"rollout\.pipeline\.sigmas"):
        load_config("shapes_dmd", ["rollout.pipeline.sigmas=[1.0,0.5,0.2]"])  # 2 steps
    cfg = load_config("shapes_dmd", [f"rollout.pipeline.sigmas=[{SIGMAS[0]},{SIGMAS[1]}]"])
    pipe = cfg.rollout.pipeline
    assert student_schedule(None, pipe).sigmas.tolist() == pytest.approx([*SIGMAS, 0.0])


def test_the_student_trains_validates_and_exports_at_its_own_sigmas(
    student_run, tmp_path, monkeypatch, capsys
):
    run_dir, printed = student_run
    assert json.loads((run_dir / "export" / "diffrl_sampling.json").read_text())["sigmas"] == SIGMAS
    # the command the run printed, as printed: the export's two steps at SIGMAS, no flags
    lines = [line for line in printed.splitlines() if "diffrl sample --" in line]
    assert len(lines) == 1, printed
    argv = shlex.split(lines[0][lines[0].index("diffrl sample --") :])[1:]
    argv = [*argv[: argv.index("-n") + 1], "1", *argv[argv.index("-n") + 2 :]]
    steps = _recorded_steps(monkeypatch)
    assert main(argv) == 0, capsys.readouterr().err
    assert "sigmas 1, 0.6" in capsys.readouterr().out
    assert steps == [(1.0, 0.6), (0.6, 0.0)]
    out = argv.index("--out") + 1
    # an export whose file has no sigmas samples at the family's 2-step schedule (σ_1 = 0.001)
    plain = tmp_path / "plain"
    shutil.copytree(run_dir / "export", plain)
    settings = json.loads((plain / "diffrl_sampling.json").read_text())
    del settings["sigmas"]
    (plain / "diffrl_sampling.json").write_text(json.dumps(settings))
    steps.clear()
    lora = argv.index("--lora") + 1
    assert main([*argv[:lora], str(plain), *argv[lora + 1 : out], str(tmp_path / "p"), *argv[out + 1 :]]) == 0
    assert len(steps) == 2 and steps[0] != (1.0, 0.6)


def test_a_sampling_file_s_sigmas_apply_only_at_their_steps(tmp_path):
    from diffrl.models.sampling import resolve_sampling, write_sampling_file

    write_sampling_file(tmp_path, {"steps": 2, "sigmas": SIGMAS})
    settings, sources = resolve_sampling(None, tmp_path, {})
    assert settings["sigmas"] == SIGMAS and sources["sigmas"].endswith("diffrl_sampling.json")
    # --steps other than the schedule's: the family's own schedule for those steps
    assert resolve_sampling(None, tmp_path, {"steps": 3})[0]["sigmas"] is None
    assert resolve_sampling(None, tmp_path, {"steps": 2})[0]["sigmas"] == SIGMAS


def test_the_distiller_stages_its_samples_at_the_students_sigmas(tmp_path):
    from test_distillation import DISTILL, _shard

    from diffrl.workers.distillation_worker import DistillationWorker

    sigmas = "rollout.pipeline.sigmas=[1.0,0.6]"
    worker = DistillationWorker(load_config("tiny_sd3", [*DISTILL, sigmas, f"trainer.output_dir={tmp_path}"]))
    worker.distill_stage(_shard(["a cat", "a dog", "a fox", "a cow"]), seed=0, step=1)
    staged = worker.distiller.staged.sigmas_B
    assert sorted({round(s, 6) for s in staged.tolist()}) == [0.6, 1.0], staged
    assert torch.isfinite(worker.distiller.staged.x0).all()
