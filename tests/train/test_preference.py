"""The direct-preference backward passes (diffrl.train.preference) against the loss classes.

Each check recomputes the loss independently from the same tensors: noise and noise levels drawn
from the documented generators (PREFERENCE_STREAM, seed, step, epoch, sample), the three policies'
velocities called directly on the adapter, and the registered loss class; the function's loss and
accumulated gradient must match.
"""

import pytest
import torch

from diffrl.algos.awm import AWMInputs, AWMLoss
from diffrl.algos.dpo import DPOInputs, DPOLoss, sample_logit_normal_sigmas
from diffrl.algos.flow_matching import interpolate
from diffrl.algos.nft import DiffusionNFTLoss, NFTInputs, optimality_probability, timestep_subset
from diffrl.config.schema import ActorConfig, LoraConfig, LossConfig, ModelConfig, OptimConfig
from diffrl.models import load_model
from diffrl.seeding import PREFERENCE_STREAM, generator
from diffrl.train.engine import OLD, POLICY, TrainEngine
from diffrl.train.preference import (
    CleanBatch,
    PairBatch,
    VelocityCall,
    conditional,
    dpo_backward,
    forward_process_backward,
    join_worker_metrics,
)

SEED, STEP, EPOCH = 3, 5, 1
CALL = VelocityCall(height=32, width=32, guidance_scale=4.5)


def make_engine(tiny_model, loss: LossConfig, *, with_old: bool):
    adapter = load_model(tiny_model("sd3"), dtype="float32")
    actor = ActorConfig(strategy="none", optim=OptimConfig(lr=1e-3, weight_decay=0.0), loss=loss)
    engine = TrainEngine(
        adapter, ModelConfig(lora=LoraConfig(rank=4, alpha=4)), actor, total_optim_steps=4, with_old=with_old
    )
    # distinct trained / old adapters (both start equal, and LoRA's B starts at zero)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in engine.transformer.named_parameters():
            if ".lora_" in name:
                p.add_((0.05 if f".{POLICY}." in name else 0.03) * torch.randn(p.shape, generator=g))
    return engine


def clean_batch(engine, size=3):
    g = torch.Generator().manual_seed(1)
    shape = engine.adapter.latent_shape(32, 32)
    cond = engine.adapter.encode_prompts(["a red circle", "a blue square", "a cat"][:size], [""] * size, 8)
    return CleanBatch(
        latents=torch.randn((size, *shape), generator=g),
        cond=cond,
        advantages_B=torch.tensor([1.5, -0.7, 0.2][:size]),
        sample_index_B=torch.tensor([4, 9, 11][:size]),
    )


def draws(sample_index_B, shape, num_levels, fraction):
    """The documented draws, independently: per sample, K level indices then K noises."""
    sig, noise = [], []
    for i in sample_index_B.tolist():
        g = generator("cpu", PREFERENCE_STREAM, SEED, STEP, EPOCH, i)
        index = timestep_subset(num_levels, fraction, [g])[0]
        sig.append(index)
        noise.append(torch.randn((len(index), *shape), generator=g))
    return torch.stack(sig), torch.stack(noise)


def velocity(engine, policy, x_t, sigmas_B, cond, guidance=4.5):
    with engine.use_policy(policy):
        return engine.adapter.velocity(x_t, sigmas_B * 1000.0, cond, guidance, 32, 32)


def run_backward(engine, batches, sigma_table, fraction):
    """`forward_process_backward` with this file's call, advantage mode and (seed, step, epoch)."""
    return forward_process_backward(
        engine,
        batches,
        call=CALL,
        sigma_table=sigma_table,
        fraction=fraction,
        adv_mode="continuous",
        seed=SEED,
        step=STEP,
        epoch=EPOCH,
    )


def grads(engine):
    return [p.grad.clone() for p in engine.params]


@pytest.mark.parametrize("mode", ["diffusion_nft", "awm"])
def test_forward_process_backward_equals_the_loss_class_on_the_same_noise(tiny_model, mode):
    loss_cfg = LossConfig(mode=mode, kl_coef=0.1, awm_ema_kl_coef=0.2, mix_beta=0.3, clip_ratio=0.2)
    engine = make_engine(tiny_model, loss_cfg, with_old=True)
    batch = clean_batch(engine)
    table = torch.tensor([1.0, 0.8, 0.5, 0.2])
    got = run_backward(engine, [batch], table, 0.5)
    got_grads = grads(engine)
    engine.optimizer.zero_grad(set_to_none=True)

    index_BK, noise_BK = draws(batch.sample_index_B, batch.latents.shape[1:], len(table), 0.5)
    assert index_BK.shape[1] == 2  # K = ⌊4·0.5⌋ levels per sample
    total = 0.0
    for k in range(2):
        sigmas_B, noise = table[index_BK[:, k]], noise_BK[:, k]
        x_t = interpolate(batch.latents, noise, sigmas_B)
        with torch.no_grad():
            v_old = velocity(engine, OLD, x_t, sigmas_B, batch.cond)
            v_ref = velocity(engine, "reference", x_t, sigmas_B, batch.cond)
        v = velocity(engine, POLICY, x_t, sigmas_B, batch.cond)
        if mode == "diffusion_nft":
            r = optimality_probability(batch.advantages_B, loss_cfg.adv_clip_max, "continuous")
            loss, _ = DiffusionNFTLoss().compute(
                NFTInputs(r, batch.latents, x_t, sigmas_B, v_old, v_ref), v, loss_cfg
            )
        else:
            inputs = AWMInputs(
                batch.advantages_B, batch.latents, noise, sigmas_B, ref_velocity=v_ref, ema_velocity=v_old
            )
            loss, _ = AWMLoss().compute(inputs, v, loss_cfg)
        (loss / 2).backward()
        total += float(loss.detach()) / 2
    assert got["loss"] == pytest.approx(total, rel=1e-5)
    assert got["samples"] == 3 and got["noise_levels"] == 2
    assert got["kl"] > 0 and (mode == "diffusion_nft" or got["ema_kl"] > 0)
    for a, b in zip(got_grads, grads(engine), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_micro_batch_split_does_not_change_the_nft_gradient(tiny_model):
    engine = make_engine(tiny_model, LossConfig(mode="diffusion_nft"), with_old=True)
    batch = clean_batch(engine)
    table = torch.tensor([1.0, 0.6, 0.3])
    whole = run_backward(engine, [batch], table, 1.0)
    g_whole = grads(engine)
    engine.optimizer.zero_grad(set_to_none=True)
    parts = [
        CleanBatch(batch.latents[s], batch.cond[s], batch.advantages_B[s], batch.sample_index_B[s])
        for s in (slice(0, 1), slice(1, 3))
    ]
    split = run_backward(engine, parts, table, 1.0)
    assert split["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    for a, b in zip(g_whole, grads(engine), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_dpo_backward_equals_the_loss_class_and_ignores_padding(tiny_model):
    loss_cfg = LossConfig(mode="dpo", dpo_beta=50.0)
    engine = make_engine(tiny_model, loss_cfg, with_old=False)
    g = torch.Generator().manual_seed(2)
    shape = engine.adapter.latent_shape(32, 32)
    cond = engine.adapter.encode_prompts(["a red circle", "a blue square"], [""] * 2, 8)
    pairs = PairBatch(
        chosen_latents=torch.randn((2, *shape), generator=g),
        rejected_latents=torch.randn((2, *shape), generator=g),
        cond=cond,
        pair_index_P=torch.tensor([0, 7]),
        weight=1.0,
    )
    padding = PairBatch(
        pairs.chosen_latents[:1], pairs.rejected_latents[:1], cond[:1], torch.tensor([0]), 0.0
    )
    got = dpo_backward(engine, [pairs, padding], call=CALL, seed=SEED, step=STEP, epoch=EPOCH)
    got_grads = grads(engine)
    engine.optimizer.zero_grad(set_to_none=True)

    gens = [generator("cpu", PREFERENCE_STREAM, SEED, STEP, EPOCH, i) for i in (0, 7)]
    sigmas_P = sample_logit_normal_sigmas(gens)
    noise = torch.cat([torch.randn((1, *shape), generator=gen) for gen in gens])
    plain = conditional(torch.cat([cond, cond]))
    assert not plain.has_negative  # DPO compares conditional velocities
    x_t = interpolate(
        torch.cat([pairs.chosen_latents, pairs.rejected_latents]),
        torch.cat([noise, noise]),
        torch.cat([sigmas_P] * 2),
    )
    with torch.no_grad():
        v_ref = velocity(engine, "reference", x_t, torch.cat([sigmas_P] * 2), plain)
    v = velocity(engine, POLICY, x_t, torch.cat([sigmas_P] * 2), plain)
    inputs = DPOInputs(pairs.chosen_latents, pairs.rejected_latents, noise, sigmas_P, v_ref)
    loss, metrics = DPOLoss().compute(inputs, v, loss_cfg)
    loss.backward()
    assert got["loss"] == pytest.approx(float(loss), rel=1e-5)
    assert got["implicit_acc"] == metrics["implicit_acc"] and got["samples"] == 2
    for a, b in zip(got_grads, grads(engine), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_worker_metrics_are_averaged_by_their_sample_counts():
    joined = join_worker_metrics(
        [{"loss": 1.0, "samples": 3.0}, {"loss": 5.0, "samples": 1.0}, {"samples": 0.0}]
    )
    assert joined == {"loss": pytest.approx((3 * 1.0 + 5.0) / 4)}
    assert join_worker_metrics([{"samples": 0.0}]) == {}


def test_the_wrong_loss_is_refused(tiny_model):
    engine = make_engine(tiny_model, LossConfig(mode="dpo"), with_old=False)
    with pytest.raises(ValueError, match=r"not actor\.loss\.mode='dpo'"):
        forward_process_backward(
            engine,
            [clean_batch(engine)],
            call=CALL,
            sigma_table=torch.ones(2),
            fraction=1.0,
            adv_mode="continuous",
            seed=0,
            step=0,
            epoch=0,
        )


def _count_forwards(engine):
    calls = []
    hook = engine.transformer.register_forward_hook(lambda _m, _i, _o: calls.append(1))
    return calls, hook


def test_old_adapter_equal_to_the_trained_one_costs_no_forward_pass(tiny_model):
    """After a copy (or an EMA at decay 0) the `old` adapter is the trained one: its velocity is the
    trained velocity, detached. The loss and gradient are those of the explicit computation (a
    separate forward of the old adapter), with one forward per level instead of two; after an
    optimizer step the adapters differ and the old forward runs again."""
    loss_cfg = LossConfig(mode="diffusion_nft", mix_beta=0.3)
    engine = make_engine(tiny_model, loss_cfg, with_old=True)
    engine.copy_adapter(POLICY, OLD)
    assert engine.adapters_equal(POLICY, OLD)
    batch = clean_batch(engine)
    table = torch.tensor([1.0, 0.8, 0.5, 0.2])
    calls, hook = _count_forwards(engine)
    got = run_backward(engine, [batch], table, 0.5)
    hook.remove()
    assert len(calls) == 2  # two levels, the trained forward only
    got_grads = grads(engine)
    engine.optimizer.zero_grad(set_to_none=True)

    index_BK, noise_BK = draws(batch.sample_index_B, batch.latents.shape[1:], len(table), 0.5)
    total = 0.0
    for k in range(2):
        sigmas_B, noise = table[index_BK[:, k]], noise_BK[:, k]
        x_t = interpolate(batch.latents, noise, sigmas_B)
        with torch.no_grad():
            v_old = velocity(engine, OLD, x_t, sigmas_B, batch.cond)
        v = velocity(engine, POLICY, x_t, sigmas_B, batch.cond)
        r = optimality_probability(batch.advantages_B, loss_cfg.adv_clip_max, "continuous")
        loss, _ = DiffusionNFTLoss().compute(
            NFTInputs(r, batch.latents, x_t, sigmas_B, v_old, None), v, loss_cfg
        )
        (loss / 2).backward()
        total += float(loss.detach()) / 2
    assert got["loss"] == pytest.approx(total, rel=1e-5)
    for a, b in zip(got_grads, grads(engine), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)

    engine.optim_step()
    assert not engine.adapters_equal(POLICY, OLD)
    calls, hook = _count_forwards(engine)
    run_backward(engine, [batch], table, 0.5)
    hook.remove()
    assert len(calls) == 4  # the old adapter runs its own forward again
    engine.optimizer.zero_grad(set_to_none=True)
    engine.ema_adapter(0.5, POLICY, OLD)
    assert not engine.adapters_equal(POLICY, OLD)
    engine.ema_adapter(0.0, POLICY, OLD)
    assert engine.adapters_equal(POLICY, OLD)


def test_merged_inference_gives_the_unmerged_loss_and_gradient(tiny_model):
    """model.lora.merge_inference runs the old adapter's forward merged into the weights: the
    loss and gradient are the unmerged engine's, to fp32 rounding."""
    loss_cfg = LossConfig(mode="diffusion_nft", mix_beta=0.3, kl_coef=0.1)
    results = []
    for merge in (False, True):
        engine = make_engine(tiny_model, loss_cfg, with_old=True)
        engine.model_cfg.lora.merge_inference = merge
        assert not engine.adapters_equal(POLICY, OLD)
        old_lora_calls = []
        for name, module in engine.transformer.named_modules():
            if name.endswith("lora_A.old"):
                module.register_forward_hook(lambda _m, _i, _o, calls=old_lora_calls: calls.append(1))
        got = run_backward(engine, [clean_batch(engine)], torch.tensor([1.0, 0.6, 0.3]), 1.0)
        assert bool(old_lora_calls) != merge  # merged: the old adapter's LoRA matmuls never ran
        results.append((got, grads(engine)))
    (unmerged, g0), (merged, g1) = results
    assert merged["loss"] == pytest.approx(unmerged["loss"], rel=1e-5)
    assert merged["old_deviate"] == pytest.approx(unmerged["old_deviate"], rel=1e-4)
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
