"""Batched replay (actor.replay_steps_per_forward, diffrl.train.replay): a micro-batch's trained
window steps as one transformer forward of S·B rows give the unbatched loss, metrics and LoRA
gradients up to float rounding, and old log-probs recomputed through the same batched forwards make
the ratio exactly 1 on unchanged weights."""

from dataclasses import replace

import pytest
import torch

from diffrl import transition
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
from diffrl.train import engine as engine_module
from diffrl.train.batch import PolicyGradientBatch, TrainingTargets
from diffrl.train.engine import POLICY, REFERENCE, TrainEngine
from diffrl.train.replay import replay_plan
from diffrl.transition import evaluate_step, evaluate_steps, replay_groups

PROMPTS = ["a red circle", "a blue square"]
WINDOW = 3  # trained steps: replay 2 groups them [0, 1], [2]; replay 3 runs the whole window at once
MICRO = 4


def make(tiny_model, *, mode="flow_grpo", clip_ratio=1e-4, kl_coef=0.0, replay=1):
    adapter = load_model(tiny_model("sd3"), dtype="float32")
    actor_cfg = ActorConfig(
        strategy="none",
        mini_batch_size=8,
        micro_batch_size=MICRO,
        replay_steps_per_forward=replay,
        optim=OptimConfig(lr=1e-3, weight_decay=0.0),
        loss=LossConfig(mode=mode, clip_ratio=clip_ratio, kl_coef=kl_coef),
    )
    engine = TrainEngine(
        adapter, ModelConfig(lora=LoraConfig(rank=4, alpha=4)), actor_cfg, total_optim_steps=10
    )
    rollout_cfg = RolloutConfig(
        n=4,
        micro_batch_size=MICRO,
        pipeline=PipelineConfig(
            height=32, width=32, num_inference_steps=4, guidance_scale=4.5, max_sequence_length=8
        ),
        sde=SdeConfig(noise_level=0.8, window_size=WINDOW, window_range=[0, WINDOW]),
    )
    return engine, TrajectorySampler(adapter, rollout_cfg, progress=False)


def perturb_lora(engine, scale=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in engine.transformer.named_parameters():
            if f".{POLICY}." in name:
                p.add_(scale * torch.randn(p.shape, generator=g))


def micro_batches(rollout, **targets):
    trained = PolicyGradientBatch(
        rollout,
        TrainingTargets(
            advantages_B=torch.linspace(-1, 1, len(rollout)), **targets, batch_size=[len(rollout)]
        ),
    )
    return [trained.select(slice(s, s + MICRO)) for s in range(0, len(rollout), MICRO)]


def update(engine, batches, replay):
    """forward_backward with `replay` steps per forward: (metrics, LoRA gradients, rows per velocity call)."""
    engine.cfg.replay_steps_per_forward = replay
    engine.optimizer.zero_grad(set_to_none=True)
    rows = []
    velocity = engine.adapter.velocity

    def counted(latents, *args, **kwargs):
        rows.append(latents.shape[0])
        return velocity(latents, *args, **kwargs)

    engine.adapter.velocity = counted
    try:
        metrics = engine.forward_backward(batches)
    finally:
        del engine.adapter.velocity
    return metrics, [p.grad.clone() for p in engine.params], rows


CASES = {
    "flow_grpo": dict(mode="flow_grpo"),
    "flow_grpo_kl": dict(mode="flow_grpo", kl_coef=0.1),
    "grpo_guard": dict(mode="grpo_guard", clip_ratio=2e-6),
    "flow_dppo": dict(mode="flow_dppo"),
    "dancegrpo_step_subsets": dict(mode="flow_grpo", mask=True),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_batched_replay_gives_the_unbatched_loss_metrics_and_gradients(tiny_model, case):
    settings = dict(CASES[case])
    mask = settings.pop("mask", False)
    engine, sampler = make(tiny_model, **settings)
    rollout = sampler.sample(PROMPTS, seed=5, step=0)
    perturb_lora(engine)  # after sampling: ratios leave 1, the clip (and Flow-DPPO's mask) is active
    targets = {}
    if engine.kl_fn is not None:
        targets["ref_means"] = engine.log_probs(rollout, REFERENCE)[1]
    if mask:  # DanceGRPO: every sample trains 2 of the 3 steps, its own 2
        targets["train_mask_BW"] = torch.tensor(
            [[True, True, False], [False, True, True], [True, False, True]] * 3
        )[:8]
    batches = micro_batches(rollout, **targets)

    one, grads_one, rows_one = update(engine, batches, replay=1)
    if not mask:
        assert rows_one == [MICRO] * WINDOW * 2  # one forward per (micro-batch, step)
    if settings["mode"] == "flow_grpo":
        assert 0 < one["clipfrac"] < 1  # the clip is active for some terms
    for replay in (2, WINDOW):
        batched, grads, rows = update(engine, batches, replay=replay)
        if not mask:  # each micro-batch's steps in ⌈W / replay⌉ forwards of up to replay × B rows
            groups = replay_groups(range(WINDOW), replay)
            assert rows == [MICRO * len(g) for g in groups] * 2
        assert len(rows) < len(rows_one)
        assert batched.keys() == one.keys()
        # float rounding only: a batched forward's loss is the fp32 share-weighted sum of its
        # steps' losses (each of order 1e-2 here, the mini-batch's mean of order 1e-4), its
        # gradient that sum's backward (measured: |Δ loss| 1e-8, |Δ grad| / ‖grad‖ 1e-6)
        for key, value in one.items():
            assert batched[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
        for a, b in zip(grads, grads_one, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-8)
        norm = torch.cat([g.flatten() for g in grads_one]).norm()
        assert (
            torch.cat([(a - b).flatten() for a, b in zip(grads, grads_one, strict=True)]).norm()
            <= 1e-5 * norm
        )


def test_replay_plan_keeps_every_parts_share_and_leaves_out_the_steps_no_sample_trains():
    class Batch:  # the plan reads only lengths and step masks
        def __init__(self, mask):
            self.targets = type("T", (), {"train_mask_BW": mask})()
            self.mask = mask

        def __len__(self):
            return self.mask.shape[0]

        def select(self, rows):
            return Batch(self.mask[rows])

    # step 1 is trained by no sample of the micro-batch: its group [0, 1] keeps only step 0
    mask = torch.tensor([[True, False, True], [True, False, True]])
    plan = replay_plan([Batch(mask)], [0, 1, 2], 2)
    assert [[p.step for p in f.parts] for f in plan] == [[0], [2]]
    assert [f.share for f in plan] == [0.5, 0.5]  # 2 rows × 1 / (1 micro-batch × 2 rows × K = 2)


@pytest.mark.parametrize("mode", ["flow_grpo", "grpo_guard"])
def test_batched_old_log_probs_make_the_ratio_exactly_one_on_unchanged_weights(tiny_model, monkeypatch, mode):
    engine, sampler = make(tiny_model, mode=mode, replay=2)
    perturb_lora(engine)  # a non-trivial policy, unchanged from here on
    rollout = sampler.sample(PROMPTS, seed=6, step=0)
    old_log_probs, old_means = engine.log_probs(rollout)  # through the update's own batched forwards
    batches = micro_batches(rollout, old_log_probs_BW=old_log_probs, old_means=old_means)

    seen = []  # (first sample, window step, log-probs) of every part the update evaluates
    evaluate = transition.evaluate_steps

    def recorded(adapter, parts):
        outs = evaluate(adapter, parts)
        for (r, j), out in zip(parts, outs, strict=True):
            seen.append((int(r.samples.sample_index_B[0]), j, out.log_prob_B.detach()))
        return outs

    # the batched forwards (the engine's name) and the single steps (`evaluate_step` calls it)
    monkeypatch.setattr(engine_module, "evaluate_steps", recorded)
    monkeypatch.setattr(transition, "evaluate_steps", recorded)
    metrics, _, rows = update(engine, batches, replay=2)
    assert rows == [2 * MICRO, MICRO] * 2  # steps [0, 1] batched, step 2 alone
    assert sorted((first, j) for first, j, _ in seen) == [(s, j) for s in (0, MICRO) for j in range(WINDOW)]
    for first, j, log_prob_B in seen:
        assert torch.equal(log_prob_B, old_log_probs[first : first + MICRO, j])  # bitwise
    assert metrics["ratio_mean"] == 1.0 and metrics["ratio_std"] == 0.0
    assert metrics["ppo_kl"] == 0.0 and metrics["clipfrac"] == 0.0


def test_one_part_is_evaluate_step_and_parts_of_other_rollouts_are_refused(tiny_model):
    engine, sampler = make(tiny_model)
    rollout = sampler.sample(PROMPTS, seed=7, step=0)
    mb = rollout.select(slice(0, MICRO))
    with torch.no_grad():
        (alone,) = evaluate_steps(engine.adapter, [(mb, 1)])
        expected = evaluate_step(engine.adapter, mb, 1)
        assert torch.equal(alone.log_prob_B, expected.log_prob_B) and torch.equal(alone.mean, expected.mean)
        other = replace(mb, prompt_embeds=mb.prompt_embeds.clone())
        with pytest.raises(ValueError, match="joins parts of one rollout only"):
            evaluate_steps(engine.adapter, [(mb, 0), (other, 1)])
        with pytest.raises(IndexError, match="window step 3 out of range"):
            evaluate_steps(engine.adapter, [(mb, 0), (mb, WINDOW)])


def test_old_log_probs_with_grad_keep_one_forwards_graph_at_a_time(tiny_model, monkeypatch):
    """`as_trained` runs each forward with grad on (as the update does) and must drop its graph
    before the next forward builds one: two graphs alive at once doubled the pass's peak and ran an
    SD3.5-M recipe with replay_steps_per_forward=3 out of memory on an H200."""
    import gc
    import weakref

    engine, sampler = make(tiny_model, replay=2)
    rollout = sampler.sample(PROMPTS, seed=8, step=0)
    graphs = []  # a weak reference to each forward's output, which holds its autograd graph
    alive_at_forward = []
    evaluate = transition.evaluate_steps

    def recorded(adapter, parts):
        gc.collect()
        alive_at_forward.append(sum(ref() is not None for ref in graphs))
        outs = evaluate(adapter, parts)
        assert outs[0].log_prob_B.grad_fn is not None  # grad on, as in the update
        graphs.append(weakref.ref(outs[0].log_prob_B))
        return outs

    monkeypatch.setattr(transition, "evaluate_steps", recorded)
    log_probs, _ = transition.evaluate_window(
        engine.adapter, rollout, MICRO, as_trained=True, steps_per_forward=2
    )
    assert len(alive_at_forward) == 4  # 2 micro-batches × forwards of steps [0, 1] and [2]
    assert alive_at_forward == [0, 0, 0, 0]
    assert log_probs.grad_fn is None and log_probs.shape == (len(rollout), WINDOW)
