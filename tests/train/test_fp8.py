"""model.fp8 (diffrl.train.fp8): which linear layers convert, the switch per pass, LoRA left as it
is, the start-up errors, and the float8 GEMM against a float64 reference.

torchao's float8 linear and `torch._scaled_mm` run on a CPU too (torch 2.13), so the conversion
is tested here for real; the tests that need torchao skip without it (`pip install 'diffrl[fp8]'`).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from diffrl.config.plan import FP8_TORCHAO
from diffrl.train import fp8
from diffrl.train.fp8_frozen import FrozenFloat8Linear


class Modulation(nn.Module):  # an adaptive norm: its linear takes one vector per sample
    def __init__(self, dim):
        super().__init__()
        self.linear = nn.Linear(dim, 3 * dim)
        self.norm = nn.LayerNorm(dim)


class Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])


class Block(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.norm1 = Modulation(dim)
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))  # Qwen-Image's modulation
        self.adaLN_modulation = nn.Sequential(nn.Linear(dim, 4 * dim))  # Z-Image's
        self.attn = Attention(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.odd = nn.Linear(dim, 24)  # 24 is no multiple of 16: _scaled_mm cannot take it


class Net(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([Block(dim), Block(dim)])
        self.proj_out = nn.Linear(dim, dim)


BLOCK_LINEARS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.0", "ff.2"]


def test_selects_the_blocks_token_linears_only():
    names = fp8.fp8_linear_names(Net(), ("Block",))
    assert names == [f"blocks.{i}.{n}" for i in range(2) for n in BLOCK_LINEARS]


def test_selects_lora_base_layers_not_the_adapters():
    from peft import LoraConfig, inject_adapter_in_model

    net = inject_adapter_in_model(LoraConfig(r=4, target_modules=["to_q", "to_v", "2"]), Net())
    names = fp8.fp8_linear_names(net, ("Block",))
    wrapped = {
        "attn.to_q": "attn.to_q.base_layer",
        "attn.to_v": "attn.to_v.base_layer",
        "ff.2": "ff.2.base_layer",
    }
    assert names == [f"blocks.{i}.{wrapped.get(n, n)}" for i in range(2) for n in BLOCK_LINEARS]
    assert not any("lora_" in n for n in names)


def test_tiny_sd3_selection(tiny_model):
    from diffrl.config.schema import LoraConfig
    from diffrl.models import load_model
    from diffrl.train.lora import inject_lora

    adapter = load_model(tiny_model("sd3"), dtype="float32")
    inject_lora(adapter, LoraConfig(rank=4, alpha=8), ["default"])
    names = fp8.fp8_linear_names(adapter.transformer, adapter.block_class_names)
    assert len(names) == 25  # 8 + 4 (attn2) + 2 x 2 (MLPs), then 7 + 2 (the last block is context_pre_only)
    assert not any(".norm" in n or "lora_" in n for n in names)
    assert "transformer_blocks.0.attn.to_q.base_layer" in names  # adapted: its frozen base
    assert "transformer_blocks.0.attn2.to_q" in names and "transformer_blocks.0.ff.net.2" in names
    assert all(n.startswith("transformer_blocks.") for n in names)  # not the embedders, norm_out, proj_out


def test_a_cpu_worker_is_refused_with_the_fix():
    with pytest.raises(
        ValueError, match=r"model\.fp8=all runs float8 GEMMs .* device is cpu: set model\.fp8=none"
    ):
        fp8.check_device("all", "cpu")


def test_old_gpus_are_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"NVIDIA A100 has compute capability 8\.0: set model\.fp8=none"):
        fp8.check_device("sampling", "cuda:0")


def test_missing_or_old_torchao_names_the_install(monkeypatch):
    import importlib.metadata
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real_find_spec(name, *a)
    )
    with pytest.raises(
        ValueError, match=rf"needs torchao, which is not installed: pip install torchao=={FP8_TORCHAO}"
    ):
        fp8.require_torchao("sampling")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.16.0")
    with pytest.raises(
        ValueError, match=rf"torchao 0\.16\.0 is installed: pip install torchao=={FP8_TORCHAO}"
    ):
        fp8.require_torchao("all")


def test_none_converts_nothing_and_needs_no_torchao():
    class CpuAdapter:
        device = torch.device("cpu")

    assert fp8.prepare(CpuAdapter(), "none") == []  # no device check, no import


# ------------------------------------------------------------------- LoRA (cast once), and torchao
def _torchao():
    return pytest.importorskip("torchao", reason="pip install 'diffrl[fp8]' for the float8 tests")


def _lora_net(dtype=torch.bfloat16):
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    net = inject_adapter_in_model(LoraConfig(r=4, target_modules=["to_q", "to_v"]), Net(64))
    for name, p in net.named_parameters():  # B != 0, so the adapters do change the output
        p.requires_grad_("lora_" in name)
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)
    return net.to(dtype)


def _forward(net, x):
    h = x
    for block in net.blocks:
        h = h + block.attn.to_out[0](block.attn.to_q(h) + block.attn.to_v(h))
        h = h + block.ff(h)
    return h


def test_conversion_keeps_names_params_and_lora_and_switches_per_pass():
    net = _lora_net()
    reference = copy.deepcopy(net)
    before = {n: (p.shape, p.dtype, p.requires_grad) for n, p in net.named_parameters()}
    names = fp8.convert(net, ("Block",), "sampling")
    assert len(names) == 12 and len(fp8.float8_layers(net)) == 12
    assert {n: (p.shape, p.dtype, p.requires_grad) for n, p in net.named_parameters()} == before
    for layer in net.modules():  # peft's adapters stay plain bf16 linears
        if hasattr(layer, "lora_A"):
            assert type(layer.lora_A["default"]) is nn.Linear and type(layer.lora_B["default"]) is nn.Linear
            assert type(layer.base_layer) is FrozenFloat8Linear  # a frozen base: cast once

    x = torch.randn(2, 40, 64, dtype=torch.bfloat16)
    expected = _forward(reference, x)
    # sampling: off by default (the trainer's passes), bit for bit the unconverted module
    assert torch.equal(_forward(net, x), expected)
    with fp8.fp8_gemms(net):
        in_fp8 = _forward(net, x)
    assert not torch.equal(in_fp8, expected)
    assert (in_fp8 - expected).float().norm() / expected.float().norm() < 0.1
    assert torch.equal(_forward(net, x), expected)  # switched back
    # the sampler's policy switch turns float8 on inside, and only there
    seen = []
    policy = fp8.for_sampling(lambda name: _recording(seen, name), net, "sampling")
    with policy("default"):
        assert all(layer.fp8 for layer in fp8.float8_layers(net))
    assert seen == ["default"] and not any(layer.fp8 for layer in fp8.float8_layers(net))
    assert fp8.for_sampling(_recording, net, "all") is _recording


def _recording(seen, name=None):
    from contextlib import nullcontext

    seen.append(name)
    return nullcontext()


def test_all_trains_lora_through_float8_base_gemms():
    net, plain = _lora_net(), _lora_net()
    fp8.convert(net, ("Block",), "all")
    x = torch.randn(2, 40, 64, dtype=torch.bfloat16, requires_grad=True)
    for module in (net, plain):
        _forward(module, x).float().square().mean().backward()
    grads = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    plain_grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    assert set(grads) == set(plain_grads) and all("lora_" in n for n in grads)  # the base gets none
    for name, grad in grads.items():
        assert grad.shape == plain_grads[name].shape and grad.dtype == plain_grads[name].dtype
        assert torch.isfinite(grad).all()
        rel = (grad - plain_grads[name]).float().norm() / plain_grads[name].float().norm()
        assert rel < 0.25, name  # float8 in forward and backward: a few percent per GEMM


def test_a_merged_adapter_runs_its_merged_weight_in_float8_then_the_base_again():
    """model.lora.merge_inference swaps each base weight for W + ΔW: a cast-once layer casts the
    merged weight, and the base's again after, bit for bit its cast before the merge."""
    from diffrl.train.lora import merged_lora

    net = _lora_net()
    fp8.convert(net, ("Block",), "all")
    x = torch.randn(2, 40, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        before = _forward(net, x)
        with merged_lora(net, "default"):
            merged = _forward(net, x)
            # an independent conversion of the merged weights, each layer cast from scratch
            fresh = copy.deepcopy(net)
            for layer in fresh.modules():
                if isinstance(layer, FrozenFloat8Linear):
                    layer.w_q = layer.w_scale = layer.wt_q = layer.wt_scale = None
                    layer.refresh()
            expected = _forward(fresh, x)
        after = _forward(net, x)
    assert torch.equal(merged, expected)
    assert torch.equal(after, before)
    # merged, the base GEMM carries the adapter: the output is the unmerged net's up to float8
    assert (merged - before).float().norm() / before.float().norm() < 0.1


def test_a_synced_weight_is_cast_again_and_only_it():
    net = _lora_net()
    fp8.convert(net, ("Block",), "sampling")
    layer = net.blocks[0].ff[0]
    other = net.blocks[1].ff[0]
    kept = other.w_q.clone()
    with torch.no_grad():
        layer.weight.mul_(-1)  # a weight sync writes the tensors in place
        other.weight.mul_(-1)
    assert (
        fp8.refresh_cast_weights(net, ["blocks.0.ff.0.weight", "blocks.0.attn.to_q.lora_A.default.weight"])
        == 1
    )
    assert torch.equal(layer.w_q, FrozenFloat8Linear.from_linear(layer).w_q)  # the new weight's cast
    assert torch.equal(other.w_q, kept)  # not named: not recast


def test_under_fsdp2_a_frozen_base_casts_per_call():
    _torchao()
    net = _lora_net()
    fp8.convert(net, ("Block",), "all", cast_once=False)
    assert {type(m).__name__ for m in fp8.float8_layers(net)} == {"SwitchableFloat8Linear"}


@pytest.mark.parametrize("scaling", ["rowwise", "tensorwise"])
def test_the_scaling_setting_reaches_the_layers(scaling):
    net = _lora_net()
    fp8.convert(net, ("Block",), "all", scaling)
    assert {m.recipe for m in fp8.float8_layers(net)} == {scaling}


def _rowwise_e4m3(t: torch.Tensor) -> torch.Tensor:
    """torchao's rowwise recipe for one operand, in float64: each row scaled by the power of two
    that puts its absolute maximum at or below e4m3's largest value (448), rounded to e4m3."""
    t = t.double()
    amax = t.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
    return (t * scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() / scale


def test_float8_gemm_matches_a_float64_rowwise_reference():
    _torchao()
    from diffrl.train.fp8_linear import recipe_config, to_float8

    torch.manual_seed(1)
    linear = nn.Linear(128, 96, bias=True).to(torch.bfloat16)
    x = (torch.randn(3, 50, 128) * torch.logspace(-2, 1, 50)[:, None]).to(
        torch.bfloat16
    )  # rows of varied size
    out = to_float8(linear, recipe_config(), enabled=True)(x).double()
    w = linear.weight.double()
    quantized = _rowwise_e4m3(x) @ _rowwise_e4m3(w).T + linear.bias.double()
    exact = x.double() @ w.T + linear.bias.double()
    scale = exact.abs().amax()
    # the GEMM of the quantized operands, rounded once to bf16 (2^-8 relative)
    assert (out - quantized).abs().max() / scale < 2**-7
    # against the exact product: e4m3 keeps 3 mantissa bits (2^-4 relative per operand element)
    assert (out - exact).norm() / exact.norm() < 0.06


# ---------------------------------------------------------------------------------- in the engine
PROMPTS = ["a red circle", "a blue square"]


def _engine(tiny_model, monkeypatch, mode, *, rank=4, kl_coef=0.0):
    """The tiny SD3 in bf16 with `model.fp8=mode` (the GPU check stood aside: the CPU runs float8)."""
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
    from diffrl.train.engine import TrainEngine

    monkeypatch.setattr(fp8, "check_device", lambda mode, device: None)
    adapter = load_model(tiny_model("sd3"), dtype="bfloat16")
    actor = ActorConfig(
        strategy="none",
        mini_batch_size=8,
        micro_batch_size=4,
        optim=OptimConfig(lr=1e-3, weight_decay=0.0),
        loss=LossConfig(clip_ratio=0.5, kl_coef=kl_coef),
    )
    model = ModelConfig(dtype="bfloat16", lora=LoraConfig(rank=rank, alpha=rank), fp8=mode)
    engine = TrainEngine(adapter, model, actor, total_optim_steps=4)
    rollout_cfg = RolloutConfig(
        n=4,
        micro_batch_size=4,
        pipeline=PipelineConfig(
            height=32, width=32, num_inference_steps=4, guidance_scale=4.5, max_sequence_length=8
        ),
        sde=SdeConfig(noise_level=0.8, window_size=2, window_range=[0, 3]),
    )
    return engine, TrajectorySampler(adapter, rollout_cfg, progress=False)


def _step(engine, rollout, **targets):
    from diffrl.train.batch import PolicyGradientBatch, TrainingTargets

    advantages = torch.tensor([1.0, -1.0] * 4)
    trained = PolicyGradientBatch(
        rollout, TrainingTargets(advantages_B=advantages, **targets, batch_size=[len(rollout)])
    )
    return engine.forward_backward([trained.select(slice(0, 4)), trained.select(slice(4, 8))])


def test_the_engine_converts_after_lora_and_trains_in_float8(tiny_model, monkeypatch):
    engine, sampler = _engine(tiny_model, monkeypatch, "all")
    layers = fp8.float8_layers(engine.transformer)
    assert len(layers) == 25 and all(layer.fp8 for layer in layers)
    assert all(".lora_" in n for n, p in engine.transformer.named_parameters() if p.requires_grad)
    rollout = sampler.sample(PROMPTS, seed=1, step=0)
    assert math.isfinite(_step(engine, rollout)["loss"])
    assert all(p.grad is None for n, p in engine.transformer.named_parameters() if ".lora_" not in n)
    assert all(torch.isfinite(p.grad).all() for p in engine.params)
    assert math.isfinite(engine.optim_step()["grad_norm"]) and engine.skipped_steps == 0


def test_sampling_mode_trains_as_without_float8(tiny_model, monkeypatch):
    engine, sampler = _engine(tiny_model, monkeypatch, "sampling")
    plain, _ = _engine(tiny_model, monkeypatch, "none")
    rollout = sampler.sample(PROMPTS, seed=1, step=0)  # the sampler's switch is off here: 16-bit
    with fp8.fp8_gemms(engine.transformer):
        in_fp8 = sampler.sample(PROMPTS, seed=1, step=0)
    assert not torch.equal(in_fp8.samples.log_probs_BW, rollout.samples.log_probs_BW)
    # the trainer's passes are the unconverted model's, bit for bit
    for a, b in zip(engine.log_probs(in_fp8), plain.log_probs(in_fp8), strict=True):
        assert torch.equal(a, b)


def test_full_fine_tuning_in_float8_converts_its_reference_too(tiny_model, monkeypatch):
    _torchao()
    from diffrl.train.policies import REFERENCE

    engine, sampler = _engine(tiny_model, monkeypatch, "all", rank=0, kl_coef=0.1)
    assert len(fp8.float8_layers(engine.transformer)) == len(fp8.float8_layers(engine.reference)) == 25
    # the trained weights recast on every call (torchao's training linear), the frozen copy once
    assert {type(m).__name__ for m in fp8.float8_layers(engine.transformer)} == {"SwitchableFloat8Linear"}
    assert all(type(m) is FrozenFloat8Linear for m in fp8.float8_layers(engine.reference))
    rollout = sampler.sample(PROMPTS, seed=0, step=0)
    _, ref_means = engine.log_probs(rollout, REFERENCE)
    _step(engine, rollout, ref_means=ref_means)
    names = {m: n for n, m in engine.transformer.named_modules()}
    for layer in fp8.float8_layers(engine.transformer):  # the trained weights' gradients, in float8
        assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all(), names[layer]
    assert math.isfinite(engine.optim_step()["grad_norm"]) and engine.skipped_steps == 0


def test_a_colocated_sampler_samples_in_float8_and_the_trainer_does_not(tiny_model, monkeypatch):
    from diffrl.config import load_config
    from diffrl.workers.rollout_worker import RolloutWorker

    engine, _ = _engine(tiny_model, monkeypatch, "sampling")
    cfg = load_config("tiny_sd3", ["model.fp8=sampling", "model.dtype=bfloat16"])
    worker = RolloutWorker(
        cfg, engine.adapter, use_policy=engine.inference_policy
    )  # as HybridWorker wires it
    with torch.no_grad():
        plain = worker.sampler.sample(PROMPTS, seed=1, step=0)
        with fp8.fp8_gemms(engine.transformer):
            expected = worker.sampler.sample(PROMPTS, seed=1, step=0)
    sampled = worker.sample(PROMPTS, seed=1, step=0)
    assert torch.equal(sampled.samples.log_probs_BW, expected.samples.log_probs_BW)
    assert not torch.equal(sampled.samples.log_probs_BW, plain.samples.log_probs_BW)
    assert not any(layer.fp8 for layer in fp8.float8_layers(engine.transformer))  # off again for training


def test_compiled_a_frozen_base_skips_its_weight_gradient_gemm():
    """torchao's backward computes the weight-gradient GEMM unconditionally; compiled (as
    model.compile runs the blocks), a frozen base weight's is dead code and dropped, so the
    update's backward runs one float8 GEMM per frozen layer (to the input), a trained layer two."""
    _torchao()
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from diffrl.train.fp8_linear import recipe_config, to_float8

    def counted(frozen: bool) -> dict[str, int]:
        counts: dict[str, int] = {}

        def compiler(name):
            def compile_graph(gm, example_inputs):
                counts[name] = sum("scaled_mm" in str(node.target) for node in gm.graph.nodes)
                return make_boxed_func(gm.forward)

            return compile_graph

        torch._dynamo.reset()
        layer = to_float8(nn.Linear(64, 128).to(torch.bfloat16), recipe_config(), enabled=True)
        layer.requires_grad_(not frozen)
        compiled = torch.compile(
            layer, backend=aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))
        )
        x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
        compiled(x).sum().backward()
        return counts

    assert counted(frozen=True) == {"fw": 1, "bw": 1}
    assert counted(frozen=False) == {"fw": 1, "bw": 2}
