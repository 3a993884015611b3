import pytest
import torch

from diffrl.telemetry import PhaseTimer, memory_metrics, mfu_metrics, peak_flops, peak_flops_for_name


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


def test_phase_timer_sums_per_image_and_throughput_by_hand():
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    timer.reset()
    with timer.phase("gen"):
        clock.advance(6.0)
    with timer.phase("reward"):
        clock.advance(1.0)
    clock.advance(0.5)  # work between phases counts in the step, not in a phase
    with timer.phase("gen"):  # a phase entered twice in a step adds up
        clock.advance(2.0)
    with timer.phase("update_actor"):
        clock.advance(10.5)
    assert timer.seconds() == {"gen": 8.0, "reward": 1.0, "update_actor": 10.5}
    assert timer.metrics(images=16, gpus=2) == {
        "timing_s/gen": 8.0,
        "timing_per_image_s/gen": 0.5,
        "timing_s/reward": 1.0,
        "timing_per_image_s/reward": 1.0 / 16,
        "timing_s/update_actor": 10.5,
        "timing_per_image_s/update_actor": 10.5 / 16,
        "timing_s/step": 20.0,
        "throughput/images_per_s_per_gpu": 16 / (20.0 * 2),  # 0.4
    }
    # phases after the step's metrics: only their own times
    with timer.phase("checkpoint"):
        clock.advance(3.0)
    assert timer.metrics(0, 1, only=("checkpoint", "validation")) == {"timing_s/checkpoint": 3.0}
    timer.reset()
    assert timer.seconds() == {} and timer.metrics(0, 1) == {"timing_s/step": 0.0}


def test_phase_timer_counts_a_failed_phase_and_rejects_bad_use():
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    with pytest.raises(KeyError), timer.phase("ref"):
        clock.advance(2.0)
        raise KeyError("boom")
    assert timer.seconds() == {"ref": 2.0}
    with pytest.raises(RuntimeError, match="inside itself"), timer.phase("gen"), timer.phase("gen"):
        pass
    with pytest.raises(ValueError, match="lower_snake_case"), timer.phase("Update Actor"):
        pass
    with pytest.raises(ValueError, match="gpus"):
        timer.metrics(4, 0)


def test_phase_timer_real_clock_and_cpu_device():
    timer = PhaseTimer("cpu")
    with timer.phase("gen"):
        sum(range(1000))
    metrics = timer.metrics(4, 1)
    assert 0 <= metrics["timing_s/gen"] <= metrics["timing_s/step"]


def test_peak_flops_is_none_on_cpu_and_without_cuda(monkeypatch):
    assert peak_flops("cpu") is None
    assert peak_flops(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peak_flops("cuda") is None


def test_peak_flops_by_gpu_name(monkeypatch):
    table = {
        "NVIDIA H100 80GB HBM3": 989e12,
        "NVIDIA H100 PCIe": 756e12,
        "NVIDIA H100 NVL": 835e12,
        "NVIDIA H200": 989e12,
        "NVIDIA GH200 480GB": 989e12,
        "NVIDIA H20": 148e12,
        "NVIDIA A100-SXM4-80GB": 312e12,
        "NVIDIA A100 80GB PCIe": 312e12,
        "NVIDIA L40S": 362e12,
        "NVIDIA L40": 181e12,
        "NVIDIA L4": 121e12,
        "NVIDIA B200": 2.25e15,
        "NVIDIA GeForce RTX 4090": None,  # unlisted: no made-up number
        "Tesla V100-SXM2-32GB": None,
    }
    assert {name: peak_flops_for_name(name) for name in table} == table
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak_flops("cuda:0") == 756e12
    assert peak_flops(0) == 756e12
    monkeypatch.setenv("DIFFRL_PEAK_FLOPS", "1e15")
    assert peak_flops("cuda") == 1e15
    assert peak_flops("cpu") is None
    monkeypatch.setenv("DIFFRL_PEAK_FLOPS", "fast")
    with pytest.raises(ValueError, match="DIFFRL_PEAK_FLOPS"):
        peak_flops("cuda")


def test_mfu_by_hand():
    flops = {"gen": 4e15, "update_actor": 6e15}
    seconds = {"gen": 10.0, "reward": 2.0, "update_actor": 5.0}
    # gen: 4e15 / (10 s × 2 GPUs × 1e15) = 0.2; update: 6e15 / (5 × 2 × 1e15) = 0.6
    assert mfu_metrics(flops, seconds, gpus=2, peak=1e15) == {
        "perf/mfu/gen": pytest.approx(0.2),
        "perf/mfu/update_actor": pytest.approx(0.6),
    }
    # end to end: 10e15 / (20 s × 2 × 1e15) = 0.25
    assert mfu_metrics(flops, seconds, 2, 1e15, step_seconds=20.0)["perf/mfu/step"] == pytest.approx(0.25)
    assert mfu_metrics(flops, seconds, 2, None) == {}  # unknown peak: MFU is not logged
    with pytest.raises(ValueError, match="'ref'"):
        mfu_metrics({"ref": 1e12}, seconds, 1, 1e15)


def test_memory_metrics_on_cpu():
    metrics = memory_metrics("cpu")
    assert list(metrics) == ["perf/max_rss_gb"]
    assert 0.01 < metrics["perf/max_rss_gb"] < 1024  # this process holds torch: tens of MB at least


@pytest.mark.gpu
def test_memory_metrics_on_cuda_reset_per_call():
    device = torch.device("cuda")
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)  # 0.25 GB
    first = memory_metrics(device)
    assert first["perf/max_memory_allocated_gb"] >= 0.25
    del x
    second = memory_metrics(device)
    assert second["perf/max_memory_allocated_gb"] < 0.25
    timer = PhaseTimer(device)
    with timer.phase("gen"):
        torch.ones(1024, 1024, device=device).sum()
    assert timer.seconds()["gen"] > 0


def test_peak_over_workers_takes_each_maximum_and_its_rank():
    from diffrl.telemetry import peak_over_workers

    ranks = [
        {"perf/max_memory_allocated_gb": 10.0, "perf/max_rss_gb": 3.0},
        {"perf/max_memory_allocated_gb": 12.5, "perf/max_rss_gb": 3.0},
        {"perf/max_memory_allocated_gb": 11.0, "perf/max_rss_gb": 2.0},
    ]
    assert peak_over_workers(ranks) == {
        "perf/max_memory_allocated_gb": 12.5,
        "perf/max_memory_allocated_gb_rank": 1.0,
        "perf/max_rss_gb": 3.0,
        "perf/max_rss_gb_rank": 0.0,  # a tie names the lowest rank
    }
    # one worker: its own values, no rank keys
    assert peak_over_workers(ranks[:1]) == ranks[0]
