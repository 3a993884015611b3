"""End-to-end runs of the direct-preference trainer on CPU with the tiny SD3 (DiffusionNFT, AWM,
Diffusion-DPO online and offline): the whole loop with real components, kept to two small steps."""

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.cli import main
from diffrl.controller.run import train
from diffrl.data.preference import CACHE_DIR, CACHE_FILE
from diffrl.telemetry import read_metrics
from diffrl.train.engine import OLD, POLICY
from diffrl.workers.checkpointing import Checkpointing
from diffrl.workers.roles import HybridWorker

FAST = [
    "algorithm.trainer_type=direct_preference",
    "trainer.val_before_train=false",
    "trainer.test_freq=0",
    "trainer.save_freq=2",
    "data.prompts_per_step=2",  # 8 images: one optimizer step per training step
    "actor.mini_batch_size=8",
]
NOT_COMPARABLE = ("timing", "throughput", "perf/", "time", "memory")


def run(tmp_path, name, *overrides, steps=2):
    return train(
        "tiny_sd3",
        [
            *FAST,
            f"trainer.total_steps={steps}",
            f"trainer.output_dir={tmp_path}",
            f"trainer.run_name={name}",
            *overrides,
        ],
    )


def comparable(row):
    """Everything but wall-clock measurements."""
    return {k: v for k, v in row.items() if not k.startswith(NOT_COMPARABLE) and "seconds" not in k}


def lora(engine, name):
    return {
        n.replace(f".{name}.", "."): p.detach().clone()
        for n, p in engine.transformer.named_parameters()
        if f".{name}." in n
    }


@pytest.fixture
def recorded(monkeypatch):
    """The trained adapter before the first and after every optimizer step, and both adapters at
    every checkpoint save, recorded from the (in-process) worker."""
    records = {"policy": [], "saved": []}
    optim_step, save = HybridWorker.optim_step, Checkpointing.save

    def recording_optim_step(self):
        if not records["policy"]:
            records["policy"].append(lora(self.engine, POLICY))
        out = optim_step(self)
        records["policy"].append(lora(self.engine, POLICY))
        return out

    def recording_save(self, *args):
        records["saved"].append({"old": lora(self.engine, OLD), "policy": lora(self.engine, POLICY)})
        return save(self, *args)

    monkeypatch.setattr(HybridWorker, "optim_step", recording_optim_step)
    monkeypatch.setattr(Checkpointing, "save", recording_save)
    return records


def test_nft_old_adapter_follows_its_schedule_and_resumes_exactly(tmp_path, monkeypatch, recorded):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    nft = [
        "actor.loss.mode=diffusion_nft",
        "algorithm.old_policy.decay=0.6",
        "algorithm.timestep_fraction=0.5",
    ]
    full = read_metrics(run(tmp_path, "full", *nft) / "metrics.jsonl")
    for step in (1, 2):
        for key in ("rewards/mean", "actor/loss", "actor/grad_norm", "actor/old_deviate"):
            assert math.isfinite(full[step][key]), (step, key)
        assert full[step]["actor/old_policy_decay"] == 0.6
    # old starts as a copy of the trained adapter, then after optimizer steps 1 and 2:
    # old ← 0.6·old + 0.4·θ_k (θ_k: the trained adapter after step k)
    init, after_1, after_2 = recorded["policy"]
    expected = {k: 0.6 * (0.6 * init[k] + 0.4 * after_1[k]) + 0.4 * after_2[k] for k in init}
    old = recorded["saved"][-1]["old"]
    assert old.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(old[key], expected[key], rtol=1e-5, atol=1e-7)
    assert any(not torch.allclose(old[k], after_2[k]) for k in old)  # a lagging, not a copied, old policy
    assert full[2]["actor/old_deviate"] > 0  # step 2 trained against the lagging old policy

    # stop after step 1, resume: the old adapter comes back from the checkpoint (it also samples
    # step 2), so step 2 and the final adapters are those of the uninterrupted run
    run(tmp_path, "resumed", *nft, "trainer.save_freq=1", steps=1)
    resumed = read_metrics(run(tmp_path, "resumed", *nft, "trainer.save_freq=1") / "metrics.jsonl")
    got, want = comparable(resumed[2]), comparable(full[2])
    assert got == pytest.approx(want, rel=1e-6, abs=1e-9)
    for name in ("old", "policy"):
        for key, value in recorded["saved"][-1][name].items():
            torch.testing.assert_close(value, expected[key] if name == "old" else after_2[key])


def test_nft_under_fsdp2_trains_as_without_it(tmp_path, monkeypatch):
    """DiffusionNFT samples as `old` before any update, so FSDP2's first unshard used to fix the
    trained adapter's requires_grad at False (peft's set_adapter flips it) and the first backward
    failed ("element 0 of tensors does not require grad"); FSDP2 on a one-rank group now logs the
    metrics of the unsharded run."""
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    nft = ["actor.loss.mode=diffusion_nft", "algorithm.timestep_fraction=0.5", "trainer.save_freq=0"]
    plain = read_metrics(run(tmp_path, "plain", *nft, steps=1) / "metrics.jsonl")
    sharded = read_metrics(run(tmp_path, "fsdp2", *nft, "actor.strategy=fsdp2", steps=1) / "metrics.jsonl")
    assert comparable(sharded[1]) == pytest.approx(comparable(plain[1]), rel=1e-5, abs=1e-8)


@pytest.mark.parametrize(
    ("mode", "extra", "keys"),
    [
        (
            "awm",
            [
                "actor.loss.awm_ema_kl_coef=0.5",
                "algorithm.timestep_fraction=0.5",
                "algorithm.train_step_range=[0,2]",
            ],
            ["actor/ema_kl", "actor/matching_loss"],
        ),
        ("dpo", ["actor.loss.dpo_beta=100"], ["actor/implicit_acc", "actor/reward_margin", "dpo/pairs"]),
    ],
)
def test_awm_and_online_dpo_run_two_steps(tmp_path, monkeypatch, mode, extra, keys):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    metrics = read_metrics(run(tmp_path, mode, f"actor.loss.mode={mode}", *extra) / "metrics.jsonl")
    for step in (1, 2):
        for key in ("rewards/mean", "actor/loss", "actor/grad_norm", *keys):
            assert math.isfinite(metrics[step][key]), (step, key)
    if mode == "awm":
        # ⌊2 steps · 0.5⌋ levels per sample: the range's 2 of the schedule's 4 steps reach the worker
        assert metrics[2]["actor/noise_levels"] == 1
    else:
        assert 1 <= metrics[1]["dpo/pairs"] <= 2  # at most one pair per prompt group


def write_pairs(root, rows=4, missing=None):
    rng = np.random.default_rng(0)
    (root / "images").mkdir(parents=True)
    lines = []
    for i in range(rows):
        for side in ("a", "b"):
            if (i, side) != missing:
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(
                    root / "images" / f"{i}{side}.png"
                )
        lines.append(
            json.dumps(
                {"prompt": f"prompt {i % 2}", "chosen": f"images/{i}a.png", "rejected": f"images/{i}b.png"}
            )
        )
    (root / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    return root / "pairs.jsonl"


def test_offline_dpo_encodes_the_dataset_once_and_a_resumed_run_reuses_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    data = write_pairs(tmp_path / "data")
    offline = [
        "actor.loss.mode=dpo",
        "algorithm.sample_source=offline",
        "rollout.n=2",
        f"data.train_files=[{data}]",
        "actor.mini_batch_size=4",
        "trainer.save_freq=1",
    ]
    run_dir = run(tmp_path, "offline", *offline, steps=1)
    cache = run_dir / CACHE_DIR / CACHE_FILE
    assert "encoded 4 preference pairs and 2 prompts" in capsys.readouterr().out
    stamp = cache.stat().st_mtime_ns

    # the cache holds each image's encoding: the VAE's posterior mode, as a fresh adapter computes it
    from safetensors.torch import load_file

    from diffrl.models import load_model

    tensors = load_file(str(cache))
    adapter = load_model("tiny:sd3", dtype="float32")
    pixels = torch.from_numpy(np.array(Image.open(data.parent / "images" / "2b.png"))).permute(2, 0, 1)[None]
    torch.testing.assert_close(tensors["rejected"][2:3], adapter.encode(pixels))
    assert tensors["prompt_index"].tolist() == [0, 1, 0, 1]

    metrics = read_metrics(run(tmp_path, "offline", *offline, steps=2) / "metrics.jsonl")
    out = capsys.readouterr().out
    assert "resumed from" in out and "reusing the cached preference encodings" in out
    assert cache.stat().st_mtime_ns == stamp
    for step in (1, 2):
        assert metrics[step]["dpo/pairs"] == 2
        for key in ("actor/loss", "actor/implicit_acc", "actor/grad_norm"):
            assert math.isfinite(metrics[step][key]), (step, key)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["actor.loss.mode=diffusion_nft"],
            "actor.loss.mode=diffusion_nft needs algorithm.trainer_type=direct_preference",
        ),
        (
            ["algorithm.trainer_type=direct_preference"],
            "actor.loss.mode=flow_grpo needs algorithm.trainer_type=policy_gradient",
        ),
        (
            [
                "algorithm.trainer_type=direct_preference",
                "actor.loss.mode=awm",
                "algorithm.sample_source=offline",
            ],
            "only actor.loss.mode=dpo",
        ),
        (
            [
                "algorithm.trainer_type=direct_preference",
                "actor.loss.mode=dpo",
                "algorithm.old_policy.decay=0.5",
            ],
            "algorithm.old_policy has no effect",
        ),
        (
            ["model.lora.merge_inference=true", "algorithm.old_log_probs=rollout"],
            "PPO's ratio would start off 1",
        ),
        (
            [
                "model.lora.merge_inference=true",
                "trainer.placement=separate",
                "trainer.async_mode=one_step_off",
                "rollout.replicas=1",
            ],
            "must run the adapter as the trainer's update does",
        ),
        (
            [
                "model.lora.merge_inference=true",
                "model.lora.rank=0",
                "algorithm.trainer_type=direct_preference",
                "actor.loss.mode=awm",
            ],
            "needs LoRA adapters to merge",
        ),
        (
            [
                "model.lora.merge_inference=true",
                "algorithm.trainer_type=direct_preference",
                "actor.loss.mode=awm",
                "actor.strategy=fsdp2",
                "trainer.n_gpus_per_node=2",
            ],
            "needs unsharded weights",
        ),
    ],
)
def test_mismatched_settings_fail_before_anything_starts(tmp_path, capsys, overrides, message):
    code = main(["train", "tiny_sd3", f"trainer.output_dir={tmp_path}", "trainer.run_name=bad", *overrides])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_a_bad_preference_row_names_the_row_and_the_column(tmp_path, capsys):
    data = write_pairs(tmp_path / "data", rows=3, missing=(1, "b"))
    code = main(
        [
            "train",
            "tiny_sd3",
            "algorithm.trainer_type=direct_preference",
            "actor.loss.mode=dpo",
            "algorithm.sample_source=offline",
            "rollout.n=2",
            f"data.train_files=[{data}]",
            f"trainer.output_dir={tmp_path}",
            "trainer.run_name=bad",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "pairs.jsonl:2: column 'rejected'" in err and "1b.png not found" in err
    assert not (tmp_path / "bad").exists()
