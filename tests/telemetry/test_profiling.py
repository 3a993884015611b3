"""Step profiles (`trainer.profile_steps`, diffrl.telemetry.profiling): the summary's attribution
against a trace computed by hand, real kernel names' kinds, and a profiled CPU run whose summary
agrees with its own trace file and with the step's phase timer."""

from __future__ import annotations

import contextlib
import gzip
import io
import json

import pytest
import torch

from diffrl.config import ConfigError, load_config
from diffrl.controller.run import train
from diffrl.telemetry.profiling import CALL_PREFIX, kernel_kind, summarise_trace
from diffrl.telemetry.sinks import read_metrics


def _span(name, ts, dur, cat="user_annotation", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def _kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}


def test_kernels_go_to_the_call_that_started_last_before_them():
    trace = {
        "traceEvents": [
            _kernel("sm90_xmma_gemm_bf16", 5, 5),  # before any call: unattributed
            _span(CALL_PREFIX + "sample", 100, 1000),
            # a decorated method inside another (a hybrid worker's sampler) is the same call
            _span(CALL_PREFIX + "sample_scored", 150, 500),
            _kernel("sm90_xmma_gemm_bf16", 200, 300),
            _kernel("flash_fwd_kernel", 400, 200),  # overlaps the GEMM by 100 us
            _kernel("triton_poi_fused_mul_0", 900, 100),
            _kernel("Memcpy DtoH (Device -> Pinned)", 1050, 150, cat="gpu_memcpy"),  # ends after the call
            _span(CALL_PREFIX + "staged_forward_backward", 2000, 400),
            _kernel("void at::native::elementwise_kernel", 2100, 100),
            _span(CALL_PREFIX + "staged_forward_backward", 3000, 400),
            _kernel("nvjet_tst_128x256", 3000, 400),
            _span("aten::mm", 3000, 10, cat="cpu_op"),  # a CPU op of a GPU trace: not work
        ]
    }
    summary = summarise_trace(trace)
    assert summary["device"] == "cuda"
    assert summary["unattributed_s"] == pytest.approx(5e-6)
    assert set(summary["calls"]) == {"sample", "staged_forward_backward"}
    sample = summary["calls"]["sample"]
    assert sample["calls"] == 1
    # wall: from the call's start to the end of its last kernel (1200), past the call's own end (1100)
    assert sample["wall_s"] == pytest.approx(1100e-6)
    # busy: [200, 600) + [900, 1000) + [1050, 1200) = 400 + 100 + 150 us
    assert sample["busy_s"] == pytest.approx(650e-6)
    assert sample["busy_fraction"] == pytest.approx(650 / 1100, abs=1e-4)
    # gaps: 100-200 (100 us), 600-900 (300 us), 1000-1050 (50 us): none of 1 ms or more
    assert sample["idle_s"] == pytest.approx({"under_50us": 0.0, "50us_to_1ms": 450e-6, "over_1ms": 0.0})
    assert sample["kinds_s"] == pytest.approx(
        {
            "matmul": 300e-6,
            "attention": 200e-6,
            "fused": 100e-6,
            "collective": 0.0,
            "other": 0.0,
            "memory": 150e-6,
        }
    )
    assert [top["name"] for top in sample["top"]] == [
        "sm90_xmma_gemm_bf16",
        "flash_fwd_kernel",
        "Memcpy DtoH (Device -> Pinned)",
        "triton_poi_fused_mul_0",
    ]
    update = summary["calls"]["staged_forward_backward"]
    assert update["calls"] == 2
    assert update["wall_s"] == pytest.approx(800e-6)
    assert update["busy_s"] == pytest.approx(500e-6)
    assert update["kinds_s"]["other"] == pytest.approx(100e-6)
    assert update["kinds_s"]["matmul"] == pytest.approx(400e-6)
    # the first call: 100 us before its kernel, 200 us after; the second none
    assert update["idle_s"] == pytest.approx({"under_50us": 0.0, "50us_to_1ms": 300e-6, "over_1ms": 0.0})


def test_idle_time_is_split_by_gap_length():
    trace = {
        "traceEvents": [
            _span(CALL_PREFIX + "optim_step", 0, 5000),
            _kernel("k", 10, 10),  # 10 us after the start
            _kernel("k", 30, 2970),  # 10 us later; then idle from 3000 to the call's end, 2 ms
        ]
    }
    entry = summarise_trace(trace)["calls"]["optim_step"]
    assert entry["idle_s"] == pytest.approx({"under_50us": 20e-6, "50us_to_1ms": 0.0, "over_1ms": 2000e-6})
    assert entry["busy_s"] == pytest.approx(2980e-6)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        # names as the H100/H200 traces of torch 2.11 print them
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "matmul"),
        ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "matmul"),
        (
            "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_64x1_tn_align8>",
            "matmul",
        ),
        ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", "matmul"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),
        ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "fused"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "other"),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collective"),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collective"),
    ],
)
def test_kernel_kinds(name, kind):
    assert kernel_kind(name) == kind


def test_profile_steps_are_checked(tmp_path):
    with pytest.raises(
        ConfigError, match=r"trainer.profile_steps=\[0\] is invalid.*from 1 to trainer.total_steps"
    ):
        load_config("tiny_sd3", ["trainer.profile_steps=[0]"])
    with pytest.raises(ConfigError, match=r"trainer.profile_steps=\[3\] is invalid.*\(2\)"):
        load_config("tiny_sd3", ["trainer.total_steps=2", "trainer.profile_steps=[3]"])


def _profiled_run(tmp_path, monkeypatch, *overrides):
    """A 2-step tiny SD3 run with its second step profiled; returns (run_dir, console text)."""
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_dir = train(
            "tiny_sd3",
            [
                f"trainer.output_dir={tmp_path}",
                "trainer.run_name=p",
                "trainer.total_steps=2",
                "trainer.save_freq=0",
                "trainer.test_freq=0",
                "trainer.val_before_train=false",
                "trainer.check_at_start=false",
                "trainer.profile_steps=[2]",
                *overrides,
            ],
        )
    return run_dir, printed.getvalue()


@pytest.mark.gpu
def test_a_profiled_gpu_step_sorts_its_kernels(tmp_path, monkeypatch):
    """On a GPU the summary counts CUDA kernels: GEMMs and attention in sampling and in the update,
    nearly all kernel time inside the worker calls."""
    run_dir, _ = _profiled_run(tmp_path, monkeypatch, "model.dtype=bfloat16")
    summary = json.loads((run_dir / "profile" / "step_2" / "summary.json").read_text())["workers"][
        "trainer_rank0"
    ]
    assert summary["device"] == "cuda"
    for call in ("sample_and_score", "staged_forward_backward"):
        kinds = summary["calls"][call]["kinds_s"]
        assert kinds["matmul"] > 0 and kinds["attention"] > 0, (call, kinds)
    busy = sum(entry["busy_s"] for entry in summary["calls"].values())
    assert summary["unattributed_s"] < 0.05 * busy


def test_a_profiled_step_writes_its_trace_and_a_summary_that_agrees_with_it(tmp_path, monkeypatch):
    run_dir, console = _profiled_run(tmp_path, monkeypatch)
    out = run_dir / "profile" / "step_2"
    assert sorted(p.name for p in out.iterdir()) == ["summary.json", "trainer_rank0.trace.json.gz"]
    assert not (run_dir / "profile" / "step_1").exists()
    recorded = json.loads((out / "summary.json").read_text())
    assert recorded["step"] == 2
    summary = recorded["workers"]["trainer_rank0"]
    # the summary is the trace file's own
    with gzip.open(out / summary["trace"], "rt") as f:
        assert {**summarise_trace(json.load(f)), "trace": summary["trace"]} == summary
    calls = summary["calls"]
    # (the same run on a GPU machine profiles CUDA kernels: the gpu-marked test checks those)
    on_cpu = summary["device"] == "cpu"
    assert on_cpu != torch.cuda.is_available()
    assert {"sample_and_score", "staged_forward_backward", "optim_step"} <= set(calls)
    step = read_metrics(run_dir / "metrics.jsonl")[2]
    # a call runs inside its phase of the step (the controller's own clock)
    assert 0 < calls["sample_and_score"]["wall_s"] <= step["timing_s/gen"] + 0.01
    assert 0 < calls["staged_forward_backward"]["wall_s"] <= step["timing_s/update_actor"] + 0.01
    for entry in calls.values():
        assert 0 <= entry["busy_s"] <= entry["wall_s"] + 1e-9
        assert sum(entry["idle_s"].values()) == pytest.approx(entry["wall_s"] - entry["busy_s"], abs=1e-5)
        if on_cpu:  # top-level operators of one thread never overlap; kernels of two streams may
            assert sum(entry["kinds_s"].values()) == pytest.approx(entry["busy_s"], rel=1e-3, abs=1e-5)
    assert calls["sample_and_score"]["kinds_s"]["matmul"] > 0
    assert f"profile of step 2: {out}" in console
    assert "staged_forward_backward: 2 call(s)" in console and "in gaps <50us / <1ms / longer" in console
