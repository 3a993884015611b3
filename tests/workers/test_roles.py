import pytest
import torch

from diffrl.config import load_config
from diffrl.train.batch import PolicyGradientBatch, TrainingTargets
from diffrl.workers.group import public_methods
from diffrl.workers.roles import ActorWorker, HybridWorker, PromptShard, RolloutWorker
from diffrl.workers.weight_source import InPlaceWeights, WeightSource

PROMPTS = ["a red circle", "a blue square"]


@pytest.fixture()
def cfg(tiny_model):
    return load_config(
        "shapes_flow_grpo",
        [
            f"model.path={tiny_model('sd3')}",
            "model.lora.rank=4",
            "model.lora.alpha=4",
            "rollout.n=4",
            "rollout.micro_batch_size=4",
            "rollout.pipeline.height=32",
            "rollout.pipeline.width=32",
            "rollout.pipeline.num_inference_steps=4",
            "rollout.pipeline.max_sequence_length=8",
            "rollout.sde.window_size=2",
            "rollout.sde.window_range=[0,3]",
            "data.prompts_per_step=2",
            "actor.mini_batch_size=8",
            "actor.micro_batch_size=4",
            "actor.loss.clip_ratio=0.5",
            "actor.optim.lr=0.01",
        ],
    )


def update(worker, rollout):
    advantages = TrainingTargets(advantages_B=torch.tensor([1.0, -1.0] * 4), batch_size=[len(rollout)])
    trained = PolicyGradientBatch(rollout, advantages)
    worker.staging.forward_backward([trained.select(slice(0, 4)), trained.select(slice(4, 8))])
    return worker.optim_step()


def test_worker_classes_are_thin_surfaces_over_the_parts_they_declare():
    """At most 15 public methods a role; a part is addressed as "part.method", never by the
    worker's own name (the two never clash)."""
    for role in (ActorWorker, HybridWorker, RolloutWorker):
        assert len(public_methods(role)) <= 15, (role.__name__, public_methods(role))
    assert sorted(ActorWorker.PARTS) == sorted(HybridWorker.PARTS) == ["checkpoint", "report", "weights"]
    assert (
        HybridWorker.PARTS["weights"] is InPlaceWeights
    )  # colocated: `weights.set_version` only moves the version
    assert not hasattr(WeightSource, "set_version")


def test_hybrid_worker_samples_with_the_weights_it_just_trained(cfg):
    hybrid = HybridWorker(cfg)
    for name, part in HybridWorker.PARTS.items():  # what the controller's "part.method" reaches
        assert type(getattr(hybrid, name)) is part
    hybrid.weights.set_version(7)
    assert hybrid.rollout.weight_version == 7
    first = hybrid.rollout.sample(PROMPTS, seed=0, step=0)
    again = hybrid.rollout.sample(PROMPTS, seed=0, step=0)
    assert torch.equal(first.samples.final_latents, again.samples.final_latents)
    update(hybrid, first)
    after = hybrid.rollout.sample(PROMPTS, seed=0, step=0)  # same seed, new weights, no copy in between
    assert not torch.equal(after.samples.final_latents, first.samples.final_latents)
    assert hybrid.rollout.adapter is hybrid.engine.adapter


class _Handles:
    """Reward workers that hand back a placeholder per decoded micro-batch (nothing is scored)."""

    def submit(self, pixels, prompts, metadata):
        return len(prompts)


def test_a_replica_samples_a_request_only_with_the_weight_version_it_was_scheduled_for(cfg):
    """Bounded staleness names each request's weight version: a replica holding another one
    refuses it before sampling anything; one holding it samples and records it."""
    replica = RolloutWorker(cfg)
    shard = PromptShard(PROMPTS, ["0", "1"], [{}, {}], None, sample_offset=0)
    with pytest.raises(RuntimeError, match=r"weight version 3, but this replica holds version 0"):
        replica.sample_and_score(shard, seed=0, step=4, rewards=_Handles(), version=3)
    replica.weight_version = 3  # what `receive_weights(..., version=3)` leaves behind
    summary, _ = replica.sample_and_score(shard, seed=0, step=4, rewards=_Handles(), version=3)
    assert summary.extras["weight_version"] == 3
    assert len(summary) == len(PROMPTS) * cfg.rollout.n


def test_compiled_replica_and_trainer_compute_the_trained_policy_through_the_training_graph(cfg, monkeypatch):
    """Compiled blocks round differently with grad than without (on a GPU at full size), and the
    update runs the grad graph: a compiled replica samples its window steps and evaluates the
    trained policy's old log-probs through that graph (its trained LoRA weights require grad, as
    the trainer's do), and so does the trainer's own recompute; the reference pass stays no-grad."""
    from dataclasses import replace

    from diffrl.models.base import ModelAdapter
    from diffrl.train.engine import POLICY, REFERENCE

    compile_blocks = ModelAdapter.compile_blocks  # aot_eager traces the training graph as inductor
    monkeypatch.setattr(  # does, without a C++ toolchain
        ModelAdapter, "compile_blocks", lambda self, **kw: compile_blocks(self, backend="aot_eager", **kw)
    )
    compiled = replace(
        cfg,
        model=replace(cfg.model, compile=True),
        rollout=replace(cfg.rollout, micro_batch_size=8),  # twice the actor's: window steps sliced to 4
    )
    trainer, replica = HybridWorker(compiled), RolloutWorker(compiled)
    trained = {n for n, p in trainer.engine.transformer.named_parameters() if p.requires_grad}
    assert trained == {n for n, p in replica.adapter.transformer.named_parameters() if p.requires_grad}
    with torch.no_grad():  # the replica holds the trainer's weights, as after a sync
        state = trainer.engine.transformer.state_dict()
        for name, tensor in replica.adapter.transformer.state_dict().items():
            tensor.copy_(state[name])

    def record(adapter):
        calls, velocity = [], adapter.velocity

        def spy(latents, *args, **kwargs):
            calls.append((latents.shape[0], torch.is_grad_enabled()))
            return velocity(latents, *args, **kwargs)

        adapter.velocity = spy
        return calls

    sampled = record(replica.adapter)
    rollout = replica.sample(PROMPTS, seed=0, step=0)
    steps, window = cfg.rollout.pipeline.num_inference_steps, cfg.rollout.sde.window_size
    assert sorted(sampled) == sorted([(8, False)] * (steps - window) + [(4, True)] * (2 * window))

    sampled.clear()
    passes = replica.evaluate(rollout, [POLICY, REFERENCE])
    assert sorted(sampled) == sorted([(4, True)] * (2 * window) + [(4, False)] * (2 * window))
    recomputed = record(trainer.engine.adapter)
    old, _ = trainer.staging.log_probs(rollout)  # the run's recompute: as_trained by default when compiled
    ref_trainer, _ = trainer.staging.log_probs(rollout, REFERENCE)
    assert sorted(recomputed) == sorted([(4, True)] * (2 * window) + [(4, False)] * (2 * window))
    assert torch.equal(passes[POLICY][0], old) and torch.equal(old, rollout.samples.log_probs_BW)
    assert torch.equal(passes[REFERENCE][0], ref_trainer)
