"""GPU correctness of the sampler in bf16 (run on the GPU machine: pytest -m gpu)."""

import pytest
import torch

from diffrl.config.schema import PipelineConfig, RolloutConfig, SdeConfig
from diffrl.models import load_model
from diffrl.rollout import TrajectorySampler
from diffrl.transition import evaluate_step

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["sd3", "flux", "qwen_image", "wan"])
def test_bf16_reevaluation_of_the_same_micro_batch_is_exact(tiny_model, family):
    adapter = load_model(tiny_model(family), dtype="bfloat16", device="cuda")
    true_cfg = 4.0 if family in ("flux", "qwen_image") else None
    cfg = RolloutConfig(
        n=4,
        micro_batch_size=4,
        pipeline=PipelineConfig(
            height=32,
            width=32,
            num_inference_steps=6,
            guidance_scale=4.5,
            true_cfg_scale=true_cfg,
            max_sequence_length=16,
            num_frames=5 if family == "wan" else 1,
        ),
        sde=SdeConfig(noise_level=0.7, window_size=2, window_range=[0, 5]),
    )
    # a run that reuses the log-probs (the sampler then runs its window as the trainer will)
    rollout = TrajectorySampler(adapter, cfg, progress=False, log_probs_reused=True).sample(
        ["a red circle", "a blue square"], seed=0, step=0
    )
    assert rollout.samples.window_latents.dtype == torch.float32
    for j in range(rollout.window_size):
        for start in (0, 4):  # the micro-batches as sampled: same inputs, same kernels
            part = rollout.select(slice(start, start + 4))
            with torch.no_grad():
                out = evaluate_step(adapter, part, j)
            assert torch.equal(out.log_prob_B, part.samples.log_probs_BW[:, j]), (family, j, start)


@pytest.mark.parametrize("rollout_micro", [4, 8])
def test_compiled_sampling_and_the_trainers_reevaluation_give_identical_log_probs(tiny_model, rollout_micro):
    """Blocks compiled with inductor: the rollout's log-probs are the trainer's first forward, bit for
    bit (so `algorithm.old_log_probs=auto` reuses them instead of recomputing)."""
    from diffrl.config.schema import ActorConfig, LoraConfig, ModelConfig
    from diffrl.train.engine import TrainEngine

    torch._dynamo.reset()
    adapter = load_model(tiny_model("sd3"), dtype="bfloat16", device="cuda")
    engine = TrainEngine(
        adapter,
        ModelConfig(dtype="bfloat16", lora=LoraConfig(rank=4, alpha=8)),
        ActorConfig(strategy="none", mini_batch_size=8, micro_batch_size=4),
        total_optim_steps=1,
    )
    with torch.no_grad():  # non-zero LoRA, so the adapters take part in both graphs
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    adapter.compile_blocks()
    cfg = RolloutConfig(
        n=4,
        micro_batch_size=rollout_micro,
        pipeline=PipelineConfig(
            height=64, width=64, num_inference_steps=6, guidance_scale=4.5, max_sequence_length=16
        ),
        sde=SdeConfig(noise_level=0.7, window_size=2, window_range=[0, 5]),
    )
    # a run that reuses the log-probs (the sampler then runs its window as the trainer will)
    rollout = TrajectorySampler(adapter, cfg, progress=False, log_probs_reused=True).sample(
        ["a red circle", "a blue square"], seed=0, step=0
    )
    for start in (0, 4):  # the trainer's micro-batches of 4, grad on, as in TrainEngine._step_loss
        part = rollout.select(slice(start, start + 4))
        for j in range(rollout.window_size):
            out = evaluate_step(adapter, part, j)
            assert out.log_prob_B.requires_grad
            assert torch.equal(out.log_prob_B.detach(), part.samples.log_probs_BW[:, j]), (start, j)
    assert engine.optim_steps == 0
