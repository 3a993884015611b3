"""CLIP-family rewards on a tiny random CLIP loaded from a local directory (built offline)."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import CLIPModel, CLIPProcessor

from diffrl.rewards import build_reward
from diffrl.rewards.tiny import save_tiny_aesthetic_head

PROMPTS = ["a red circle", "two blue squares", "a red circle", "a green triangle above a square"]


def _pixels(batch=4, seed=0, size=40):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, 3, size, size + 8), dtype=torch.uint8, generator=generator)


def _reference(tiny_clip, pixels, prompts):
    """Logits and image embeddings straight from transformers' CLIPModel forward (independent path)."""
    model = CLIPModel.from_pretrained(tiny_clip).eval()
    processor = CLIPProcessor.from_pretrained(tiny_clip)
    images = list(pixels.permute(0, 2, 3, 1).numpy())
    inputs = processor(text=prompts, images=images, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs)
    return out.logits_per_image.diagonal(), out.image_embeds, model.logit_scale.exp().item()


def test_clip_score_matches_transformers_and_is_deterministic(tiny_clip):
    pixels = _pixels()
    reward = build_reward("clip_score", {"model": str(tiny_clip), "device": "cpu"})
    scores = reward(pixels, PROMPTS, None).scores_B
    logits, _, scale = _reference(tiny_clip, pixels, PROMPTS)
    torch.testing.assert_close(scores, logits / scale, rtol=1e-4, atol=1e-5)
    assert scores.abs().max() <= 1.0
    again = build_reward("clip_score", {"model": str(tiny_clip), "device": "cpu"})(
        pixels, PROMPTS, None
    ).scores_B
    assert torch.equal(scores, again)


@pytest.mark.parametrize("name", ["clip_score", "pickscore", "aesthetic"])
def test_batch_of_four_equals_four_batches_of_one(tiny_clip, name):
    pixels = _pixels()
    # batch_size=3: the batch of 4 runs as chunks of 3 + 1 inside the reward.
    reward = build_reward(name, {"model": str(tiny_clip), "batch_size": 3, "device": "cpu"})
    batched = reward(pixels, PROMPTS, None).scores_B
    single = torch.cat([reward(pixels[i : i + 1], PROMPTS[i : i + 1], None).scores_B for i in range(4)])
    assert batched.shape == (4,) and batched.dtype == torch.float32
    torch.testing.assert_close(batched, single, rtol=1e-4, atol=1e-5)
    assert not torch.equal(batched[0].expand(4), batched)  # the inputs differ, so do the scores


def test_pickscore_is_logit_scale_times_cosine(tiny_clip):
    pixels = _pixels(seed=1)
    reward = build_reward("pickscore", {"model": str(tiny_clip), "device": "cpu"})
    scores = reward(pixels, PROMPTS, None).scores_B
    logits, _, _ = _reference(tiny_clip, pixels, PROMPTS)
    torch.testing.assert_close(scores, logits, rtol=1e-4, atol=1e-4)


def test_aesthetic_is_the_laion_mlp_on_normalised_image_embeddings(tiny_clip):
    pixels = _pixels(seed=2)
    reward = build_reward("aesthetic", {"model": str(tiny_clip), "device": "cpu"})
    scores = reward(pixels, PROMPTS, None).scores_B
    _, image_embeds, _ = _reference(tiny_clip, pixels, PROMPTS)
    w = load_file(str(tiny_clip / "aesthetic_head.safetensors"))
    x = image_embeds / image_embeds.norm(dim=-1, keepdim=True)
    for i in (0, 2, 4, 6, 7):  # Linear layers; dropouts (1, 3, 5) are identities in eval
        x = x @ w[f"layers.{i}.weight"].T + w[f"layers.{i}.bias"]
    torch.testing.assert_close(scores, x.squeeze(-1), rtol=1e-4, atol=1e-5)


def test_video_is_scored_per_frame_and_averaged(tiny_clip):
    reward = build_reward("clip_score", {"model": str(tiny_clip), "device": "cpu"})
    frames = _pixels(batch=6, seed=3)
    per_frame = reward(frames, ["a red circle"] * 3 + ["a blue square"] * 3, None).scores_B
    video = reward(frames.reshape(2, 3, *frames.shape[1:]), ["a red circle", "a blue square"], None).scores_B
    torch.testing.assert_close(video, per_frame.reshape(2, 3).mean(1))


def test_missing_directory_and_files_are_named(tiny_clip, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"args.model='/no/such/clip' does not exist"):
        build_reward("clip_score", {"model": "/no/such/clip"})
    broken = tmp_path / "broken"
    shutil.copytree(tiny_clip, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no CLIP weights: expected .*model.safetensors"):
        build_reward("pickscore", {"model": str(broken)})
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(tiny_clip, no_tokenizer)
    for name in ("tokenizer.json", "vocab.json"):
        (no_tokenizer / name).unlink()
    with pytest.raises(FileNotFoundError, match=r"has no CLIP tokenizer"):
        build_reward("clip_score", {"model": str(no_tokenizer)})
    # The aesthetic reward needs no tokenizer, but it needs its head.
    (no_tokenizer / "aesthetic_head.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"head weights .*aesthetic_head.safetensors are missing"):
        build_reward("aesthetic", {"model": str(no_tokenizer)})
    no_config = tmp_path / "no_config"
    shutil.copytree(tiny_clip, no_config)
    (no_config / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config.json is missing"):
        build_reward("aesthetic", {"model": str(no_config)})


def test_aesthetic_head_checks_layout_and_size(tiny_clip, tmp_path):
    wrong_dim = save_tiny_aesthetic_head(tmp_path / "head768.safetensors", embed_dim=768)
    with pytest.raises(ValueError, match=r"takes 768-d embeddings but the CLIP .* makes 16-d ones"):
        build_reward("aesthetic", {"model": str(tiny_clip), "head": str(wrong_dim)})
    save_file({"linear.weight": torch.zeros(1, 16)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match=r"expected the LAION aesthetic MLP's"):
        build_reward("aesthetic", {"model": str(tiny_clip), "head": str(tmp_path / "bad.safetensors")})


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["clip_score", "pickscore", "aesthetic"])
def test_gpu_scores_match_cpu(tiny_clip, name):
    """device=auto picks the GPU (bfloat16 there); scores agree with float32 on the CPU."""
    pixels = _pixels(batch=8, seed=4)
    prompts = PROMPTS * 2
    gpu = build_reward(name, {"model": str(tiny_clip)})
    assert gpu.encoder.device.type == "cuda" and gpu.encoder.dtype == torch.bfloat16
    cpu = build_reward(name, {"model": str(tiny_clip), "device": "cpu"})
    gpu_scores = gpu(pixels, prompts, None).scores_B
    assert gpu_scores.device.type == "cpu" and gpu_scores.dtype == torch.float32
    scale = 1.0 if name != "pickscore" else cpu.encoder.logit_scale
    torch.testing.assert_close(gpu_scores, cpu(pixels, prompts, None).scores_B, rtol=0.05, atol=0.03 * scale)
