"""FSDP2 sharding and activation checkpointing on the tiny SD3 transformer (CPU, gloo).

The reference for every sharded run is the same training done in this (pytest) process on one
device without FSDP: the same initial weights, the whole global batch at once. Two gloo processes
(spawned once for the module, all scenarios in one go to keep the file fast) each train on half of
the batch; FSDP averages their gradients, which equals the gradient of the global-batch mean, so
losses and updated weights must agree within float32 round-off. Each comparison also checks that
the weights moved by much more than the tolerance, so agreement is not the trivial one.
"""

from __future__ import annotations

import copy
import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from diffusers.training_utils import cast_training_params
from peft import LoraConfig
from spawn_ranks import start_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from diffrl.models import load_model
from diffrl.models.blocks import find_blocks
from diffrl.train import distributed
from diffrl.train.fsdp import enable_activation_checkpointing, shard_transformer

WORLD = 2
GLOBAL_BATCH = 4
LORA_STEPS = 3
FULL_STEPS = 2
LR = 1e-3
BLOCKS = ("JointTransformerBlock",)  # SD3Adapter.block_class_names
LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.to_add_out"]


# ---------------------------------------------------------------------------------------------- shared code
def batch(transformer) -> dict[str, torch.Tensor]:
    """A fixed global batch for the tiny SD3 transformer, plus a regression target."""
    cfg = transformer.config
    g = torch.Generator().manual_seed(1234)
    side = cfg.sample_size
    return {
        "hidden_states": torch.randn(GLOBAL_BATCH, cfg.in_channels, side, side, generator=g),
        "encoder_hidden_states": torch.randn(GLOBAL_BATCH, 6, cfg.joint_attention_dim, generator=g),
        "pooled_projections": torch.randn(GLOBAL_BATCH, cfg.pooled_projection_dim, generator=g),
        "timestep": torch.tensor([900.0, 600.0, 300.0, 50.0]),
        "target": torch.randn(GLOBAL_BATCH, cfg.out_channels, side, side, generator=g),
    }


def rows(inputs: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    per = GLOBAL_BATCH // world
    return {k: v[rank * per : (rank + 1) * per] for k, v in inputs.items()}


def forward(transformer, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return transformer(
        hidden_states=inputs["hidden_states"],
        encoder_hidden_states=inputs["encoder_hidden_states"],
        pooled_projections=inputs["pooled_projections"],
        timestep=inputs["timestep"],
    ).sample


def add_lora(transformer) -> None:
    """The engine's injection (diffusers' PEFT integration), with a seeded init."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer.add_adapter(
            LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=True),
            adapter_name="default",
        )


def train(transformer, inputs, steps: int, *, lora: bool, reduce=lambda m: m):
    """AdamW steps of MSE(out, target). With LoRA, each step first runs the reference (adapters
    disabled, no grad) as a KL term would. Returns per-step losses, reference outputs, and the
    first step's (unsharded) gradients: AdamW hides a gradient's scale, so they are checked too."""
    named = [(n, p) for n, p in transformer.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([p for _, p in named], lr=LR, weight_decay=0.01)
    losses, refs, first_grads = [], [], {}
    for step in range(steps):
        if lora:
            with torch.no_grad():
                transformer.disable_adapters()
                refs.append(forward(transformer, inputs).detach())
                transformer.enable_adapters()
        loss = F.mse_loss(forward(transformer, inputs), inputs["target"])
        loss.backward()
        if step == 0:
            first_grads = {
                n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone() for n, p in named
            }
        optimizer.step()
        optimizer.zero_grad()
        losses.append(reduce({"loss": loss.item()})["loss"])
    return losses, refs, first_grads


def full_params(module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """Unsharded copies (a collective under FSDP: every rank calls it in the same order)."""
    out = {}
    for name, p in module.named_parameters():
        if trainable_only and not p.requires_grad:
            continue
        out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    return out


# ---------------------------------------------------------------------------------------------- workers
def _join(rank: int, port: int, backend: str | None) -> torch.device:
    """What a launcher does: the env vars, then init_distributed."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    return distributed.init_distributed(backend, timeout=timedelta(seconds=60))


def _worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    device = _join(rank, port, "gloo")
    # A CPU mesh, also on a machine with GPUs (FSDP2's default mesh would take the GPUs there).
    mesh = init_device_mesh("cpu", (WORLD,))
    try:
        result = {
            "device": str(device),
            "rank": distributed.rank(),
            "world": distributed.world_size(),
            "mean": distributed.all_reduce_mean({"b": 10.0 * rank + 1, "a": float(rank)}),
        }
        reduce = distributed.all_reduce_mean

        tr = load_model(model_dir, dtype="float32").transformer
        try:
            shard_transformer(tr, BLOCKS, param_dtype=None, cpu_offload=True, mesh=mesh)
        except ValueError as err:
            result["offload_error"] = str(err)

        # LoRA + activation checkpointing, fp32, one adapter trained, reference = adapters disabled.
        tr = load_model(model_dir, dtype="float32").transformer
        add_lora(tr)
        inputs = rows(batch(tr), rank, WORLD)
        enable_activation_checkpointing(tr, BLOCKS)
        shard_transformer(tr, BLOCKS, param_dtype=None, mesh=mesh)
        lora_a = tr.transformer_blocks[0].attn.to_q.lora_A["default"].weight
        result["lora_units"] = sum(isinstance(m, FSDPModule) for m in tr.modules())
        # fully_shard swaps each block's class for a generated FSDP subclass: compilation and
        # checkpointing must still find the blocks afterwards (compile_blocks uses find_blocks)
        result["blocks_after_sharding"] = [type(b).__name__ for b in find_blocks(tr, BLOCKS)]
        result["lora_sharding"] = (
            type(lora_a).__name__,
            tuple(lora_a.placements),
            lora_a.to_local().shape[0],
        )
        result["lora_losses"], result["lora_refs"], result["lora_grads"] = train(
            tr, inputs, LORA_STEPS, lora=True, reduce=reduce
        )
        result["lora_weights"] = full_params(tr, trainable_only=True)

        # Full fine-tuning, plus a frozen reference copy sharded the same way.
        tr = load_model(model_dir, dtype="float32").transformer.requires_grad_(True)
        reference = copy.deepcopy(tr).requires_grad_(False).eval()
        shard_transformer(tr, BLOCKS, param_dtype=None, reshard_after_forward=False, mesh=mesh)
        shard_transformer(reference, BLOCKS, param_dtype=None, mesh=mesh)
        result["full_losses"], _, result["full_grads"] = train(
            tr, inputs, FULL_STEPS, lora=False, reduce=reduce
        )
        result["full_weights"] = full_params(tr, trainable_only=False)
        with torch.no_grad():
            result["reference_out"] = forward(reference, inputs)

        # The GPU recipe on CPU: bf16 base + fp32 LoRA, bf16 compute, fp32 reduction, and the first
        # forward with adapters disabled (pytorch#186998: that must not break the later backward).
        tr = load_model(model_dir, dtype="bfloat16").transformer
        add_lora(tr)
        cast_training_params(tr, dtype=torch.float32)  # LoRA weights to fp32, as diffusers' scripts do
        n_lora = sum("lora_" in name for name, p in tr.named_parameters() if p.requires_grad)
        shard_transformer(
            tr,
            BLOCKS,
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            cast_forward_inputs=True,
            mesh=mesh,
        )
        with torch.no_grad():
            tr.disable_adapters()
            forward(tr, inputs)
            tr.enable_adapters()
        F.mse_loss(forward(tr, inputs).float(), inputs["target"]).backward()
        grads = [p.grad for p in tr.parameters() if p.requires_grad]
        result["bf16_grads"] = (
            n_lora,
            len(grads),
            {str(g.dtype) for g in grads},
            all(g.isfinite().all().item() for g in grads),
        )

        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        distributed.shutdown_distributed()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sharded(tiny_model, tmp_path_factory):
    """Every rank's results from one 2-process gloo run of all scenarios."""
    model_dir = str(tiny_model("sd3"))
    out_dir = tmp_path_factory.mktemp("fsdp")
    start_ranks(_worker, (_free_port(), model_dir, str(out_dir)), WORLD, fork=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def single(tiny_model):
    """The same training on one process without FSDP, on the whole global batch."""
    model_dir = tiny_model("sd3")
    out = {}
    tr = load_model(model_dir, dtype="float32").transformer
    add_lora(tr)
    inputs = batch(tr)
    out["lora_initial"] = full_params(tr, trainable_only=True)
    out["lora_losses"], out["lora_refs"], out["lora_grads"] = train(tr, inputs, LORA_STEPS, lora=True)
    out["lora_weights"] = full_params(tr, trainable_only=True)

    tr = load_model(model_dir, dtype="float32").transformer.requires_grad_(True)
    out["full_initial"] = full_params(tr, trainable_only=False)
    with torch.no_grad():
        out["base_out"] = forward(tr, inputs)
    out["full_losses"], _, out["full_grads"] = train(tr, inputs, FULL_STEPS, lora=False)
    out["full_weights"] = full_params(tr, trainable_only=False)
    return out


def assert_same_grads(sharded_g, single_g, *, atol=1e-6, rtol=1e-4):
    assert sharded_g.keys() == single_g.keys()
    assert max(g.abs().max().item() for g in single_g.values()) > 100 * atol
    for name in single_g:
        torch.testing.assert_close(
            sharded_g[name], single_g[name], atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}"
        )


def assert_same_update(sharded_w, single_w, initial_w, *, atol=1e-5, rtol=1e-4):
    assert sharded_w.keys() == single_w.keys()
    moved = max((single_w[n] - initial_w[n]).abs().max().item() for n in single_w)
    assert moved > 100 * atol, f"the weights barely moved ({moved}): the comparison would be vacuous"
    for name in single_w:
        torch.testing.assert_close(
            sharded_w[name], single_w[name], atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}"
        )


# ---------------------------------------------------------------------------------------------- tests
def test_process_group_helpers(sharded):
    for r, result in enumerate(sharded):
        gpu = torch.cuda.is_available()  # device_for_rank: this rank's GPU where there are GPUs
        assert (result["rank"], result["world"], result["device"]) == (
            r,
            WORLD,
            f"cuda:{r}" if gpu else "cpu",
        )
        assert result["mean"] == {"a": 0.5, "b": 6.0}  # means of (0, 1) and (1, 11), keys sorted
        # FSDP2's CPU offload also shards on a CPU mesh (it moves nothing there)
        assert "offload_error" not in result


def test_lora_under_fsdp_matches_one_process(sharded, single):
    n_blocks = 2  # the tiny SD3 has num_layers=2
    for result in sharded:
        assert result["lora_units"] == n_blocks + 1  # each block, then the root
        assert result["blocks_after_sharding"] == ["FSDPJointTransformerBlock"] * n_blocks
        # LoRA A of to_q is [r=4, in]: dim-0 sharded, 2 rows per rank.
        assert result["lora_sharding"] == ("DTensor", (Shard(0),), 2)
        torch.testing.assert_close(result["lora_losses"], single["lora_losses"], atol=1e-6, rtol=1e-5)
    assert single["lora_losses"][-1] < single["lora_losses"][0]
    assert_same_grads(sharded[0]["lora_grads"], single["lora_grads"])
    assert_same_update(sharded[0]["lora_weights"], single["lora_weights"], single["lora_initial"])
    # Reference outputs (adapters disabled) are the base model's, on each rank's rows, at every step.
    for step in range(LORA_STEPS):
        got = torch.cat([result["lora_refs"][step] for result in sharded])
        torch.testing.assert_close(got, single["lora_refs"][step], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got, single["base_out"], atol=1e-6, rtol=1e-5)


def test_full_fine_tuning_under_fsdp_matches_one_process(sharded, single):
    for result in sharded:
        torch.testing.assert_close(result["full_losses"], single["full_losses"], atol=1e-6, rtol=1e-5)
    assert_same_grads(sharded[0]["full_grads"], single["full_grads"])
    assert_same_update(sharded[0]["full_weights"], single["full_weights"], single["full_initial"])
    # The frozen reference, sharded too, still computes the base model.
    got = torch.cat([result["reference_out"] for result in sharded])
    torch.testing.assert_close(got, single["base_out"], atol=1e-6, rtol=1e-5)


def test_bf16_compute_with_fp32_lora_after_a_frozen_first_forward(sharded):
    for result in sharded:
        n_lora, count, dtypes, finite = result["bf16_grads"]
        assert count == n_lora > 0  # every LoRA tensor, and only those, got a gradient
        assert dtypes == {"torch.float32"} and finite


def test_activation_checkpointing_gives_the_same_gradients(tiny_model):
    def grads(checkpointing: bool) -> tuple[dict[str, torch.Tensor], int]:
        tr = load_model(tiny_model("sd3"), dtype="float32").transformer
        add_lora(tr)
        with torch.no_grad():  # non-zero LoRA B, so every LoRA tensor gets a gradient
            for name, p in tr.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        if checkpointing:
            assert enable_activation_checkpointing(tr, BLOCKS) == 2
        calls = []
        for block in find_blocks(tr, BLOCKS):
            # A pre-hook: recomputation stops early (torch.utils.checkpoint early stop), so a
            # forward hook would not see it.
            block.register_forward_pre_hook(lambda *_: calls.append(1))
        inputs = batch(tr)
        F.mse_loss(forward(tr, inputs), inputs["target"]).backward()
        return {n: p.grad for n, p in tr.named_parameters() if p.requires_grad}, len(calls)

    plain, plain_calls = grads(False)
    checkpointed, checkpointed_calls = grads(True)
    # Checkpointing really happened: each block ran forward again during backward.
    assert (plain_calls, checkpointed_calls) == (2, 4)
    assert plain.keys() == checkpointed.keys() and plain
    for name in plain:
        torch.testing.assert_close(
            checkpointed[name], plain[name], atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )
    # Every LoRA tensor took part, except the last block's context queries: SD3's last block is
    # context_pre_only, its context output is dropped, so they get an exact-zero gradient.
    zero = {n for n, g in plain.items() if not g.abs().sum() > 0}
    assert zero == {f"transformer_blocks.1.attn.add_q_proj.lora_{ab}.default.weight" for ab in "AB"}


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


def test_activation_checkpointing_without_a_model_switch_uses_torch_checkpoint():
    """A module with no enable_gradient_checkpointing(): torch's composable checkpoint per block."""

    def grads(checkpointing: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(_Block(), _Block(), torch.nn.Linear(8, 1))
        if checkpointing:
            assert enable_activation_checkpointing(model, ("_Block",)) == 2
        calls = []
        for block in find_blocks(model, ("_Block",)):
            block.register_forward_pre_hook(lambda *_: calls.append(1))
        model(torch.randn(3, 8, generator=torch.Generator().manual_seed(1))).square().sum().backward()
        return {n: p.grad for n, p in model.named_parameters()}, len(calls)

    plain, plain_calls = grads(False)
    checkpointed, checkpointed_calls = grads(True)
    assert (plain_calls, checkpointed_calls) == (2, 4)
    assert plain.keys() == checkpointed.keys()  # names unchanged: no wrapper module
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=0, rtol=0)


def test_no_matching_block_is_a_clear_error(tiny_model):
    tr = load_model(tiny_model("sd3"), dtype="float32").transformer
    with pytest.raises(
        ValueError,
        match=r"no submodule of SD3Transformer2DModel .*FluxTransformerBlock.*JointTransformerBlock",
    ):
        shard_transformer(tr, ("FluxTransformerBlock",), param_dtype=None)
    with pytest.raises(ValueError, match="tuple of class-name strings"):
        enable_activation_checkpointing(tr, "JointTransformerBlock")
    with pytest.raises(ValueError, match="needs a process group"):  # blocks match, but no group
        shard_transformer(tr, BLOCKS, param_dtype=None)


def test_helpers_outside_a_process_group(monkeypatch):
    assert not distributed.is_distributed()
    assert (distributed.rank(), distributed.world_size()) == (0, 1)
    distributed.barrier()
    assert distributed.all_reduce_mean({"x": 2, "y": torch.tensor(0.5)}) == {"x": 2.0, "y": 0.5}
    with pytest.raises(ValueError, match="pass a scalar"):
        distributed.all_reduce_mean({"x": torch.ones(2)})
    for name in distributed.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"):
        distributed.init_distributed()
    with pytest.raises(ValueError, match="backend='mpi'"):
        distributed.init_distributed("mpi")


# ---------------------------------------------------------------------------------------------- GPU (NCCL)
def bf16_lora_step(model_dir, device, rank: int, world: int, *, shard: bool):
    """The GPU recipe: bf16 base, fp32 LoRA, one step's loss and LoRA gradients (unsharded, on CPU).

    Sharded: bf16 all-gathers and compute, fp32 reduce-scatter, first forward with adapters
    disabled. One device: peft computes LoRA in fp32 on bf16 base outputs, so results agree with
    the sharded run at bf16 precision only.
    """
    tr = load_model(model_dir, dtype="bfloat16", device=device).transformer
    add_lora(tr)
    with torch.no_grad():
        cast_training_params(tr, dtype=torch.float32)
        for name, p in tr.named_parameters():
            if "lora_B" in name:  # non-zero, so every LoRA tensor gets a gradient
                p.normal_(0, 0.1, generator=torch.Generator(device).manual_seed(len(name)))
    inputs = {k: v.to(device) for k, v in rows(batch(tr), rank, world).items()}
    for key in ("hidden_states", "encoder_hidden_states", "pooled_projections"):
        inputs[key] = inputs[key].bfloat16()  # as the adapter's velocity() does
    if shard:
        shard_transformer(
            tr, BLOCKS, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True
        )
    with torch.no_grad():
        tr.disable_adapters()
        forward(tr, inputs)
        tr.enable_adapters()
    loss = F.mse_loss(forward(tr, inputs).float(), inputs["target"])
    loss.backward()
    grads = {
        n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for n, p in tr.named_parameters()
        if p.requires_grad
    }
    return distributed.all_reduce_mean({"loss": loss.item()})["loss"], {
        n: g.float().cpu() for n, g in grads.items()
    }


def _gpu_worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    device = _join(rank, port, None)
    try:
        assert device == torch.device("cuda", rank) and torch.distributed.get_backend() == "nccl"
        loss, grads = bf16_lora_step(model_dir, device, rank, WORLD, shard=True)
        if rank == 0:
            torch.save({"loss": loss, "grads": grads}, os.path.join(out_dir, "gpu.pt"))
    finally:
        distributed.shutdown_distributed()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_fsdp_bf16_lora_matches_one_gpu(tiny_model, tmp_path):
    model_dir = str(tiny_model("sd3"))
    mp.spawn(_gpu_worker, args=(_free_port(), model_dir, str(tmp_path)), nprocs=WORLD, join=True)
    sharded = torch.load(tmp_path / "gpu.pt")
    loss, grads = bf16_lora_step(model_dir, torch.device("cuda", 0), 0, 1, shard=False)
    assert sharded["loss"] == pytest.approx(loss, rel=1e-2)
    assert sharded["grads"].keys() == grads.keys() and grads
    flat = torch.cat([sharded["grads"][n].flatten() for n in grads])
    ref = torch.cat([grads[n].flatten() for n in grads])
    assert F.cosine_similarity(flat, ref, dim=0) > 0.999
    assert (flat.norm() / ref.norm() - 1).abs() < 1e-2  # averaged over ranks, not summed
