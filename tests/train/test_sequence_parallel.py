"""Ulysses sequence parallelism on the tiny Wan transformer: 2 gloo ranks against one process.

Both ranks of one SP group run the same micro-batch with the video tokens split between them.
The reference is the same forward and backward on one rank without SP (each rank computes it
itself before switching SP on, on the same weights and inputs). After the SP group's reduction
(an explicit sum over the group, or FSDP2's reduce-scatter with the divide factor set) the loss
and every trainable gradient must equal the reference within float32 round-off. The checks that
make the agreement non-trivial: each rank's blocks really see half the tokens, and each rank's
gradient before the reduction is not the full one.
"""

from __future__ import annotations

import os
import re
import traceback
from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.training_utils import cast_training_params
from spawn_ranks import free_port, spawn_with_deadlines

from diffrl.config.schema import LoraConfig
from diffrl.models import load_model
from diffrl.models.base import PromptEmbeds
from diffrl.train import distributed
from diffrl.train.lora import inject_lora
from diffrl.train.sequence_parallel import (
    UlyssesSequenceParallel,
    check_ulysses_supported,
    sequence_parallel_mesh,
)

WORLD = 2
HEIGHT = WIDTH = 32
FRAMES = 5  # latents [B, 4, 2, 4, 4]: 2·2·2 = 8 video tokens, 4 per rank
BATCH = 2
GUIDANCE = 4.5  # CFG: the adapter's one batched call over [negatives; prompts]
RTOL = 1e-5
START_DEADLINE_S = 180.0  # spawn, imports, rendezvous (slow on a loaded 2-core machine)
RUN_DEADLINE_S = 120.0


def _inputs(adapter) -> dict:
    g = torch.Generator().manual_seed(7)
    shape = (BATCH, *adapter.latent_shape(HEIGHT, WIDTH, FRAMES))
    text_dim = adapter.transformer.config.text_dim
    return {
        "latents": torch.randn(shape, generator=g),
        "target": torch.randn(shape, generator=g),
        "timestep_B": torch.tensor([900.0, 250.0]),
        "cond": PromptEmbeds(
            embeds=torch.randn(BATCH, 8, text_dim, generator=g),
            negative_embeds=torch.randn(BATCH, 8, text_dim, generator=g),
            batch_size=[BATCH],
        ),
    }


def _loss(adapter, inputs) -> torch.Tensor:
    v = adapter.velocity(
        inputs["latents"], inputs["timestep_B"], inputs["cond"], GUIDANCE, HEIGHT, WIDTH, FRAMES
    )
    return ((v - inputs["target"]) ** 2).mean()


def _grads(module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = grad.detach().clone()
    module.zero_grad(set_to_none=True)
    return out


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest max-abs error relative to the reference's largest entry, over all tensors."""
    assert got.keys() == want.keys()
    errors = {n: float((got[n] - want[n]).abs().max() / want[n].abs().max()) for n in want}
    name = max(errors, key=errors.get)
    return errors[name], name


def _tokens_seen(transformer) -> list[int]:
    """Records the sequence length each self-attention of block 0 gets (after the SP split)."""
    seen: list[int] = []
    transformer.blocks[0].attn1.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(args[0].shape[1]), with_kwargs=True
    )
    return seen


def _lora_case(model_dir: str, mesh) -> dict:
    """LoRA, no FSDP, gradient checkpointing on: SP grads summed over the group by all_reduce_gradients."""
    adapter = load_model(model_dir, "float32")
    inject_lora(adapter, LoraConfig(rank=4, alpha=4), ["default"], seed=0)
    transformer = adapter.transformer
    cast_training_params(transformer, torch.float32)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)  # B = 0 at init would make every A gradient 0: give B values
        for name, p in transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    transformer.enable_gradient_checkpointing()
    transformer.train()
    inputs = _inputs(adapter)
    seen = _tokens_seen(transformer)
    own = {**inputs, "latents": inputs["latents"] + distributed.rank()}
    with torch.no_grad():
        v_before = adapter.velocity(
            own["latents"], own["timestep_B"], own["cond"], GUIDANCE, HEIGHT, WIDTH, FRAMES
        )

    ref_loss = _loss(adapter, inputs)
    ref_loss.backward()
    ref = _grads(transformer)
    full_tokens = seen[-1]

    sp = UlyssesSequenceParallel(transformer, mesh)
    with sp.active():
        loss = _loss(adapter, inputs)
        loss.backward()
        sp_tokens = seen[-1]
    partial = {n: p.grad.detach().clone() for n, p in transformer.named_parameters() if p.requires_grad}
    sp.all_reduce_gradients(p for p in transformer.parameters() if p.requires_grad)
    got = _grads(transformer)

    # Detached again, each rank runs its own inputs with no collective: the same velocity as
    # before SP was ever attached (while attached, the ranks' different latents would mix).
    with torch.no_grad():
        v_after = adapter.velocity(
            own["latents"], own["timestep_B"], own["cond"], GUIDANCE, HEIGHT, WIDTH, FRAMES
        )

    # Token counts the split cannot divide: a ValueError naming the shape, on every rank, before
    # any collective (3 tokens: latents [1, 4, 1, 2, 6]).
    odd = torch.randn(1, 4, 1, 2, 6)
    with sp.active():
        try:
            transformer(
                hidden_states=odd,
                timestep=torch.tensor([500.0]),
                encoder_hidden_states=inputs["cond"].embeds[:1],
                return_dict=False,
            )
            odd_error = ""
        except ValueError as err:
            odd_error = str(err)

    worst, name = _worst(got, ref)
    partial_gap, _ = _worst(partial, ref)
    return {
        "loss": float(loss),
        "ref_loss": float(ref_loss),
        "worst": worst,
        "worst_name": name,
        "partial_gap": partial_gap,
        "trainable": len(ref),
        "full_tokens": full_tokens,
        "sp_tokens": sp_tokens,
        "detached_gap": float((v_after - v_before).abs().max()),
        "odd_error": odd_error,
    }


def _fsdp_case(model_dir: str, mesh) -> dict:
    """Full fine-tuning under FSDP2 over both ranks: the reduce-scatter sums the SP group's grads."""
    from diffrl.train.fsdp import shard_transformer

    adapter = load_model(model_dir, "float32")
    transformer = adapter.transformer
    transformer.requires_grad_(True).train()
    inputs = _inputs(adapter)
    ref_loss = _loss(adapter, inputs)
    ref_loss.backward()
    ref = _grads(transformer)

    shard_transformer(transformer, adapter.block_class_names, param_dtype=None)
    sp = UlyssesSequenceParallel(transformer, mesh)
    units = sp.reduce_gradients_with_fsdp()
    with sp.active():
        loss = _loss(adapter, inputs)
        loss.backward()
    got = _grads(transformer)
    worst, name = _worst(got, ref)
    return {
        "loss": float(loss),
        "ref_loss": float(ref_loss),
        "worst": worst,
        "worst_name": name,
        "trainable": len(ref),
        "units": units,
    }


def _worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        distributed.init_distributed("gloo")
        (out / f"joined{rank}").touch()
        mesh = sequence_parallel_mesh(WORLD)
        result = {"lora": _lora_case(model_dir, mesh), "fsdp": _fsdp_case(model_dir, mesh)}
    except Exception:
        result = {"error": traceback.format_exc()}
    finally:
        distributed.shutdown_distributed()
    torch.save(result, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def results(tiny_model, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("sp")
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU mesh (gloo), as in CI
    try:
        spawn_with_deadlines(
            _worker,
            (free_port(), str(tiny_model("wan")), str(out)),
            WORLD,
            out,
            start_s=START_DEADLINE_S,
            run_s=RUN_DEADLINE_S,
            what="sequence-parallel",
            fork=True,
        )
    finally:
        if previous is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for rank, result in enumerate(ranks):
        assert "error" not in result, f"rank {rank} failed:\n{result['error']}"
    return ranks


def test_lora_loss_and_gradients_equal_one_rank(results):
    for r in results:
        case = r["lora"]
        assert case["full_tokens"] == 8 and case["sp_tokens"] == 4  # each rank's blocks hold half
        assert case["loss"] == pytest.approx(case["ref_loss"], rel=RTOL)
        assert case["trainable"] > 0
        assert case["worst"] < RTOL, (case["worst_name"], case["worst"])
        # before the sum over the group a rank holds only its tokens' share of each gradient
        assert case["partial_gap"] > 1e-2


def test_full_finetune_under_fsdp2_equals_one_rank(results):
    for r in results:
        case = r["fsdp"]
        assert case["units"] == 3  # two blocks and the root
        assert case["loss"] == pytest.approx(case["ref_loss"], rel=RTOL)
        assert case["worst"] < RTOL, (case["worst_name"], case["worst"])


def test_detached_module_runs_each_ranks_own_inputs(results):
    for r in results:
        assert r["lora"]["detached_gap"] == 0.0


def test_indivisible_token_count_is_a_value_error_naming_the_shape(results):
    for r in results:
        message = r["lora"]["odd_error"]
        assert "(1, 4, 1, 2, 6)" in message and "3 video tokens" in message
        assert "sequence_parallel_size=2" in message


def test_heads_not_divisible_by_the_group_is_a_value_error():
    transformer = WanTransformer3DModel(
        num_attention_heads=3,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=1,
    )
    with pytest.raises(
        ValueError, match=re.escape("3 attention heads, not divisible by actor.sequence_parallel_size=2")
    ):
        check_ulysses_supported(transformer, 2)
    check_ulysses_supported(transformer, 3)


def test_a_model_without_a_context_parallel_plan_is_refused():
    with pytest.raises(ValueError, match="no context-parallel plan"):
        check_ulysses_supported(torch.nn.Linear(2, 2), 2)


# ----------------------------------------------------------------------------- wiring (diffrl train)
def _config(overrides: list[str]):
    from diffrl.config import load_config

    return load_config("tiny_sd3", ["model.path=tiny:wan", "rollout.pipeline.num_frames=5", *overrides])


def test_training_setup_refuses_loops_and_models_it_is_not_wired_for(tiny_model):
    from diffrl.train.sequence_parallel import for_training

    wan = load_model(tiny_model("wan"), "float32")
    assert for_training(wan, _config([])) is None  # size 1: nothing set up, no process group needed
    dpo = _config(["actor.sequence_parallel_size=2", "trainer.n_gpus_per_node=2", "actor.strategy=fsdp2"])
    dpo.algorithm.trainer_type = "direct_preference"
    with pytest.raises(ValueError, match="policy-gradient loop only"):
        for_training(wan, dpo)
    image = _config(["actor.sequence_parallel_size=2", "trainer.n_gpus_per_node=2", "actor.strategy=fsdp2"])
    with pytest.raises(ValueError, match="image model"):
        for_training(load_model(tiny_model("sd3"), "float32"), image)


def test_diffrl_train_with_two_ranks_in_one_sp_group_matches_one_worker(tmp_path, monkeypatch, shared_ray):
    """`diffrl train` on 2 Ray workers forming one SP group (both train every row, half the tokens
    each) takes the same first optimizer step as one worker training every row alone. The Ray run
    joins the tests' shared cluster (tests/conftest.py), whose actors read its cache."""
    import json

    from diffrl.controller.run import train

    monkeypatch.setenv("DIFFRL_CACHE", str(shared_ray))
    # One thread per process in both runs: the lone worker would otherwise get every core, and a
    # matmul split over more threads rounds differently, so the two runs would sample different bits.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    common = [
        "model.path=tiny:wan",
        "rollout.pipeline.num_frames=5",
        "trainer.total_steps=1",
        "trainer.save_freq=0",
        "trainer.test_freq=0",
        f"trainer.output_dir={tmp_path}",
    ]

    def first_step(run_dir: Path) -> dict:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return next(row for row in rows if row["step"] == 1)

    # the start-up check (diffrl check --quick) is not what this compares
    one = first_step(
        train(
            "tiny_sd3",
            [*common, "trainer.run_name=one", "actor.strategy=none", "trainer.check_at_start=false"],
        )
    )
    sp = first_step(
        train(
            "tiny_sd3",
            [
                *common,
                "trainer.run_name=sp",
                "trainer.n_gpus_per_node=2",
                "actor.strategy=fsdp2",
                "actor.sequence_parallel_size=2",
            ],
        )
    )
    assert sp["rewards/mean"] == pytest.approx(one["rewards/mean"], rel=1e-6)
    assert sp["actor/grad_norm"] > 0
    assert sp["actor/grad_norm"] == pytest.approx(one["actor/grad_norm"], rel=1e-5)
    # the PPO loss is a sum of ±advantage terms cancelling to ~1e-5: compare it in their units
    assert sp["actor/loss"] == pytest.approx(one["actor/loss"], abs=1e-7)
