import math
from contextlib import contextmanager

import pytest
import torch

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
from diffrl.train.batch import PolicyGradientBatch, TrainingTargets
from diffrl.train.engine import OLD, POLICY, REFERENCE, TrainEngine, lr_lambda

PROMPTS = ["a red circle", "a blue square"]


def make(tiny_model, *, rank=4, lr=1e-3, clip_ratio=1e-4, kl_coef=0.0, with_old=False, micro=4):
    adapter = load_model(tiny_model("sd3"), dtype="float32")
    model_cfg = ModelConfig(lora=LoraConfig(rank=rank, alpha=rank))
    actor_cfg = ActorConfig(
        strategy="none",
        mini_batch_size=8,
        micro_batch_size=micro,
        optim=OptimConfig(lr=lr, weight_decay=0.0),
        loss=LossConfig(clip_ratio=clip_ratio, kl_coef=kl_coef),
    )
    engine = TrainEngine(adapter, model_cfg, actor_cfg, total_optim_steps=10, with_old=with_old)
    rollout_cfg = RolloutConfig(
        n=4,
        micro_batch_size=micro,
        pipeline=PipelineConfig(
            height=32, width=32, num_inference_steps=4, guidance_scale=4.5, max_sequence_length=8
        ),
        sde=SdeConfig(noise_level=0.8, window_size=2, window_range=[0, 3]),
    )
    sampler = TrajectorySampler(adapter, rollout_cfg, progress=False)
    return engine, sampler


def batch(rollout, advantages_B, **targets):
    """The rollout with the controller's training targets."""
    return PolicyGradientBatch(
        rollout, TrainingTargets(advantages_B=advantages_B, **targets, batch_size=[len(rollout)])
    )


def lora_tensors(engine, name):
    return {n: p.detach().clone() for n, p in engine.transformer.named_parameters() if f".{name}." in n}


def perturb_lora(engine, name=POLICY, scale=0.05):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in engine.transformer.named_parameters():
            if f".{name}." in n:
                p.add_(scale * torch.randn(p.shape, generator=g))


def test_only_the_default_adapter_trains(tiny_model):
    engine, _ = make(tiny_model, with_old=True)
    trainable = [n for n, p in engine.transformer.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n and f".{POLICY}." in n for n in trainable)
    assert {id(p) for p in engine.params} == {
        id(p) for p in engine.transformer.parameters() if p.requires_grad
    }


def test_recomputed_log_probs_equal_the_rollouts_before_any_update(tiny_model):
    engine, sampler = make(tiny_model)
    perturb_lora(engine)  # a non-trivial policy
    rollout = sampler.sample(PROMPTS, seed=0, step=0)
    log_probs, means = engine.log_probs(rollout)  # same micro-batches as sampled
    assert torch.equal(log_probs, rollout.samples.log_probs_BW)  # ratio exactly 1
    assert torch.equal(means, rollout.samples.means)


def test_flow_grpo_steps_raise_positive_and_lower_negative_samples(tiny_model):
    engine, sampler = make(tiny_model, lr=3e-3, clip_ratio=0.5)
    rollout = sampler.sample(PROMPTS, seed=1, step=0)
    advantages = torch.tensor([1.0, -1.0] * 4)
    trained = batch(rollout, advantages)
    before, _ = engine.log_probs(rollout)
    for _ in range(4):
        engine.forward_backward([trained.select(slice(0, 4)), trained.select(slice(4, 8))])
        engine.optim_step()
    after, _ = engine.log_probs(rollout)
    change = (after - before).mean(dim=1)
    # Samples share parameters, so one sample may be dragged along by the others; the group as a
    # whole must move the PPO way, and most samples individually.
    up, down = change[advantages > 0], change[advantages < 0]
    assert up.mean() > 0 > down.mean(), change
    assert (up > 0).sum() >= 3 and (down < 0).sum() >= 3, change


def test_micro_batch_split_accumulates_the_same_gradient(tiny_model):
    engine, sampler = make(tiny_model, clip_ratio=1e-5)
    rollout = sampler.sample(PROMPTS, seed=2, step=0)
    trained = batch(rollout, torch.linspace(-1, 1, 8))
    perturb_lora(engine, scale=0.05)  # after sampling: ratios leave 1 and the clip is active
    whole = trained.select(slice(0, 4))
    assert 0 < engine.forward_backward([whole])["clipfrac"] < 1
    engine.optimizer.zero_grad()
    engine.forward_backward([whole])
    grads_whole = [p.grad.clone() for p in engine.params]
    engine.optimizer.zero_grad()
    engine.forward_backward([whole.select(slice(0, 2)), whole.select(slice(2, 4))])
    for a, p in zip(grads_whole, engine.params, strict=True):
        torch.testing.assert_close(p.grad, a, rtol=1e-4, atol=1e-7)


def test_reference_policy_is_the_base_model(tiny_model):
    engine, _ = make(tiny_model)
    perturb_lora(engine)
    base = load_model(tiny_model("sd3"), dtype="float32")
    x = torch.randn(2, *base.latent_shape(32, 32), generator=torch.Generator().manual_seed(3))
    cond = base.encode_prompts(PROMPTS, ["", ""], 8)
    t = torch.tensor([700.0, 300.0])
    with torch.no_grad():
        expected = base.velocity(x, t, cond, 4.5, 32, 32)
        with engine.use_policy(REFERENCE):
            reference = engine.adapter.velocity(x, t, cond, 4.5, 32, 32)
        policy = engine.adapter.velocity(x, t, cond, 4.5, 32, 32)
    torch.testing.assert_close(reference, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(policy, expected, atol=1e-4)  # the perturbed LoRA is active again
    assert all(p.requires_grad for p in engine.params)  # and still the trained one


def test_copy_and_ema_of_the_old_adapter(tiny_model):
    engine, _ = make(tiny_model, with_old=True)
    perturb_lora(engine, POLICY)
    engine.copy_adapter(POLICY, OLD)
    default, old = lora_tensors(engine, POLICY), lora_tensors(engine, OLD)
    for name, value in default.items():
        assert torch.equal(old[name.replace(f".{POLICY}.", f".{OLD}.")], value)
    perturb_lora(engine, POLICY, scale=0.1)
    new_default = lora_tensors(engine, POLICY)
    engine.ema_adapter(0.9, POLICY, OLD)
    ema = lora_tensors(engine, OLD)
    for name, value in new_default.items():
        old_name = name.replace(f".{POLICY}.", f".{OLD}.")
        torch.testing.assert_close(ema[old_name], 0.9 * old[old_name] + 0.1 * value)
    with pytest.raises(ValueError, match=r"decay 1\.5"):
        engine.ema_adapter(1.5)


def test_non_finite_gradient_step_is_skipped_and_counted(tiny_model):
    engine, _ = make(tiny_model)
    before = [p.detach().clone() for p in engine.params]
    for p in engine.params:
        p.grad = torch.full_like(p, float("nan"))
    metrics = engine.optim_step()
    assert math.isnan(metrics["grad_norm"]) and metrics["skipped_steps"] == 1.0
    assert engine.skipped_steps == 1 and engine.optim_steps == 0
    assert all(torch.equal(a, p) for a, p in zip(before, engine.params, strict=True))
    assert all(p.grad is None for p in engine.params)


def test_kl_term_uses_reference_means_and_is_zero_at_the_reference(tiny_model):
    engine, sampler = make(tiny_model, kl_coef=0.1)
    rollout = sampler.sample(PROMPTS, seed=0, step=0)
    _, ref_means = engine.log_probs(rollout, REFERENCE)
    trained = batch(rollout, torch.zeros(8), ref_means=ref_means)
    metrics = engine.forward_backward([trained.select(slice(0, 4))])
    assert metrics["kl"] == 0.0  # LoRA B starts at zero: the policy is the reference
    perturb_lora(engine)
    engine.optimizer.zero_grad()
    assert engine.forward_backward([trained.select(slice(0, 4))])["kl"] > 0
    trained.targets.ref_means = None
    with pytest.raises(ValueError, match="no ref_means"):
        engine.forward_backward([trained.select(slice(0, 4))])


def test_full_fine_tuning_trains_everything_and_keeps_a_frozen_reference(tiny_model):
    engine, sampler = make(tiny_model, rank=0, kl_coef=0.1)
    assert all(p.requires_grad for p in engine.transformer.parameters())
    assert engine.reference is not None and not any(p.requires_grad for p in engine.reference.parameters())
    rollout = sampler.sample(PROMPTS, seed=0, step=0)
    _, ref_means = engine.log_probs(rollout, REFERENCE)
    trained = batch(rollout, torch.tensor([1.0, -1.0] * 4), ref_means=ref_means)
    engine.forward_backward([trained.select(slice(0, 4))])
    engine.optim_step()
    _, moved = engine.log_probs(rollout)
    _, still = engine.log_probs(rollout, REFERENCE)
    assert not torch.equal(moved, still)
    torch.testing.assert_close(still, ref_means)
    with pytest.raises(ValueError, match="needs LoRA"):
        make(tiny_model, rank=0, with_old=True)


def test_missing_advantages_is_an_error(tiny_model):
    _, sampler = make(tiny_model)
    rollout = sampler.sample(PROMPTS, seed=0, step=0)
    with pytest.raises(TypeError, match="advantages_B"):
        TrainingTargets(batch_size=[len(rollout)])
    with pytest.raises(ValueError, match="4 training targets for 8 rollout samples"):
        PolicyGradientBatch(rollout, TrainingTargets(advantages_B=torch.zeros(4), batch_size=[4]))


@pytest.mark.parametrize(
    ("scheduler", "expected"),
    [
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0]),
        # after 2 warmup steps, progress = (step - 2) / (10 - 2)
        ("linear", [0.5, 1.0, 1.0, 1 - 1 / 8, 1 - 2 / 8]),
        ("cosine", [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * k / 8)) for k in (0, 1, 2)]),
    ],
)
def test_lr_schedules_match_their_closed_forms(scheduler, expected):
    factor = lr_lambda(scheduler, warmup_steps=2, total_steps=10)
    assert [factor(s) for s in range(5)] == pytest.approx(expected)


def _grads(engine):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in engine.params]


def test_step_subsets_train_each_sample_on_its_own_steps(tiny_model):
    """DanceGRPO's per-sample step subsets: the masked mini-batch gradient equals the average, over
    samples, of each sample's gradient on the steps it trains, computed one sample at a time."""
    engine, sampler = make(tiny_model, clip_ratio=1e-5)
    rollout = sampler.sample(PROMPTS, seed=3, step=0)
    perturb_lora(engine, scale=0.05)  # ratios leave 1: the clip is active for some terms
    mask = torch.tensor([[True, False], [False, True]] * 4)  # K = 1 of W = 2 steps per sample
    trained = batch(rollout, torch.linspace(-1, 1, 8), train_mask_BW=mask)
    engine.optimizer.zero_grad()
    engine.forward_backward([trained.select(slice(0, 4)), trained.select(slice(4, 8))])
    masked = _grads(engine)

    engine.optimizer.zero_grad()
    for i in range(8):
        one = trained.select([i])
        (j,) = torch.nonzero(mask[i]).flatten().tolist()
        loss, _ = engine._step_loss(one, j)
        (loss / 8).backward()
    for a, b in zip(masked, _grads(engine), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-8)


def test_rollout_correction_weights_scale_each_samples_term(tiny_model):
    """A weight multiplies its sample's term: zero weights remove samples, and the loss still
    divides by the micro-batch size (the half that is left contributes half its own gradient)."""
    engine, sampler = make(tiny_model)
    rollout = sampler.sample(PROMPTS, seed=4, step=0)
    half = batch(rollout, torch.linspace(-1, 1, 8)).select(slice(0, 4))
    kept = half.select(slice(0, 2))
    engine.optimizer.zero_grad()
    engine.forward_backward([kept])
    expected = [g / 2 for g in _grads(engine)]
    half.targets.weights_BW = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    engine.optimizer.zero_grad()
    engine.forward_backward([half])
    for a, b in zip(_grads(engine), expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-9)


def _rollout_with_random_lora(tiny_model, *, rollout_micro: int, actor_micro: int, compile_backend=None):
    """A rollout sampled by the module an engine trains (LoRA made non-zero so it matters), its
    log-probs meant for reuse as the trainer's old ones."""
    engine, sampler = make(tiny_model, micro=actor_micro)
    sampler.log_probs_reused = True
    perturb_lora(engine)
    if compile_backend is not None:
        engine.adapter.compile_blocks(backend=compile_backend)
    sampler.cfg.micro_batch_size = rollout_micro
    rollout = sampler.sample(PROMPTS, seed=0, step=0)
    return engine, rollout


def _trainer_log_probs(engine, rollout, micro):
    """The trainer's first forward (grad on, its own micro-batches), as `_step_loss` computes it."""
    from diffrl.transition import evaluate_step

    rows = []
    for s in range(0, len(rollout), micro):
        mb = rollout.select(slice(s, s + micro))
        rows.append(torch.stack([evaluate_step(engine.adapter, mb, j).log_prob_B for j in range(2)], 1))
    return torch.cat(rows).detach()


def test_eager_sampled_log_probs_equal_the_trainers_first_forward(tiny_model):
    engine, rollout = _rollout_with_random_lora(tiny_model, rollout_micro=4, actor_micro=4)
    trained = _trainer_log_probs(engine, rollout, 4)
    assert torch.equal(trained, rollout.samples.log_probs_BW)  # eager: same kernels with and without grad


@pytest.mark.parametrize("reused", [True, False], ids=["reused", "recomputed"])
def test_eager_sampler_computes_window_steps_in_actor_micro_batches_where_its_log_probs_are_reused(
    tiny_model, reused
):
    # CPU matmuls over a few rows (the per-sample timestep and modulation projections) round by
    # row count: sampled 4 at a time, the log-probs differ from the trainer's forwards of 1 by
    # ~1e-7. Where the trainer reuses them the sampler slices its window steps to the trainer's
    # micro-batch (no grad: eager kernels are the same either way); where it recomputes them it
    # samples at its own micro-batch, unslowed.
    engine, _ = make(tiny_model, micro=1)
    perturb_lora(engine)
    sampler = TrajectorySampler(
        engine.adapter, rollout_cfg_with_micro(4), progress=False, log_probs_reused=reused
    )
    with velocity_calls(engine.adapter) as calls:
        rollout = sampler.sample(PROMPTS, seed=0, step=0)  # 8 samples, 4 steps
    if reused:  # bitwise what the update's first forwards (grad on, 1 sample each) compute
        assert torch.equal(_trainer_log_probs(engine, rollout, 1), rollout.samples.log_probs_BW)
    _, w = sampler.window(0, 0)
    window = [(1, False)] * (8 * w) if reused else [(4, False)] * (2 * w)
    assert sorted(calls) == sorted([(4, False)] * (2 * (4 - w)) + window)


@pytest.mark.parametrize("reused", [True, False], ids=["reused", "recomputed"])
def test_compiled_sampler_runs_window_steps_through_the_training_graph_where_its_log_probs_are_reused(
    tiny_model, reused
):
    # aot_eager traces the joint (training) graph like inductor does, without a C++ toolchain; the
    # rollout micro-batch (8) is twice the actor's (4). Reused: the sampler slices its window steps
    # to 4 and runs them with grad on, as the update's first forward. Recomputed (batched replay,
    # merged LoRA, old_log_probs=recompute): nothing needs that, so it samples 8 at a time, no grad.
    engine, rollout = _rollout_with_random_lora(
        tiny_model, rollout_micro=8, actor_micro=4, compile_backend="aot_eager"
    )
    sampler = TrajectorySampler(
        engine.adapter, rollout_cfg_with_micro(8), progress=False, log_probs_reused=reused
    )
    with velocity_calls(engine.adapter) as calls:
        again = sampler.sample(PROMPTS, seed=0, step=0)
    _, w = sampler.window(0, 0)
    window = [(4, True)] * (2 * w) if reused else [(8, False)] * w
    assert sorted(calls) == sorted([(8, False)] * (4 - w) + window)  # 4 steps, 8 samples
    if reused:
        assert torch.equal(again.samples.log_probs_BW, rollout.samples.log_probs_BW)
        assert torch.equal(_trainer_log_probs(engine, rollout, 4), rollout.samples.log_probs_BW)
    else:
        assert torch.allclose(again.samples.log_probs_BW, rollout.samples.log_probs_BW, rtol=1e-4, atol=1e-4)


@contextmanager
def velocity_calls(adapter):
    """The (batch size, grad enabled) of each `adapter.velocity` call made inside the block."""
    calls = []
    velocity = adapter.velocity

    def spy(latents, *args, **kwargs):
        calls.append((latents.shape[0], torch.is_grad_enabled()))
        return velocity(latents, *args, **kwargs)

    adapter.velocity = spy
    try:
        yield calls
    finally:
        del adapter.velocity


def rollout_cfg_with_micro(micro):
    return RolloutConfig(
        n=4,
        micro_batch_size=micro,
        pipeline=PipelineConfig(
            height=32, width=32, num_inference_steps=4, guidance_scale=4.5, max_sequence_length=8
        ),
        sde=SdeConfig(noise_level=0.8, window_size=2, window_range=[0, 3]),
    )
