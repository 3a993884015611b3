import pytest
import torch

from diffrl.config.schema import PipelineConfig, RolloutConfig, SdeConfig, ValidationConfig
from diffrl.models import load_model
from diffrl.rollout import TrajectorySampler
from diffrl.seeding import GROUP_NOISE_STREAM, NOISE_STREAM, generator
from diffrl.transition import evaluate_step

PROMPTS = ["a red circle above a blue square", "two green triangles", "one yellow square"]


def rollout_cfg(**sde) -> RolloutConfig:
    return RolloutConfig(
        n=4,
        micro_batch_size=3,
        pipeline=PipelineConfig(
            height=32, width=32, num_inference_steps=6, guidance_scale=4.5, max_sequence_length=16
        ),
        sde=SdeConfig(**{"type": "sde", "noise_level": 0.7, "window_size": 2, "window_range": [0, 5], **sde}),
        val=ValidationConfig(n=1, seed=3),
    )


@pytest.fixture(scope="module")
def sd3(tiny_model):
    return load_model(tiny_model("sd3"), dtype="float32")


# (family, sampler pipeline settings, the same settings as diffusers pipeline kwargs)
FAMILIES = [
    ("sd3", dict(guidance_scale=4.5), dict(guidance_scale=4.5, max_sequence_length=16)),
    (
        "flux",
        dict(guidance_scale=3.5, true_cfg_scale=4.0),
        dict(guidance_scale=3.5, true_cfg_scale=4.0, negative_prompt=["", ""], max_sequence_length=16),
    ),
    (
        "qwen_image",
        dict(guidance_scale=1.0, true_cfg_scale=4.0),
        dict(true_cfg_scale=4.0, negative_prompt=["", ""], max_sequence_length=16),
    ),
    (
        "wan",
        dict(guidance_scale=4.0, num_frames=5),
        dict(guidance_scale=4.0, num_frames=5, negative_prompt=["", ""], max_sequence_length=16),
    ),
]


@pytest.mark.parametrize(("family", "ours", "theirs"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_validation_rollout_matches_the_diffusers_pipeline(tiny_model, family, ours, theirs):
    adapter = load_model(tiny_model(family), dtype="float32")
    cfg = rollout_cfg()
    for key, value in ours.items():
        setattr(cfg.pipeline, key, value)
    rollout = TrajectorySampler(adapter, cfg, progress=False).sample_validation(PROMPTS[:2])
    # The pipeline gets the same initial noise: sample i of a validation rollout is keyed (val.seed, 0, i).
    gens = [generator("cpu", NOISE_STREAM, cfg.val.seed, 0, i) for i in range(2)]
    noise = adapter.init_noise(gens, 32, 32, cfg.pipeline.num_frames)
    out = adapter.pipe(
        prompt=PROMPTS[:2],
        latents=noise,
        num_inference_steps=6,
        height=32,
        width=32,
        output_type="latent",
        **theirs,
    )
    expected = out.frames if adapter.is_video else out.images
    torch.testing.assert_close(rollout.samples.final_latents, expected, rtol=1e-4, atol=1e-5)
    assert rollout.window_size == 0 and rollout.settings.sde_type == "ode"
    frames = (cfg.pipeline.num_frames,) if adapter.is_video else ()
    assert rollout.samples.pixels.dtype == torch.uint8
    assert rollout.samples.pixels.shape == (2, *frames, 3, 32, 32)


@pytest.mark.parametrize("kind", ["sde", "cps", "dance_sde"])
def test_reevaluating_stored_trajectories_reproduces_the_sampled_log_probs(sd3, kind):
    sampler = TrajectorySampler(sd3, rollout_cfg(type=kind), progress=False)
    rollout = sampler.sample(PROMPTS, seed=1, step=4)
    assert len(rollout) == 12 and rollout.window_size == 2
    for j in range(rollout.window_size):
        with torch.no_grad():
            out = evaluate_step(sd3, rollout, j)  # one batch of 12, sampled as micro-batches of 3
        torch.testing.assert_close(out.log_prob_B, rollout.samples.log_probs_BW[:, j], rtol=0, atol=1e-5)
        torch.testing.assert_close(out.mean, rollout.samples.means[:, j], rtol=1e-5, atol=1e-6)
        # the same micro-batch as sampled reproduces it exactly: same inputs, same function
        first = evaluate_step(sd3, rollout.select(slice(0, 3)), j)
        assert torch.equal(first.log_prob_B.detach(), rollout.samples.log_probs_BW[:3, j])


def test_rollout_is_independent_of_micro_batch_size(sd3):
    results = []
    for micro in (1, 3, 8):
        cfg = rollout_cfg()
        cfg.micro_batch_size = micro
        results.append(TrajectorySampler(sd3, cfg, progress=False).sample(PROMPTS, seed=7, step=2))
    first = results[0].samples
    for other in results[1:]:
        # Same noise and the same math: what remains is the float rounding of batched matmuls,
        # whose reduction order depends on the batch size (a wrong seed would differ by O(1)).
        torch.testing.assert_close(other.samples.window_latents, first.window_latents, rtol=0, atol=2e-5)
        torch.testing.assert_close(other.samples.log_probs_BW, first.log_probs_BW, rtol=0, atol=1e-4)
        assert torch.equal(other.samples.pixels, first.pixels) or (
            (other.samples.pixels.int() - first.pixels.int()).abs().max() <= 1
        )
        assert torch.equal(other.step_indices, results[0].step_indices)


def test_same_seed_and_step_is_reproducible_and_the_step_changes_noise_and_window(sd3):
    sampler = TrajectorySampler(sd3, rollout_cfg(), progress=False)
    a = sampler.sample(PROMPTS[:1], seed=0, step=0)
    b = sampler.sample(PROMPTS[:1], seed=0, step=0)
    assert torch.equal(a.samples.window_latents, b.samples.window_latents)
    # samples of a group differ (own noise) but share the window
    assert not torch.equal(a.samples.final_latents[0], a.samples.final_latents[1])
    windows = {tuple(sampler.sample(PROMPTS[:1], seed=0, step=s).step_indices.tolist()) for s in range(8)}
    assert len(windows) > 1 and all(len(w) == 2 and w[0] in range(4) for w in windows)
    c = sampler.sample(PROMPTS[:1], seed=0, step=1)
    assert not torch.equal(a.samples.final_latents, c.samples.final_latents)


def test_steps_outside_the_window_are_ode(sd3):
    # With the window at the very end, x_{k0} must equal the deterministic ODE trajectory's x_{k0}.
    cfg = rollout_cfg(window_size=1, window_range=[5, 6])
    rollout = TrajectorySampler(sd3, cfg, progress=False).sample(PROMPTS[:1], seed=2, step=0)
    assert rollout.step_indices.tolist() == [5]
    x = sd3.init_noise([generator("cpu", NOISE_STREAM, 2, 0, i) for i in range(4)], 32, 32)
    schedule = sd3.schedule(6, 32, 32)
    cond = rollout.sample_cond()
    with torch.no_grad():
        for k in range(5):
            v = sd3.velocity(x, schedule.timesteps[k].expand(4), cond, 4.5, 32, 32)
            x = x + v * (schedule.sigmas[k + 1] - schedule.sigmas[k])
    torch.testing.assert_close(rollout.samples.window_latents[:, 0], x, rtol=1e-5, atol=1e-6)


def test_each_unique_prompt_is_encoded_once(sd3, monkeypatch):
    encoded = []
    original = sd3.encode_prompts

    def spy(prompts, negative_prompts, max_sequence_length):
        encoded.extend(prompts)
        return original(prompts, negative_prompts, max_sequence_length)

    monkeypatch.setattr(sd3, "encode_prompts", spy)
    sampler = TrajectorySampler(sd3, rollout_cfg(), progress=False)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    rollout = sampler.sample(prompts, seed=0, step=0, uids=["a", "b", "c"])
    assert sorted(encoded) == sorted(set(prompts))  # 2 encodes for 3 prompts × 4 samples
    # rows of the duplicated prompt carry identical embeddings; uids stay per prompt
    assert torch.equal(rollout.prompt_embeds.embeds[0], rollout.prompt_embeds.embeds[2])
    assert rollout.sample_uids() == ["a"] * 4 + ["b"] * 4 + ["c"] * 4


def test_micro_batches_are_handed_over_as_soon_as_decoded(sd3):
    seen = []
    rollout = TrajectorySampler(sd3, rollout_cfg(), progress=False).sample(
        PROMPTS[:2], seed=0, step=0, on_decoded=lambda chunk: seen.append(chunk.sample_index_B.tolist())
    )
    assert seen == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert len(rollout) == 8


def test_mismatched_uids_are_an_error(sd3):
    with pytest.raises(ValueError, match="got 2 prompts but 1 uids"):
        TrajectorySampler(sd3, rollout_cfg(), progress=False).sample(PROMPTS[:2], seed=0, step=0, uids=["x"])


def test_same_group_noise_shares_the_initial_noise_within_a_group_only(sd3):
    """DanceGRPO: every sample of a prompt group starts from the group's noise (its own stream,
    keyed by the global group index), SDE noise still differs; validation is unaffected."""
    cfg = rollout_cfg(window_range=[0, 2])  # the window starts at step 0: window_latents[:, 0] is x_T
    cfg.same_group_noise = True
    sampler = TrajectorySampler(sd3, cfg, progress=False)
    rollout = sampler.sample(PROMPTS[:2], seed=5, step=1, sample_offset=8)  # groups 2 and 3 globally
    x_T = rollout.samples.window_latents[:, 0]
    for group in range(2):
        rows = x_T[group * 4 : (group + 1) * 4]
        assert torch.equal(rows, rows[:1].expand_as(rows))
        shared = sd3.init_noise([generator("cpu", GROUP_NOISE_STREAM, 5, 1, 2 + group)], 32, 32)
        assert torch.equal(rows[0], shared[0])
    assert not torch.equal(x_T[0], x_T[4])
    after = rollout.samples.window_latents[:4, 1]
    assert all(not torch.equal(after[0], after[i]) for i in range(1, 4))  # the SDE noise differs
    cfg.val.n = 2
    val = sampler.sample_validation(PROMPTS[:1]).samples.final_latents
    assert not torch.equal(val[0], val[1])  # validation samples of a prompt stay independent
