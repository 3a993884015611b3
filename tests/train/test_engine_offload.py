"""Offload options of the training engine: `TrainEngine.to`, `actor.optimizer_offload`,
`actor.activation_offload`.

On the CPU the host is the device, so `to` and the optimizer offload move nothing there: the CPU
tests check that every option leaves training bitwise unchanged (the same losses, gradients,
parameters and AdamW state as without it, also through a checkpoint and under 2-rank FSDP2) and
that `to` keeps every tensor and the optimizer's references to the parameters. The `gpu` tests
check the moves themselves and that accelerator memory drops (`pytest -m gpu` on a GPU).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import ClassVar

import pytest
import torch
from spawn_ranks import free_port, join_gloo, spawn_with_deadlines

from diffrl.config import ConfigError
from diffrl.config.schema import (
    ActorConfig,
    LoraConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    PipelineConfig,
    RolloutConfig,
    SdeConfig,
)
from diffrl.models import load_model
from diffrl.rollout import TrajectorySampler
from diffrl.train import distributed
from diffrl.train.batch import PolicyGradientBatch, TrainingTargets
from diffrl.train.engine import FlowMatchingBatch, GradientTerm, TrainEngine

SIZE = 32
PROMPTS = ["a red circle", "a blue square"]


def build(model_dir, *, rank=0, device="cpu", gradient_checkpointing=False, strategy="none", **offload):
    adapter = load_model(model_dir, dtype="float32", device=device)
    model_cfg = ModelConfig(
        dtype="float32",
        lora=LoraConfig(rank=rank, alpha=max(rank, 1)),
        gradient_checkpointing=gradient_checkpointing,
    )
    actor_cfg = ActorConfig(
        strategy=strategy,
        mini_batch_size=8,
        micro_batch_size=4,
        optim=OptimConfig(lr=1e-3, weight_decay=0.01),
        loss=LossConfig(clip_ratio=0.5, kl_coef=0.0),
        **offload,
    )
    return TrainEngine(adapter, model_cfg, actor_cfg, total_optim_steps=10)


def flow_batches(engine: TrainEngine, *, seed=0, count=2, micro=4, size=SIZE) -> list[FlowMatchingBatch]:
    """Supervised flow-matching micro-batches of random latents (a forward and backward through the
    whole transformer without sampling anything first)."""
    adapter = engine.adapter
    g = torch.Generator().manual_seed(seed)
    shape = adapter.latent_shape(size, size)
    cond = adapter.encode_prompts(PROMPTS * (micro // 2), None, max_sequence_length=8)
    batches = []
    for _ in range(count):
        latents = torch.randn((micro, *shape), generator=g)
        noise = torch.randn((micro, *shape), generator=g)
        sigmas_B = torch.rand(micro, generator=g) * 0.9 + 0.05
        dev = adapter.device
        batches.append(FlowMatchingBatch(latents.to(dev), noise.to(dev), sigmas_B.to(dev), cond, size, size))
    return batches


def train_flow(engine: TrainEngine, batches, steps: int) -> list[dict[str, float]]:
    metrics = []
    for _ in range(steps):
        m = engine.flow_matching_backward(batches, "none")
        metrics.append({**m, **engine.optim_step()})
    return metrics


def snapshot(engine: TrainEngine) -> dict[str, torch.Tensor]:
    """Every parameter, gradient and AdamW state tensor, as full CPU copies keyed by name."""

    def full(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().to("cpu", copy=True)

    out = {}
    names = {id(p): n for n, p in engine.transformer.named_parameters()}
    for n, p in engine.transformer.named_parameters():
        out[f"param:{n}"] = full(p)
        if p.grad is not None:
            out[f"grad:{n}"] = full(p.grad)
    for p, state in engine.optimizer.state.items():
        for key, value in state.items():
            out[f"optim:{names[id(p)]}:{key}"] = full(value)
    return out


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def assert_round_off_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Equal to float32 round-off: `save_on_cpu` hands backward a contiguous copy of each saved
    tensor (a transposed weight view included), so a kernel may sum in another order."""
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}")


def assert_metrics_close(a: dict[str, float], b: dict[str, float]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key


def devices(engine: TrainEngine) -> set[tuple[str, str]]:
    """{(kind, device type)} of the parameters, gradients and non-scalar AdamW state."""
    found = set()
    for p in engine.transformer.parameters():
        found.add(("param", p.device.type))
        if p.grad is not None:
            found.add(("grad", p.grad.device.type))
    for state in engine.optimizer.state.values():
        found |= {("optim", v.device.type) for v in state.values() if torch.is_tensor(v) and v.dim() > 0}
    return found


# ---------------------------------------------------------------------------------------- CPU


@pytest.fixture(scope="module")
def rollout_batches(tiny_model) -> list[PolicyGradientBatch]:
    """A base-policy rollout of 8 trajectories with advantages, as two micro-batches."""
    adapter = load_model(tiny_model("sd3"), dtype="float32")
    rollout_cfg = RolloutConfig(
        n=4,
        micro_batch_size=4,
        pipeline=PipelineConfig(
            height=SIZE, width=SIZE, num_inference_steps=4, guidance_scale=4.5, max_sequence_length=8
        ),
        sde=SdeConfig(noise_level=0.8, window_size=2, window_range=[0, 3]),
    )
    rollout = TrajectorySampler(adapter, rollout_cfg, progress=False).sample(PROMPTS, seed=3, step=0)
    batch = PolicyGradientBatch(
        rollout, TrainingTargets(advantages_B=torch.linspace(-1, 1, len(rollout)), batch_size=[len(rollout)])
    )
    return [batch.select(slice(0, 4)), batch.select(slice(4, 8))]


@pytest.mark.parametrize("rank", [0, 4], ids=["full", "lora"])
def test_optimizer_offload_trains_bitwise_like_without(tiny_model, rollout_batches, rank):
    runs = []
    for offload in (False, True):
        engine = build(tiny_model("sd3"), rank=rank, optimizer_offload=offload)
        metrics = []
        for _ in range(3):
            m = engine.forward_backward(rollout_batches)
            metrics.append({**m, **engine.optim_step()})
        runs.append((metrics, snapshot(engine), engine))
    (plain_metrics, plain, _), (offload_metrics, offloaded, engine) = runs
    assert plain_metrics == offload_metrics
    assert plain_metrics[-1]["grad_norm"] > 0 and plain_metrics[0]["loss"] != plain_metrics[-1]["loss"]
    assert any(k.startswith("optim:") for k in plain)  # AdamW state exists and is compared
    assert_bitwise_equal(plain, offloaded)
    assert ("optim", "cpu") in devices(engine)


def test_optimizer_offload_checkpoint_resumes_like_without(tiny_model, tmp_path):
    """A checkpoint written with the state offloaded equals one written without, and an offloaded
    engine that loads it steps on as a plain one does."""
    model_dir = tiny_model("sd3")
    plain = build(model_dir, rank=4)
    batches = flow_batches(plain)
    train_flow(plain, batches, 1)
    offloaded = build(model_dir, rank=4, optimizer_offload=True)
    train_flow(offloaded, batches, 1)
    offloaded.save(tmp_path / "ckpt", 1, {}, keep_last=None)

    resumed = build(model_dir, rank=4, optimizer_offload=True)
    resumed.load(next((tmp_path / "ckpt").iterdir()))
    assert resumed.optim_steps == 1
    assert_bitwise_equal(snapshot(plain), snapshot(resumed))
    assert train_flow(plain, batches, 1) == train_flow(resumed, batches, 1)
    assert_bitwise_equal(snapshot(plain), snapshot(resumed))


def test_to_round_trips_keep_every_tensor_and_the_optimizers_references(tiny_model):
    engine = build(tiny_model("sd3"), rank=0)
    batches = flow_batches(engine)
    train_flow(engine, batches, 1)  # AdamW state exists
    engine.flow_matching_backward(batches, "none")  # and gradients
    before = snapshot(engine)
    assert any(k.startswith("grad:") for k in before) and any(k.startswith("optim:") for k in before)
    params = list(engine.transformer.parameters())
    grads = [p.grad for p in params]
    for call in (
        dict(device="cpu"),
        dict(device="device"),
        dict(device="cpu"),  # already there: nothing to do
        dict(device="cpu", model=False, grad=False),
        dict(device="device", optimizer=False),
        dict(device="device"),
    ):
        engine.to(**call)
    assert_bitwise_equal(before, snapshot(engine))
    assert all(a is b for a, b in zip(params, engine.transformer.parameters(), strict=True))
    assert {id(p) for p in engine.optimizer.param_groups[0]["params"]} == {id(p) for p in params}
    assert all(p.grad is not None for p in params) and len(grads) == len(params)
    assert devices(engine) == {("param", "cpu"), ("grad", "cpu"), ("optim", "cpu")}
    engine.optim_step()  # the moved engine still trains
    assert not torch.equal(before[f"param:{next(iter(engine.transformer.named_parameters()))[0]}"], params[0])


def test_to_names_the_devices_it_knows(tiny_model):
    engine = build(tiny_model("sd3"), rank=4)
    with pytest.raises(ValueError, match=r"TrainEngine.to\('cuda:0'\).*'cpu' or 'device'"):
        engine.to("cuda:0")


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
def test_activation_offload_gives_the_same_gradients(tiny_model, checkpointing):
    results = []
    for offload in (False, True):
        engine = build(
            tiny_model("sd3"), rank=4, gradient_checkpointing=checkpointing, activation_offload=offload
        )
        metrics = engine.flow_matching_backward(flow_batches(engine), "none")
        results.append((metrics, snapshot(engine)))
    assert_metrics_close(results[0][0], results[1][0])
    assert any(k.startswith("grad:") for k in results[0][1])
    assert_round_off_equal(results[0][1], results[1][1])


def test_activation_offload_with_compiled_blocks_gives_the_same_gradients(tiny_model):
    """Regional compilation saves each block's tensors through AOTAutograd's autograd.Function:
    `save_on_cpu` packs them as it does eager ones (aot_eager: the same autograd path as inductor,
    without its compile time)."""
    results = []
    for offload in (False, True):
        torch._dynamo.reset()
        engine = build(tiny_model("sd3"), rank=4, activation_offload=offload)
        engine.adapter.compile_blocks(backend="aot_eager")
        batches = flow_batches(engine)
        metrics = engine.flow_matching_backward(batches, "none")
        results.append((metrics, snapshot(engine)))
    torch._dynamo.reset()
    assert_metrics_close(results[0][0], results[1][0])
    assert_round_off_equal(results[0][1], results[1][1])


class _RecordSaved(torch.autograd.Function):
    """y = x²; records the storage of the x that backward gets back."""

    seen: ClassVar[list[int]] = []

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        _RecordSaved.seen.append(x.untyped_storage().data_ptr())
        return 2 * x * grad


@pytest.mark.parametrize("offload", [False, True])
def test_activation_offload_hands_backward_a_host_copy(tiny_model, offload):
    """With activation offload what a forward saves reaches backward as a copy (it waited in
    host memory), without it as the tensor itself; the gradient is the same."""
    engine = build(tiny_model("sd3"), rank=4, activation_offload=offload)
    x = torch.arange(1.0, 4.0).requires_grad_()
    saved = []

    def forward():
        h = x * 1.0  # a non-leaf: the tensor autograd saves
        saved.append(h.untyped_storage().data_ptr())
        return _RecordSaved.apply(h).sum(), {}

    _RecordSaved.seen.clear()
    engine.accumulate([GradientTerm(forward, 1.0)])
    assert torch.equal(x.grad, 2 * torch.arange(1.0, 4.0))
    assert (_RecordSaved.seen[0] != saved[0]) == offload


def test_optimizer_offload_with_param_offload_is_refused():
    with pytest.raises(ConfigError, match=r"actor\.optimizer_offload=True.*param_offload=true"):
        ActorConfig(param_offload=True, optimizer_offload=True).validate("actor")
    ActorConfig(optimizer_offload=True, activation_offload=True).validate("actor")


# ------------------------------------------------------------------------------ 2-rank FSDP2 (gloo)

WORLD = 2
START_DEADLINE_S = 120.0
RUN_DEADLINE_S = 180.0


def _fsdp_worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    join_gloo(rank, WORLD, port, out_dir, 30)
    try:
        results = {}
        for name in ("plain", "optimizer_offload"):
            engine = build(model_dir, rank=4, strategy="fsdp2", optimizer_offload=name != "plain")
            assert engine._sharded
            batches = flow_batches(engine, seed=rank)  # each rank its own data
            metrics = train_flow(engine, batches, 1)
            engine.flow_matching_backward(batches, "none")  # gradients outstanding
            engine.to("cpu")
            engine.to("device")
            metrics += [{**engine.optim_step()}]
            engine.to("cpu", model=False)
            metrics += train_flow(engine, batches, 1)
            results[name] = {"metrics": metrics, "state": snapshot(engine)}
        # activation offload: one backward of the same data, its gradients against the plain one's
        for name in ("plain_grads", "activation_offload"):
            engine = build(model_dir, rank=4, strategy="fsdp2", activation_offload=name != "plain_grads")
            metrics = engine.flow_matching_backward(flow_batches(engine, seed=rank), "none")
            results[name] = {"metrics": [metrics], "state": snapshot(engine)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        distributed.shutdown_distributed()


def test_fsdp2_engine_moves_and_offloads_like_a_plain_one(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a CPU mesh, as in CI
    spawn_with_deadlines(
        _fsdp_worker,
        (free_port(), str(tiny_model("sd3")), str(tmp_path)),
        WORLD,
        tmp_path,
        start_s=START_DEADLINE_S,
        run_s=RUN_DEADLINE_S,
        what="FSDP2 offload",
        fork=True,  # the ranks start from this process's imports (tests/train/spawn_ranks.py)
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for result in ranks:
        assert result["plain"]["metrics"] == result["optimizer_offload"]["metrics"]
        assert_bitwise_equal(result["plain"]["state"], result["optimizer_offload"]["state"])
        assert_metrics_close(result["plain_grads"]["metrics"][0], result["activation_offload"]["metrics"][0])
        assert any(k.startswith("grad:") for k in result["activation_offload"]["state"])
        assert_round_off_equal(result["plain_grads"]["state"], result["activation_offload"]["state"])
    # FSDP averaged the ranks' different gradients: both hold the same full model
    assert_bitwise_equal(ranks[0]["plain"]["state"], ranks[1]["plain"]["state"])
    assert ranks[0]["plain"]["metrics"][-1]["grad_norm"] > 0


# ---------------------------------------------------------------------------------------- GPU


def _cuda_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.gpu
def test_gpu_to_offloads_frees_memory_and_restores_bitwise(tiny_model):
    engine = build(tiny_model("sd3"), rank=0, device="cuda")
    batches = flow_batches(engine)
    train_flow(engine, batches, 1)
    engine.flow_matching_backward(batches, "none")
    params = list(engine.transformer.parameters())
    # counted without holding the tensors: a reference held here would keep their memory allocated
    moved_bytes = (
        _cuda_bytes(params)
        + _cuda_bytes(p.grad for p in params)
        + _cuda_bytes(
            v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
        )
    )
    before = snapshot(engine)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()

    with pytest.raises(ValueError, match="apart from their parameters"):
        engine.to("cpu", model=False, grad=True)
    with pytest.raises(ValueError, match="apart from their parameters"):
        engine.to("cpu", grad=False)
    engine.to("cpu")
    assert devices(engine) == {("param", "cpu"), ("grad", "cpu"), ("optim", "cpu")}
    freed = allocated - torch.cuda.memory_allocated()
    assert freed >= 0.99 * moved_bytes, (freed, moved_bytes)
    assert torch.cuda.memory_reserved() <= torch.cuda.memory_allocated() + 64 * 2**20  # empty_cache ran

    engine.to("device")
    assert devices(engine) == {("param", "cuda"), ("grad", "cuda"), ("optim", "cuda")}
    assert all(a is b for a, b in zip(params, engine.transformer.parameters(), strict=True))
    assert_bitwise_equal(before, snapshot(engine))
    engine.optim_step()


@pytest.mark.gpu
def test_gpu_optimizer_offload_is_bitwise_and_keeps_the_state_off_the_device(tiny_model):
    """Both engines step on the same gradients (the plain engine's, copied), so the comparison
    does not depend on whether the backward kernels are deterministic: only the optimizer state's
    trip through host memory differs."""
    model_dir = tiny_model("sd3")
    plain = build(model_dir, rank=0, device="cuda")
    offloaded = build(model_dir, rank=0, device="cuda", optimizer_offload=True)
    batches = flow_batches(plain)
    for _ in range(3):
        plain.flow_matching_backward(batches, "none")
        for a, b in zip(plain.params, offloaded.params, strict=True):
            b.grad = a.grad.clone()
        assert plain.optim_step() == offloaded.optim_step()
    assert_bitwise_equal(snapshot(plain), snapshot(offloaded))
    assert ("optim", "cuda") not in devices(offloaded) and ("optim", "cpu") in devices(offloaded)
    state_bytes = _cuda_bytes(
        v for s in offloaded.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
    )
    torch.cuda.synchronize()
    outside_step = torch.cuda.memory_allocated()
    offloaded.to("device", model=False, grad=False)  # what the plain engine holds between steps
    assert torch.cuda.memory_allocated() - outside_step >= 0.99 * state_bytes
    offloaded.to("cpu", model=False, grad=False)
    assert torch.cuda.memory_allocated() == outside_step


@pytest.mark.gpu
def test_gpu_fsdp2_engine_moves_its_shards(tiny_model, monkeypatch):
    """A 1-rank NCCL group: the FSDP2 path of `to` (module.to on DTensor parameters) and the
    optimizer offload of a sharded engine."""
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    distributed.init_distributed("nccl", timeout=timedelta(seconds=60))
    try:
        engine = build(tiny_model("sd3"), rank=0, device="cuda", strategy="fsdp2", optimizer_offload=True)
        assert engine._sharded
        batches = flow_batches(engine)
        train_flow(engine, batches, 1)
        assert ("optim", "cuda") not in devices(engine) and ("optim", "cpu") in devices(engine)
        engine.flow_matching_backward(batches, "none")
        before = snapshot(engine)
        params = list(engine.transformer.parameters())
        # counted without holding the local shards: a reference held here would keep them allocated
        moved_bytes = _cuda_bytes(p.to_local() for p in params) + _cuda_bytes(
            p.grad.to_local() for p in engine.params
        )
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        engine.to("cpu")
        assert devices(engine) == {("param", "cpu"), ("grad", "cpu"), ("optim", "cpu")}
        assert allocated - torch.cuda.memory_allocated() >= 0.99 * moved_bytes
        engine.to("device")
        assert devices(engine) == {("param", "cuda"), ("grad", "cuda"), ("optim", "cuda")}
        assert all(a is b for a, b in zip(params, engine.transformer.parameters(), strict=True))
        assert_bitwise_equal(before, snapshot(engine))
        engine.optim_step()  # the sharded engine trains after the round trip, and offloads again
        assert ("optim", "cuda") not in devices(engine)
        train_flow(engine, batches, 1)
    finally:
        distributed.shutdown_distributed()


@pytest.mark.gpu
def test_gpu_activation_offload_lowers_the_training_peak(tiny_model):
    """Large images on the tiny model: activations dominate, and with the offload they wait in
    host memory instead of on the device."""
    peaks, grads = [], []
    for offload in (False, True):
        engine = build(tiny_model("sd3"), rank=4, device="cuda", activation_offload=offload)
        batches = flow_batches(engine, count=1, micro=32, size=256)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        engine.flow_matching_backward(batches, "none")
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        grads.append(snapshot(engine))
        del engine, batches
        torch.cuda.empty_cache()
    assert_round_off_equal(grads[0], grads[1])
    assert peaks[1] < 0.7 * peaks[0], peaks
