"""`diffrl check`: passes on the CPU presets, and each planted mismatch fails the check that names it.

The references are independent of the code under check: the family's own diffusers pipeline (the
sampler's latents and the transformer inputs it records), the trainer's recomputation on the same
weights, the rewards' own outputs. Each broken setup plants one mismatch of the kind users hit (a
shift that never reached the sampler, a trainer that computes in bf16 while the sampler ran fp32,
a reward that returns one score too few, weights that never reached a replica) and asserts that
exactly the check naming it fails.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from check_helpers import write_pairs

from diffrl.cli import main
from diffrl.config import load_config
from diffrl.config.catalog import preset_names
from diffrl.controller import check_resources
from diffrl.controller.check import check
from diffrl.controller.check_report import FAIL, PASS, SKIP
from diffrl.controller.check_resources import weight_sync_rows
from diffrl.controller.placement import Separate
from diffrl.data import PromptRecord
from diffrl.models.sd3 import SD3Adapter
from diffrl.rewards.server import start_reward_server
from diffrl.schedules import flow_match_schedule
from diffrl.train import policies
from diffrl.transition import evaluate_window
from diffrl.workers.group import InProcessGroup
from diffrl.workers.roles import ActorWorker, RolloutWorker

SAMPLING_ROWS = (
    "sampler = pipeline",
    "shift (timesteps)",
    "guidance / true CFG",
    "resolution / frames",
    "text length",
)


#: CPU presets whose model no diffusers pipeline can run (the pixel-space FLUX.1 Kontext edit toy:
#: the pipeline VAE-encodes its condition image), so the check has no pipeline to compare with.
NO_PIPELINE = ("shapes_edit",)


def cpu_presets() -> list[str]:
    """Presets whose model is built in (toy: or tiny:), i.e. that run on a CPU without downloads;
    `shapes_sft` and `shapes_edit_sft` train with `diffrl sft`, not the RL loop `diffrl check` checks."""
    names = []
    for name in preset_names():
        path = load_config(name, []).model.path
        if path.startswith(("toy:", "tiny:")) and name not in ("shapes_sft", "shapes_edit_sft"):
            names.append(name)
    return names


def _verdicts(report) -> dict[str, str]:
    return {r.check: r.verdict for r in report.rows}


@pytest.mark.parametrize("preset", cpu_presets())
def test_quick_check_passes_on_every_cpu_preset(preset, tmp_path):
    # offline_dpo leaves data.train_files for the user's preference pairs
    overrides = [f"data.train_files=[{write_pairs(tmp_path)}]"] if preset == "offline_dpo" else []
    report = check(preset, overrides, quick=True)
    verdicts = _verdicts(report)
    assert report.exit_code == 0, report.table()
    if preset in NO_PIPELINE:  # the row says why, and the setting rows (read from both runs) are absent
        assert verdicts["sampler = pipeline"] == SKIP, report.table()
        assert "no VAE" in report.row("sampler = pipeline").note
        assert not set(SAMPLING_ROWS[1:]) & set(verdicts)
    elif load_config(preset, overrides).rollout.pipeline.sigmas is not None:  # a student's own schedule
        assert verdicts["sampler = pipeline"] == SKIP, report.table()
        assert "used unshifted" in report.row("sampler = pipeline").note
    else:
        for name in SAMPLING_ROWS:
            assert verdicts[name] == PASS, report.table()
    cfg = load_config(preset, overrides)
    log_prob_rows = [r for r in report.rows if r.check.startswith("log-probs = trainer")]
    if cfg.algorithm.trainer_type == "policy_gradient" and cfg.trainer.placement == "colocated":
        window = cfg.rollout.sde_window_size
        assert len(log_prob_rows) == window and all(r.verdict == PASS for r in log_prob_rows)
    if cfg.reward.functions:
        assert all(verdicts[f"reward {name}"] == PASS for name in cfg.reward.functions)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["actor.loss.kl_coef=0.04"],
        ["algorithm.trainer_type=direct_preference", "actor.loss.mode=diffusion_nft"],
    ],
    ids=["flow_grpo", "flow_grpo_kl", "diffusion_nft"],
)
def test_full_check_measures_memory_of_each_phase(overrides):
    report = check("tiny_sd3", overrides)
    verdicts = _verdicts(report)
    assert report.exit_code == 0, report.table()
    assert verdicts["memory: sampling"] == verdicts["memory: update"] == PASS
    # tiny_sd3 reuses the rollout's log-probs (colocated, eager): no recompute phase to measure,
    # unless KL needs the reference pass (its update then takes the reference means, as a run's)
    kl = "actor.loss.kl_coef=0.04" in overrides
    assert ("memory: log-prob recompute" in verdicts) == kl
    assert verdicts["weights: replicas = trainer"] == SKIP


def test_a_batch_larger_than_the_device_fails_naming_the_setting(monkeypatch):
    """A device of 0.1 GB: every phase's measured peak (the process's RSS on a CPU) is past it."""
    monkeypatch.setattr(check_resources, "_capacity", lambda device: 2**30 // 10)
    report = check("tiny_sd3", [])
    sampling, update = report.row("memory: sampling"), report.row("memory: update")
    assert sampling.verdict == update.verdict == FAIL
    assert "set rollout.micro_batch_size=4" in sampling.note  # tiny_sd3 samples 8 at a time
    assert "set actor.micro_batch_size=2" in update.note  # and trains 4
    assert "replay_steps_per_forward" not in update.note


def test_with_batched_replay_the_memory_fix_names_fewer_steps_per_forward(monkeypatch):
    monkeypatch.setattr(check_resources, "_capacity", lambda device: 2**30 // 10)
    report = check("tiny_sd3", ["actor.replay_steps_per_forward=2"])  # recomputes its old log-probs
    for name in ("memory: update", "memory: log-prob recompute"):
        note = report.row(name).note
        assert report.row(name).verdict == FAIL
        assert "set actor.micro_batch_size=2" in note and "actor.replay_steps_per_forward=1" in note, note


def _shift_one(self, num_steps, height, width, num_frames=1):
    """A sampler whose schedule dropped the model's shift (3.0 in the tiny SD3's scheduler config)."""
    config = dict(self.scheduler_config, shift=1.0)
    seq = self.image_seq_len(height, width, num_frames)
    return flow_match_schedule(config, num_steps, seq, pipeline_convention=self.schedule_convention)


def test_a_dropped_shift_fails_the_pipeline_and_shift_checks(monkeypatch):
    assert load_config("tiny_sd3", []).model.path == "tiny:sd3"
    monkeypatch.setattr(SD3Adapter, "schedule", _shift_one)
    report = check("tiny_sd3", [], quick=True)
    verdicts = _verdicts(report)
    assert report.exit_code == 1
    assert verdicts["sampler = pipeline"] == FAIL and verdicts["shift (timesteps)"] == FAIL
    # the other settings did reach both
    assert verdicts["guidance / true CFG"] == verdicts["text length"] == PASS
    assert "StableDiffusion3Pipeline" in report.row("shift (timesteps)").note


def _bf16_transition(adapter, rollout, micro_batch_size, **kwargs):
    """The trainer replays the bf16-rounded transition while the sampler computed on fp32 latents."""
    samples = rollout.samples.clone()
    samples.window_latents = samples.window_latents.bfloat16().float()
    return evaluate_window(adapter, replace(rollout, samples=samples), micro_batch_size, **kwargs)


@pytest.mark.parametrize(
    ("overrides", "as_trained"), [([], True), (["algorithm.old_log_probs=recompute"], False)]
)
def test_the_log_prob_rows_compare_with_the_pass_the_run_takes_its_old_log_probs_from(
    monkeypatch, overrides, as_trained
):
    # Reused, the sampled log-probs meet the update's first forward (grad on: under compilation
    # another graph than no-grad, which the sampler's window steps run through); recomputed, the
    # no-grad pass. Either way the window steps' velocities run in that grad mode.
    passes, velocity_grad = [], []

    def spy(adapter, rollout, micro_batch_size, *, as_trained=False, steps_per_forward=1):
        passes.append(as_trained)
        velocity = adapter.velocity

        def recording(*args, **kwargs):
            velocity_grad.append(torch.is_grad_enabled())
            return velocity(*args, **kwargs)

        adapter.velocity = recording
        try:
            log_probs, means = evaluate_window(
                adapter, rollout, micro_batch_size, as_trained=as_trained, steps_per_forward=steps_per_forward
            )
        finally:
            del adapter.velocity
        assert not log_probs.requires_grad and not means.requires_grad
        return log_probs, means

    monkeypatch.setattr(policies, "evaluate_window", spy)
    report = check("tiny_sd3", overrides, quick=True)
    assert passes == [as_trained] and set(velocity_grad) == {as_trained}
    rows = [r for r in report.rows if r.check.startswith("log-probs = trainer")]
    assert rows and all(r.verdict == PASS for r in rows), report.table()


def test_a_trainer_in_bf16_fails_the_log_prob_check_where_the_run_reuses_them(monkeypatch):
    monkeypatch.setattr(policies, "evaluate_window", _bf16_transition)
    report = check("tiny_sd3", [], quick=True)
    rows = [r for r in report.rows if r.check.startswith("log-probs = trainer")]
    assert rows and all(r.verdict == FAIL for r in rows), report.table()
    assert "algorithm.old_log_probs=recompute" in rows[0].note
    assert report.row("sampler = pipeline").verdict == PASS  # the sampler itself is right
    # A run that recomputes the old log-probs corrects the gap: measured, finite, not a failure.
    report = check("tiny_sd3", ["algorithm.old_log_probs=recompute"], quick=True)
    rows = [r for r in report.rows if r.check.startswith("log-probs = trainer")]
    assert all(r.verdict == PASS and r.measured != "max |gap| 0" for r in rows), report.table()


def test_eager_reused_log_probs_are_bitwise_with_a_smaller_actor_micro_batch():
    # tiny_sd3 samples 8 at a time; the trainer's forwards of 1 round its per-sample projections
    # differently on a CPU (~1e-7), so the sampler computes its window steps in the trainer's
    # micro-batches wherever the run reuses its log-probs
    report = check("tiny_sd3", ["actor.micro_batch_size=1"], quick=True)
    rows = [r for r in report.rows if r.check.startswith("log-probs = trainer")]
    assert rows and all(r.verdict == PASS for r in rows), report.table()
    assert report.exit_code == 0, report.table()


@pytest.mark.parametrize(
    ("reward", "cause"), [("one_short", "expected (2,), one score per sample"), ("not_finite", "non-finite")]
)
def test_a_reward_with_the_wrong_count_or_nan_fails_its_row(reward, cause):
    report = check("tiny_sd3", [f"reward.functions.python.args.function=check_helpers:{reward}"], quick=True)
    verdicts = _verdicts(report)
    assert report.exit_code == 1
    assert verdicts["reward python"] == FAIL and verdicts["reward jpeg_compressibility"] == PASS
    assert cause in report.row("reward python").note


def test_cli_exit_codes(monkeypatch, capsys):
    assert main(["check", "tiny_sd3", "rollout.n=zero"]) == 2
    assert "rollout.n" in capsys.readouterr().err
    assert main(["check", "tiny_sd3", "model.path=/nonexistent/model"]) == 2
    monkeypatch.setattr(SD3Adapter, "schedule", _shift_one)
    assert main(["check", "tiny_sd3", "--quick"]) == 1
    out = capsys.readouterr().out
    assert "FAILED: sampler = pipeline, shift (timesteps)" in out


@pytest.fixture
def separate_pools():
    """The separate placement's own classes (Separate, ActorWorker, RolloutWorker, the gloo weight
    sync group) with each worker in a thread of this process instead of a Ray actor."""
    cfg = load_config("tiny_sd3", ["trainer.placement=separate"])
    trainer = InProcessGroup(ActorWorker, 1, cfg)
    replicas = InProcessGroup(RolloutWorker, 1, cfg)
    placement = Separate(cfg, trainer, replicas, backend="gloo")
    yield cfg, placement
    placement.shutdown()
    trainer.call("weights.close")
    replicas.call("close_weight_sync")
    for group in (trainer, replicas):
        group.shutdown()


def test_weight_sync_check_passes_and_fails_when_weights_never_reach_a_replica(separate_pools, monkeypatch):
    cfg, placement = separate_pools
    group = [PromptRecord("a red circle")]
    rows, sampled, recomputed = weight_sync_rows(cfg, placement, group)
    assert [r.verdict for r in rows] == [PASS, PASS], rows
    assert "LoRA" in rows[1].check or "adapters only" in rows[1].check
    # the replica's rollout, recomputed by the trainer with the weights it synced: the same log-probs
    assert recomputed.shape == sampled.shape == (cfg.rollout.n, cfg.rollout.sde_window_size)
    torch.testing.assert_close(recomputed, sampled, rtol=0, atol=1e-6)
    # The same pools, with syncs that never deliver: the trainer's update stays on the trainer.
    monkeypatch.setattr(Separate, "sync_weights", lambda self, version, full=False: {})
    rows, _, _ = weight_sync_rows(cfg, placement, group)
    assert rows[1].verdict == FAIL and "differ between the trainer and a replica" in rows[1].note


class _Started(Exception):
    """Raised where `diffrl train` would start its workers."""


def _no_job(*args, **kwargs):
    raise _Started


def test_train_runs_the_quick_check_first_and_a_failure_stops_it(tmp_path, monkeypatch, capsys):
    from diffrl.controller import run

    monkeypatch.setattr(run, "attempt", _no_job)
    out = [f"trainer.output_dir={tmp_path}"]
    with pytest.raises(_Started):  # every check passed: the run goes on to start its workers
        run.train("tiny_sd3", out)
    assert "FAIL" not in capsys.readouterr().out  # its line comes after the run directory's
    monkeypatch.setattr(SD3Adapter, "schedule", _shift_one)
    # a patch in this process is no change to the files the record of the pass is keyed on
    monkeypatch.setenv("DIFFRL_CHECK_CACHE", str(tmp_path.parent / "no_records"))
    with pytest.raises(ValueError, match=r"setup check failed \(sampler = pipeline, shift \(timesteps\)"):
        run.train("tiny_sd3", out)
    assert "FAILED: sampler = pipeline" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())  # nothing written
    with pytest.raises(_Started):  # turned off, the same broken setup starts
        run.train("tiny_sd3", [*out, "trainer.check_at_start=false"])


@pytest.mark.parametrize(
    "family",
    [
        # FLUX: distilled guidance embedding plus true CFG (two pipeline calls per step, one of ours)
        [
            "model.path=tiny:flux",
            "rollout.pipeline.true_cfg_scale=4.0",
            "rollout.pipeline.negative_prompt=blurry",
        ],
        # Qwen-Image: true CFG with norm rescale, masked text of different lengths per side
        [
            "model.path=tiny:qwen_image",
            "rollout.pipeline.true_cfg_scale=4.0",
            "rollout.pipeline.max_sequence_length=64",
        ],
    ],
    ids=["flux", "qwen_image"],
)
def test_quick_check_passes_on_the_other_families(family):
    report = check("tiny_sd3", family, quick=True)
    assert report.exit_code == 0, report.table()
    assert "passes/sample [2] vs [2]" in report.row("guidance / true CFG").measured


def test_a_remote_scorer_answers_within_its_deadline_or_fails_its_row():
    with (
        start_reward_server("jpeg_compressibility") as fast,
        start_reward_server("check_helpers:slow", {"seconds": 1.0}) as slow,
    ):
        http = ["reward.functions.http.args.retries=0", "reward.functions.http.args.timeout=0.4"]
        report = check("tiny_sd3", [*http, f"reward.functions.http.args.url={fast.url}"], quick=True)
        assert report.row("reward http").verdict == PASS, report.table()
        assert "<= 0.4 s" in report.row("reward http").tolerance
        report = check("tiny_sd3", [*http, f"reward.functions.http.args.url={slow.url}"], quick=True)
    row = report.row("reward http")
    assert row.verdict == FAIL and "did not answer within timeout=0.4 s" in row.note, report.table()


def test_wan_with_its_unipc_scheduler_is_checked_against_the_pipeline_sampling_as_diffrl_does():
    """The diffusers Wan checkpoints ship a multistep UniPC solver; diffrl samples them as flow-match
    Euler at the same shift, and the check compares with WanPipeline on that scheduler."""
    from contextlib import nullcontext

    from diffusers import UniPCMultistepScheduler

    from diffrl.controller.check_sampling import sampler_vs_pipeline
    from diffrl.models import load_model

    cfg = load_config("tiny_wan_video", [])
    adapter = load_model(cfg.model.path, "float32")
    shift = adapter.pipe.scheduler.config.shift
    adapter.pipe.scheduler = UniPCMultistepScheduler.from_config(  # as a checkpoint's config loads
        {
            "_class_name": "UniPCMultistepScheduler",
            "prediction_type": "flow_prediction",
            "use_flow_sigmas": True,
            "flow_shift": shift,
        }
    )
    rows, rollout = sampler_vs_pipeline(adapter, cfg, ["a red circle", "a blue square"], nullcontext)
    assert all(r.verdict == PASS for r in rows), rows
    # the pipeline on its own UniPC solver is another sampler: far from ours
    noise = rollout.samples.window_latents[:, 0]
    pipe = cfg.rollout.pipeline
    call = adapter.pipeline_call(
        ["a red circle", "a blue square"],
        [pipe.negative_prompt] * 2,
        num_inference_steps=pipe.num_inference_steps,
        guidance_scale=pipe.guidance_scale,
        true_cfg_scale=None,
        height=pipe.height,
        width=pipe.width,
        num_frames=pipe.num_frames,
        max_sequence_length=pipe.max_sequence_length,
    )
    unipc = adapter.pipe(latents=noise.clone(), output_type="latent", **call).frames
    assert (unipc - rollout.samples.final_latents).norm() > 1e-2 * unipc.norm()


def test_the_check_leaves_the_global_rng_alone():
    """`diffrl train` runs the quick check in its own process before the run: drawing from torch's
    global generator there would change what the run draws after it."""
    torch.manual_seed(123)
    before = torch.get_rng_state()
    check("tiny_sd3", [])  # the full check: its update draws advantages too
    assert torch.equal(torch.get_rng_state(), before)


def test_a_rewards_row_gives_its_speed_from_its_measured_time():
    """The reward row says how fast each reward scored (a VLM judge's cost shows before a run):
    a scorer that takes 0.3 s for 4 samples can report at most 4 / 0.3 images/s."""
    import re
    from types import SimpleNamespace

    import torch

    from diffrl.config import load_config
    from diffrl.controller.check_resources import reward_rows

    cfg = load_config(
        "tiny_sd3",
        [
            "reward.functions.python.weight=1",
            "reward.functions.python.args.function=check_helpers:slow",
            "reward.functions.python.args.seconds=0.3",
        ],
    )
    rollout = SimpleNamespace(
        samples=SimpleNamespace(
            pixels=torch.zeros(4, 3, 8, 8, dtype=torch.uint8), prompt_index_B=torch.arange(4)
        ),
        sample_prompts=lambda: ["a"] * 4,
        sample_metadata=lambda: [{}] * 4,
    )
    row = {r.check: r for r in reward_rows(cfg, rollout)}["reward python"]
    assert not row.failed, row
    printed_seconds = re.search(r"finite, ([0-9.]+) s", row.measured).group(1)
    printed_speed = re.search(r"\(([0-9.]+) images/s", row.measured).group(1)
    seconds, speed = float(printed_seconds), float(printed_speed)
    assert seconds >= 0.3 and 0 < speed <= 4 / 0.3
    # both from the same measured time, each rounded as printed (half a unit of its last digit)
    half = lambda text: 0.5 * 10.0 ** -len(text.partition(".")[2])  # noqa: E731
    low, high = 4 / (seconds + half(printed_seconds)), 4 / (seconds - half(printed_seconds))
    assert low - half(printed_speed) <= speed <= high + half(printed_speed), row.measured
