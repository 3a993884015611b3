import torch

from diffrl.config.schema import PipelineConfig, RolloutConfig, SdeConfig
from diffrl.models import load_model
from diffrl.rollout import TrajectorySampler
from diffrl.transition import concat_rollouts, evaluate_step


def test_joining_workers_rollouts_with_different_text_lengths_keeps_every_samples_math(tiny_model):
    # Qwen-Image pads text per encode call (to a multiple of 32 tokens): two workers' prompt
    # tables differ in length when their longest prompts fall in different buckets.
    adapter = load_model(tiny_model("qwen_image"), dtype="float32")
    cfg = RolloutConfig(
        n=2,
        micro_batch_size=2,
        pipeline=PipelineConfig(
            height=32,
            width=32,
            num_inference_steps=3,
            guidance_scale=1.0,
            true_cfg_scale=4.0,
            max_sequence_length=96,
        ),
        sde=SdeConfig(noise_level=0.7, window_size=1, window_range=[0, 2]),
    )
    sampler = TrajectorySampler(adapter, cfg, progress=False)
    short = sampler.sample(["a cat"], seed=0, step=0, uids=["a"], sample_offset=0)
    long = sampler.sample(
        ["a red circle left of a blue square above a green triangle, " * 4],
        seed=0,
        step=0,
        uids=["b"],
        sample_offset=2,
    )
    assert short.prompt_embeds.embeds.shape[1] != long.prompt_embeds.embeds.shape[1]
    joined = concat_rollouts([short, long])
    assert joined.sample_uids() == ["a", "a", "b", "b"]
    with torch.no_grad():
        out = evaluate_step(adapter, joined, 0)
    expected = torch.cat([short.samples.log_probs_BW[:, 0], long.samples.log_probs_BW[:, 0]])
    torch.testing.assert_close(out.log_prob_B, expected, rtol=0, atol=1e-5)
