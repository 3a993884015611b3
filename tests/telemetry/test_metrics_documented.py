"""docs/metrics.md and what the loops log agree, both ways: short runs of the policy-gradient,
direct-preference (DiffusionNFT, AWM, Diffusion-DPO) and supervised loops log only documented
metrics, and every documented metric is logged by one of them unless it is listed below with the
reason it cannot appear here."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffrl.controller.run import train
from diffrl.controller.sft import sft
from diffrl.telemetry import read_metrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"

# Documented, and not logged by these CPU runs of the default loss settings.
NOT_IN_THESE_RUNS = {
    # CUDA only: no MFU without a known peak, no device memory on CPU
    "perf/mfu/<phase>": "GPU",
    "perf/mfu/step": "GPU",
    "perf/max_memory_allocated_gb": "GPU",
    "perf/max_memory_reserved_gb": "GPU",
    # several trainer workers only (tests/controller/test_train.py's 2-worker runs log them)
    "perf/max_memory_allocated_gb_rank": "GPU, several workers",
    "perf/max_memory_reserved_gb_rank": "GPU, several workers",
    "perf/max_rss_gb_rank": "several workers",
    # policy-gradient loss variants (tests/controller/test_policy_gradient_family.py runs them)
    "actor/ratio_mean_bias": "grpo_guard",
    "actor/sigma_t": "grpo_guard",
    "actor/sqrt_dt": "grpo_guard",
    "actor/kl_new_old_{mean,max}": "flow_dppo",
    "actor/{kl_mask,pos_rm,neg_rm,masked}_fraction": "flow_dppo",
    "actor/approx_kl": "flow_dppo",
    "actor/ratio_{min,max}": "flow_dppo",
    # separate placement only (tests/controller/test_placement.py logs them)
    "weight_sync/seconds": "separate",
    "weight_sync/bytes": "separate",
    "weight_sync/tensors": "separate",
    "weight_sync/full": "separate",
    "trainer/wait_seconds": "separate",
    "trainer/wait_fraction": "separate",
    "rollout/busy_seconds": "separate",
    "rollout/idle_fraction": "separate",
    "async/in_flight": "bounded staleness (tests/controller/test_bounded.py logs it)",
    # a second validation (these runs validate once; tests/controller/test_health_run.py logs it)
    "health/val_drop_z": "two validations",
}

PG = [
    "actor.loss.kl_coef=0.01",  # actor/kl and the ref phase
    "algorithm.old_log_probs=recompute",  # rollout_correction/* and the old_log_prob phase
    "algorithm.rollout_correction.is_level=step",
    "algorithm.rollout_correction.rejection=k3",
    "trainer.test_freq=1",
]
DIRECT = ["algorithm.trainer_type=direct_preference", "data.prompts_per_step=2", "actor.mini_batch_size=8"]
RUNS = {
    "pg": PG,
    "nft": [*DIRECT, "actor.loss.mode=diffusion_nft", "actor.loss.kl_coef=0.01"],
    "awm": [*DIRECT, "actor.loss.mode=awm", "actor.loss.kl_coef=0.01", "actor.loss.awm_ema_kl_coef=0.1"],
    "dpo": [*DIRECT, "actor.loss.mode=dpo"],
}


def pattern(name: str) -> re.Pattern:
    """A documented name as a regex: `<placeholder>` is one path segment, `{a,b}` either word."""
    out = re.escape(name)
    out = re.sub(r"<[^>]+>", "[^/]+", out.replace(r"\<", "<").replace(r"\>", ">"))
    out = re.sub(r"\\\{([^}]*)\\\}", lambda m: "(?:" + "|".join(m.group(1).split(",")) + ")", out)
    return re.compile(out.replace(r"\-", "-") + "$")


def documented() -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## The metrics") : text.index("## API")]
    names = []
    for line in section.splitlines():
        if line.startswith("| `"):
            names += re.findall(r"`([^`]+)`", line.split("|")[1])
    return names


def test_patterns():
    assert pattern("rewards/<name>/{mean,max}").match("rewards/ocr/max")
    assert not pattern("rewards/<name>/{mean,max}").match("rewards/a/b/max")
    assert pattern("actor/{kl_mask,pos_rm}_fraction").match("actor/pos_rm_fraction")
    assert not pattern("val/accuracy").match("val/accuracy/extra")


def is_documented(key: str, names: list[str]) -> bool:
    patterns = [pattern(n) for n in names if "…" not in n]
    if any(p.match(key) for p in patterns):
        return True
    # `val/rewards/…`: every rewards/ metric, on the validation prompts
    return key.startswith("val/rewards/") and any(p.match(key.removeprefix("val/")) for p in patterns)


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """{run: {step: metrics}} of one short run of each loop."""
    tmp = tmp_path_factory.mktemp("runs")
    mp = pytest.MonkeyPatch()
    mp.setenv("DIFFRL_CACHE", str(tmp / "cache"))
    common = [
        "trainer.total_steps=1",
        "trainer.save_freq=1",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]",
        f"trainer.output_dir={tmp}",
    ]
    keys = {}
    try:
        for name, overrides in RUNS.items():
            run_dir = train("tiny_sd3", [*common, f"trainer.run_name={name}", *overrides])
            keys[name] = read_metrics(run_dir / "metrics.jsonl")
        (tmp / "data").mkdir()
        rows = []
        for i in range(4):
            Image.fromarray(np.full((32, 32, 3), 40 * i, np.uint8)).save(tmp / "data" / f"{i}.png")
            rows.append({"prompt": "a square", "image": f"{i}.png"})
        (tmp / "data" / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        run_dir = sft(
            "shapes_sft",
            [
                *common,
                "trainer.run_name=sft",
                "trainer.test_freq=1",  # the shapes reward on the toy model: val/<category>/accuracy
                "model.path=tiny:toy",
                "model.dtype=float32",
                "sft.images=image",
                "sft.data_workers=0",
                f"data.train_files=[{tmp / 'data' / 'd.jsonl'}]",
                "data.prompts_per_step=4",
                "actor.mini_batch_size=4",
                "actor.micro_batch_size=4",
                "rollout.micro_batch_size=8",
                "rollout.pipeline.num_inference_steps=2",
                "rollout.val.n=2",  # 2 samples of its one single_object prompt: val/accuracy_se
            ],
        )
        keys["sft"] = read_metrics(run_dir / "metrics.jsonl")
    finally:
        mp.undo()
    return keys


def names_of(steps: dict) -> set[str]:
    # `time` is metrics.jsonl's own field (documented with the file format)
    return {k for metrics in steps.values() for k in metrics} - {"time"}


def test_every_logged_metric_is_documented(logged):
    names = documented()
    missing = {
        run: sorted(k for k in names_of(steps) if not is_documented(k, names))
        for run, steps in logged.items()
    }
    assert not any(missing.values()), f"logged but not in docs/metrics.md: {missing}"


def test_every_documented_metric_is_logged(logged):
    every = set().union(*(names_of(steps) for steps in logged.values()))
    unlogged = set()
    for name in documented():
        if name == "val/rewards/…":
            found = any(k.startswith("val/rewards/") for k in every)
        else:
            found = any(pattern(name).match(k) for k in every)
        if not found:
            unlogged.add(name)
    assert unlogged == set(NOT_IN_THESE_RUNS), (
        f"documented but never logged: {sorted(unlogged - set(NOT_IN_THESE_RUNS))}; "
        f"now logged, drop from NOT_IN_THESE_RUNS: {sorted(set(NOT_IN_THESE_RUNS) - unlogged)}"
    )


def test_validation_accuracy_is_logged_as_the_category_mean(logged):
    """val/accuracy is in metrics.jsonl (not only in the report): the mean over categories."""
    val = logged["sft"][1]
    categories = [
        v for k, v in val.items() if re.fullmatch(r"val/[^/]+/accuracy", k) and k != "val/rewards/accuracy"
    ]
    assert categories and val["val/accuracy"] == pytest.approx(float(np.mean(categories)))
