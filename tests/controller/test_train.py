"""End-to-end runs of `diffrl train` on CPU with the tiny SD3 (the whole loop, real components)."""

import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from diffrl.cli import main
from diffrl.controller.preflight import BUILTIN_DATA
from diffrl.controller.run import train
from diffrl.telemetry import read_metrics as diffrl_read_metrics
from diffrl.telemetry.validation_samples import GRID_MIN_TILE

SMALL = ["trainer.total_steps=2", "trainer.save_freq=2", "trainer.test_freq=2"]
NOT_COMPARABLE = ("timing", "throughput", "perf/", "time")
#: the references that only step 1 of is compared with: one step, no validation or checkpoint
STEP_1_ONLY = [
    "trainer.total_steps=1",
    "trainer.save_freq=0",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
]


def read_metrics(run_dir: Path) -> dict[int, dict]:
    return diffrl_read_metrics(run_dir / "metrics.jsonl")


def yaml_value(path: Path, *keys: str):
    from omegaconf import OmegaConf

    node = OmegaConf.load(path)
    for key in keys:
        node = node[key]
    return node


def comparable(row: dict) -> dict:
    """Everything but wall-clock measurements."""
    return {
        k: v
        for k, v in row.items()
        if not k.startswith(NOT_COMPARABLE) and "seconds" not in k and k != "step"
    }


def test_two_ray_workers_two_steps_end_to_end(tmp_path, monkeypatch, shared_ray):
    # both Ray runs join the tests' shared cluster (tests/conftest.py), whose actors read its cache
    monkeypatch.setenv("DIFFRL_CACHE", str(shared_ray))
    run_dir = train(
        "tiny_sd3",
        [
            *SMALL,
            f"trainer.output_dir={tmp_path}",
            "trainer.run_name=e2e",
            "trainer.n_gpus_per_node=2",
            "actor.strategy=fsdp2",
        ],
    )
    metrics = read_metrics(run_dir)
    assert set(metrics) == {0, 1, 2}
    for step in (1, 2):
        for key in ("rewards/mean", "actor/loss", "actor/grad_norm", "advantages/max", "timing_s/gen"):
            assert math.isfinite(metrics[step][key]), (step, key)
        assert metrics[step]["throughput/images_per_s_per_gpu"] > 0
    assert "val/rewards/mean" in metrics[0] and "val/rewards/mean" in metrics[2]
    assert (run_dir / "config.yaml").is_file() and (run_dir / "summary.json").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002"]
    assert (run_dir / "validation" / "step_000002.png").is_file()
    assert metrics[1]["perf/max_rss_gb_rank"] in (0.0, 1.0)  # memory: the worse of the two workers
    # Sharding must not change what is sampled or how it is scored: one worker, same step-1 numbers.
    single = read_metrics(
        train(
            "tiny_sd3",
            # the start-up check (diffrl check --quick) is not what this compares
            [
                *STEP_1_ONLY,
                f"trainer.output_dir={tmp_path}",
                "trainer.run_name=single",
                "trainer.check_at_start=false",
            ],
        )
    )
    for key in [k for k in single[1] if k.startswith(("rewards/", "advantages/")) and "seconds" not in k]:
        assert metrics[1][key] == pytest.approx(single[1][key], rel=1e-6), key
    # Replicated LoRA (what actor.strategy=auto chooses here) takes the same first update as
    # sharded: the same samples, and the same mini-batch gradient averaged over the two workers.
    replicated = read_metrics(
        train(
            "tiny_sd3",
            [
                *STEP_1_ONLY,
                f"trainer.output_dir={tmp_path}",
                "trainer.run_name=ddp",
                "trainer.n_gpus_per_node=2",
            ],
        )
    )
    # the run plan resolves auto; the config keeps what the user asked for
    assert json.loads((tmp_path / "ddp" / "plan.json").read_text())["strategy"] == "ddp"
    assert yaml_value(tmp_path / "ddp" / "config.yaml", "actor", "strategy") == "auto"
    for key in [k for k in single[1] if k.startswith(("rewards/", "advantages/")) and "seconds" not in k]:
        assert replicated[1][key] == pytest.approx(single[1][key], rel=1e-6), key
    for key in ("actor/loss", "actor/grad_norm"):
        assert replicated[1][key] == pytest.approx(metrics[1][key], rel=1e-4, abs=1e-9), key


#: A shapes job shrunk to two small steps that validate before and after (a 4-step schedule).
TWO_SMALL_STEPS = [
    "trainer.total_steps=2",
    "trainer.test_freq=2",
    "trainer.save_freq=2",
    "data.prompts_per_step=2",
    "rollout.n=4",
    "rollout.micro_batch_size=8",
    "actor.mini_batch_size=8",
    "actor.micro_batch_size=8",
    "rollout.pipeline.num_inference_steps=4",
    "rollout.val.num_inference_steps=4",
    "rollout.val.n=1",
]


@pytest.mark.parametrize(
    ("preset", "extra"),
    # the default job trains on steps 0-4, beyond the shrunk 4-step schedule: its range shrinks too
    [("shapes_async", []), (None, ["algorithm.train_step_range=[0,3]"]), ("shapes_flow_grpo", [])],
)
def test_default_job_short_run_writes_its_report(tmp_path, monkeypatch, shared_ray, preset, extra):
    """The default job (CFG-free DiffusionNFT on the shapes world with the shipped toy:shapes
    model), Flow-GRPO's CPU job (`shapes_flow_grpo`) and its one-step-off form with a separate
    trainer and rollout replica (`shapes_async`), shrunk to two small steps: each completes,
    validates before and after, and writes the report. `shapes_async` runs on Ray: it joins the
    tests' shared cluster (tests/conftest.py), which test_two_ray_workers_two_steps_end_to_end
    just before it started (the others run in this process and leave it be)."""
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    # the first prompt of each category of the balanced held-out file (the default job validates
    # on 384 prompts, the others on 96: the report needs every category, not the precision)
    firsts: dict[str, str] = {}
    for line in (BUILTIN_DATA / "shapes_heldout_balanced.jsonl").read_text().splitlines():
        firsts.setdefault(json.loads(line)["data_source"], line)
    val_file = tmp_path / "val.jsonl"
    val_file.write_text("\n".join(firsts.values()) + "\n")
    run_dir = train(
        preset,
        [
            f"data.val_files=[{val_file}]",
            *TWO_SMALL_STEPS,
            f"trainer.output_dir={tmp_path}",
            "trainer.run_name=default",
            "rollout.sde.window_range=[0,3]",
            *extra,
        ],
    )
    metrics = read_metrics(run_dir)
    assert 0 <= metrics[0]["val/rewards/shapes/accuracy_mean"] <= 1
    assert 0 <= metrics[2]["val/position/accuracy"] <= 1
    report = json.loads((run_dir / "report.json").read_text())
    assert (report["before_step"], report["after_step"]) == (0, 2)
    assert set(report["before"]) == set(report["after"])
    for name in ("before_after.png", "reward_curve.png", "summary.json"):
        assert (run_dir / name).is_file(), name


def test_old_log_prob_reuse_agrees_with_forced_recompute(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    common = [
        *SMALL,
        # the sampler's window at the actor's micro-batch, as the trainer recomputes it: CPU matmul
        # kernels may round differently at other batch sizes, so equal shapes give equal log-probs
        "rollout.micro_batch_size=4",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        f"trainer.output_dir={tmp_path}",
        "trainer.check_at_start=false",  # the start-up check is not what this compares
    ]
    reuse = read_metrics(train("tiny_sd3", [*common, "trainer.run_name=reuse"]))
    recompute = read_metrics(
        train("tiny_sd3", [*common, "trainer.run_name=recompute", "algorithm.old_log_probs=recompute"])
    )
    assert recompute[1]["rollout_correction/abs_logp_diff_max"] < 1e-4  # the reuse was valid
    for step in (1, 2):
        a, b = comparable(reuse[step]), comparable(recompute[step])
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), (step, key)


def test_policy_gradient_sampling_with_merged_lora_recomputes_old_log_probs(tmp_path, monkeypatch):
    """model.lora.merge_inference in a policy-gradient run: the rollouts sample with the adapter
    merged into the weights, `old_log_probs=auto` recomputes the old log-probs with the adapter as
    the update runs it, and the run trains as the unmerged recomputing run does."""
    from diffrl.train import engine as engine_module

    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    merges = []
    merged_adapter = engine_module.merged_adapter

    def counted(adapter, name):
        merges.append(name)
        return merged_adapter(adapter, name)

    monkeypatch.setattr(engine_module, "merged_adapter", counted)
    common = [
        *SMALL,
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        f"trainer.output_dir={tmp_path}",
        "trainer.check_at_start=false",  # the start-up check is not what this compares
    ]
    merged = read_metrics(
        train("tiny_sd3", [*common, "trainer.run_name=merged", "model.lora.merge_inference=true"])
    )
    assert merges and set(merges) == {"default"}  # every rollout sampled merged, nothing else did
    assert yaml_value(tmp_path / "merged" / "config.yaml", "algorithm", "old_log_probs") == "auto"
    rounds = merged[1]["rollout_correction/abs_logp_diff_max"]  # merged sampling against the adapter
    assert rounds < 1e-4
    assert merged[1]["actor/clipfrac"] == 0.0  # PPO's ratio starts at 1 on the recomputed log-probs
    merges.clear()
    recompute = read_metrics(
        train("tiny_sd3", [*common, "trainer.run_name=recompute", "algorithm.old_log_probs=recompute"])
    )
    assert merges == []
    for step in (1, 2):
        a, b = comparable(merged[step]), comparable(recompute[step])
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), (step, key)


def test_a_killed_run_resumes_exactly(tmp_path, monkeypatch):
    """`diffrl train` SIGKILLed after step 3 (before step 4's checkpoint) resumes from step 2's
    checkpoint and logs steps 3 and 4 as an uninterrupted run did. The uninterrupted run runs in
    this process; the killed and the resumed ones are `diffrl train` (its entry point,
    `diffrl.cli.main`) in processes forked from it, killed from outside as a user's would be (a
    fresh interpreter's imports would be most of a tiny run's time). All three compute on one
    thread, as a forked child must."""
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = [
        "tiny_sd3",
        "trainer.total_steps=4",
        "trainer.save_freq=2",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.check_at_start=false",  # the start-up check is not what this tests
    ]
    train(args[0], [*args[1:], f"trainer.output_dir={tmp_path}", "trainer.run_name=full"])

    killed_dir = tmp_path / "killed"
    cmd = ["train", *args, f"trainer.output_dir={tmp_path}", "trainer.run_name=killed"]
    pid = fork_cli(cmd, tmp_path / "killed.log")
    deadline = time.time() + 300
    while time.time() < deadline and 3 not in _steps(killed_dir):
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), (tmp_path / "killed.log").read_text()[-3000:]
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)  # after step 3, before step 4's checkpoint
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == -signal.SIGKILL
    assert not (killed_dir / "checkpoints" / "step_00000004").exists()

    code, output = run_forked_cli(cmd, tmp_path / "resumed.log")
    assert code == 0, output[-3000:]
    assert "resumed from" in output
    expected, got = read_metrics(tmp_path / "full"), read_metrics(killed_dir)
    for step in (3, 4):
        assert comparable(got[step]) == pytest.approx(comparable(expected[step]), rel=1e-6, abs=1e-9), step


def fork_cli(argv: list[str], log: Path) -> int:
    """`diffrl <argv>` in a child forked from this process, its output to `log`; returns its PID.
    The child computes on one thread (a forked child's OpenMP pool would hang: spawn_ranks.py)."""
    import torch

    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            out = open(log, "w", buffering=1)  # noqa: SIM115 (the child ends in os._exit)
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            sys.stdout = sys.stderr = out
            torch.set_num_threads(1)
            code = main(argv)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            os._exit(code)
    return pid


def run_forked_cli(argv: list[str], log: Path, timeout_s: float = 600) -> tuple[int, str]:
    """`fork_cli` to its end: its exit code and its output (killed after `timeout_s`)."""
    pid, deadline = fork_cli(argv, log), time.time() + timeout_s
    while (status := os.waitpid(pid, os.WNOHANG)) == (0, 0):
        if time.time() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(
                f"diffrl {' '.join(argv)} did not end within {timeout_s:g} s: {log.read_text()[-3000:]}"
            )
        time.sleep(0.05)
    return os.waitstatus_to_exitcode(status[1]), log.read_text()


def _steps(run_dir: Path) -> set[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return set()
    return {json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.path=/nonexistent/model", "is not a directory"),
        ("reward.functions.jpeg_compresibility.weight=1", "unknown reward 'jpeg_compresibility'"),
        ("data.train_files=[/nonexistent/prompts.txt]", "prompt file not found: /nonexistent/prompts.txt"),
        ("rollout.sde.noise_levle=1", "Did you mean 'noise_level'"),
    ],
)
def test_bad_inputs_fail_before_anything_starts(tmp_path, capsys, override, message):
    code = main(["train", "tiny_sd3", f"trainer.output_dir={tmp_path}", "trainer.run_name=bad", override])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()  # nothing half-written


def test_bad_data_rows_name_the_line(tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a cat"}\n{"caption": "a dog"}\n')
    code = main(
        [
            "train",
            "tiny_sd3",
            f"data.train_files=[{data}]",
            f"trainer.output_dir={tmp_path}",
            "trainer.run_name=bad",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "prompts.jsonl:2: no prompt key" in err and "data.prompt_key=caption" in err
    assert not (tmp_path / "bad").exists()


def test_preset_typo(capsys):
    assert main(["train", "tiny_sd4"]) == 2
    assert "Did you mean 'tiny_sd3'" in capsys.readouterr().err


def test_shapes_edit_job_short_run_writes_its_report_with_the_source_images(tmp_path, monkeypatch):
    """The edit task's RL job (`shapes_edit`, the shipped toy:shapes_edit model) shrunk to two
    small steps: it completes, validates every edit kind before and after, and its report's grid
    shows the source images: each held-out row's PNG, enlarged as the grid enlarges its tiles,
    appears in it pixel for pixel."""
    import shutil

    from PIL import Image

    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    firsts: dict[str, dict] = {}  # the first held-out row of each edit kind, with its source image
    for line in (BUILTIN_DATA / "shapes_edit_heldout.jsonl").read_text().splitlines():
        row = json.loads(line)
        firsts.setdefault(row["data_source"], row)
    for row in firsts.values():
        (tmp_path / row["image"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(BUILTIN_DATA / row["image"], tmp_path / row["image"])
    val_file = tmp_path / "val.jsonl"
    val_file.write_text("".join(json.dumps(row) + "\n" for row in firsts.values()))
    run_dir = train(
        "shapes_edit",
        [
            f"data.val_files=[{val_file}]",
            *TWO_SMALL_STEPS,
            f"trainer.output_dir={tmp_path}",
            "trainer.run_name=edit",
            "algorithm.train_step_range=[0,3]",
        ],
    )
    metrics = read_metrics(run_dir)
    for step in (0, 2):
        for kind in ("recolor", "reshape", "add", "remove", "move"):
            assert 0 <= metrics[step][f"val/{kind}/accuracy"] <= 1
    assert 0 <= metrics[1]["rewards/shapes_edit/mean"] <= 1  # the partial score
    report = json.loads((run_dir / "report.json").read_text())
    assert (report["before_step"], report["after_step"]) == (0, 2)
    for kind in ("recolor", "reshape", "add", "remove", "move"):
        assert report["before"][f"val/{kind}/accuracy"] == metrics[0][f"val/{kind}/accuracy"]
    grid = np.asarray(Image.open(run_dir / "before_after.png").convert("RGB"))
    for row in firsts.values():
        source = np.asarray(Image.open(BUILTIN_DATA / row["image"]).convert("RGB"))
        scale = -(-GRID_MIN_TILE // source.shape[0])  # the report's integer enlargement of a 32² tile
        assert contains(grid, source.repeat(scale, axis=0).repeat(scale, axis=1)), row["image"]


def contains(image: np.ndarray, patch: np.ndarray) -> bool:
    """Whether `patch` [h, w, 3] appears in `image` [H, W, 3] exactly, at any position."""

    def packed(rgb: np.ndarray) -> np.ndarray:  # one int per pixel
        rgb = rgb.astype(np.int64)
        return (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]

    big, small = packed(image), packed(patch)
    h, w = small.shape
    key = int(np.argmax([len(np.unique(r)) for r in small]))  # the patch's most varied row
    windows = np.lib.stride_tricks.sliding_window_view(big, w, axis=1)  # [H, W - w + 1, w], a view
    for y in range(key, big.shape[0] - h + key + 1):
        for x in np.nonzero((windows[y] == small[key]).all(axis=1))[0]:
            if np.array_equal(big[y - key : y - key + h, x : x + w], small):
                return True
    return False
