"""Video end to end on CPU: the tiny Wan preset trains two steps with `diffrl train`, scores 3 of each
video's 5 frames, and each validation writes every sample as a GIF a person can open, with an index."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence

from diffrl.cli import main
from diffrl.config import load_config
from diffrl.models import load_model
from diffrl.rewards import build_reward
from diffrl.rollout.sampler import TrajectorySampler
from diffrl.telemetry import read_metrics
from diffrl.telemetry.images import save_gif
from diffrl.telemetry.validation_samples import prompt_slug, validation_videos


def gif_frames(path) -> np.ndarray:
    """[T, 3, H, W] uint8: the GIF's frames as Pillow composes them."""
    with Image.open(path) as image:
        frames = [np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(image)]
    return np.stack(frames).transpose(0, 3, 1, 2)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DIFFRL_CACHE", str(out / "cache"))
        code = main(["train", "tiny_wan_video", f"trainer.output_dir={out}", "trainer.run_name=video"])
    assert code == 0
    return out / "video"


def test_tiny_wan_trains_two_steps(run_dir):
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert set(metrics) == {0, 1, 2}
    for step in (1, 2):
        for key in ("rewards/mean", "actor/loss", "actor/grad_norm", "rewards/jpeg_compressibility/mean"):
            assert math.isfinite(metrics[step][key]), (step, key)
    assert "val/rewards/mean" in metrics[0] and "val/rewards/mean" in metrics[2]
    assert (run_dir / "export" / "pytorch_lora_weights.safetensors").is_file()


def test_validation_writes_one_gif_per_sample_with_an_index(run_dir):
    cfg = load_config(str(run_dir / "config.yaml"))
    for step in (0, 2):
        rows = [json.loads(line) for line in (run_dir / "validation" / f"step_{step:06d}.jsonl").open()]
        assert len(rows) == 8  # the 8 prompts of simple_prompts.txt, one sample each
        page = (run_dir / "validation" / f"step_{step:06d}" / "index.html").read_text()
        for row in rows:
            path = run_dir / "validation" / row["video"]
            assert path.name == f"{row['index']:03d}_{prompt_slug(row['prompt'])}.gif"
            with Image.open(path) as image:
                assert image.format == "GIF" and image.n_frames == cfg.rollout.pipeline.num_frames
                assert image.size == (cfg.rollout.pipeline.width, cfg.rollout.pipeline.height)
            assert path.name in page and row["prompt"] in page and f"{row['reward']:.4f}" in page
        assert (run_dir / "validation" / f"step_{step:06d}.png").is_file()  # the grid of first frames


def test_validation_gifs_are_the_decoded_videos_and_rewards_use_three_frames(run_dir, monkeypatch):
    """Step 0 validates the untrained LoRA (B = 0, the base model): re-sampling its prompts with
    the validation seed outside the run must give the same uint8 videos the GIFs hold (16x16
    frames have at most 256 colours, so GIF's palette loses nothing), and each sample's reward must
    be the JPEG reward of frames 0, 2, 4 of its video, averaged."""
    cfg = load_config(str(run_dir / "config.yaml"))
    rows = [json.loads(line) for line in (run_dir / "validation" / "step_000000.jsonl").open()]
    monkeypatch.setenv("DIFFRL_CACHE", str(run_dir.parent / "cache"))  # the run's tiny:wan
    adapter = load_model(cfg.model.path, dtype=cfg.model.dtype, device="cpu")
    videos = (
        TrajectorySampler(adapter, cfg.rollout).sample_validation([r["prompt"] for r in rows]).samples.pixels
    )
    assert videos.shape == (8, 5, 3, 16, 16)
    for row, video in zip(rows, videos, strict=True):
        np.testing.assert_array_equal(gif_frames(run_dir / "validation" / row["video"]), video.numpy())
    jpeg = build_reward("jpeg_compressibility")
    prompts = [r["prompt"] for r in rows]
    on_frames = torch.stack([jpeg(videos[:, t], prompts, None).scores_B for t in (0, 2, 4)]).mean(dim=0)
    torch.testing.assert_close(torch.tensor([r["reward"] for r in rows]), on_frames, rtol=1e-5, atol=1e-6)


def test_gif_round_trip_and_index(tmp_path):
    generator = torch.Generator().manual_seed(0)
    videos = torch.randint(0, 256, (2, 6, 3, 16, 16), dtype=torch.uint8, generator=generator)
    rows = [
        {"index": 0, "prompt": "A cat <jumps> & lands!", "data_source": "d", "reward": 0.25},
        {"index": 1, "prompt": "   ", "data_source": "d", "reward": -1.0},
    ]
    paths = validation_videos(videos, rows, tmp_path / "step_000007", fps=16)
    assert [p.name for p in paths] == ["000_a-cat-jumps-lands.gif", "001_prompt.gif"]
    assert rows[0]["video"] == "step_000007/000_a-cat-jumps-lands.gif"
    for path, video in zip(paths, videos, strict=True):
        np.testing.assert_array_equal(gif_frames(path), video.numpy())  # 256 pixels: lossless palette
        with Image.open(path) as image:
            assert image.info["duration"] == 60 and image.info["loop"] == 0  # 16 fps in centiseconds
    page = (tmp_path / "step_000007" / "index.html").read_text()
    assert "A cat &lt;jumps&gt; &amp; lands!" in page and "<jumps>" not in page


def test_save_gif_rejects_what_is_not_a_video(tmp_path):
    with pytest.raises(ValueError, match=r"\(T, 3, H, W\)"):
        save_gif(tmp_path / "x.gif", torch.zeros(3, 8, 8, dtype=torch.uint8), fps=16)
    with pytest.raises(ValueError, match="uint8"):
        save_gif(tmp_path / "x.gif", torch.zeros(2, 3, 8, 8), fps=16)


def one_gif(folder) -> Path:
    videos = torch.randint(0, 256, (1, 4, 3, 16, 16), dtype=torch.uint8)
    rows = [{"index": 0, "prompt": "a kite", "data_source": "d", "reward": 0.5}]
    return validation_videos(videos, rows, folder / "validation" / "step_000001")[0]


def test_run_logger_names_missing_video_files(tmp_path):
    from diffrl.telemetry import RunLogger

    gif = one_gif(tmp_path)
    with RunLogger(
        tmp_path / "plain", ["jsonl", "tensorboard"], total_steps=2, config={}, run_name="t"
    ) as logger:
        logger.log_videos(1, "val/videos", [(gif, "a kite")])  # no sink here shows videos
        with pytest.raises(FileNotFoundError, match=r"nope\.gif"):
            logger.log_videos(1, "val/videos", [(tmp_path / "nope.gif", "x")])


def test_run_logger_sends_gifs_to_wandb(tmp_path, monkeypatch):
    from diffrl.telemetry import RunLogger

    pytest.importorskip("wandb")
    gif = one_gif(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with RunLogger(tmp_path / "wb", ["wandb"], total_steps=2, config={}, run_name="t") as logger:
        logger.log_videos(1, "val/videos", [(gif, "a kite (reward 0.500)")])
        run_dir = Path(logger.sinks[0].run.dir)
    # wandb copies the GIF, byte for byte, into the run's media
    copies = list(run_dir.rglob("*.gif"))
    assert copies and copies[0].read_bytes() == gif.read_bytes()


def test_the_480p_video_preset_runs_a_step_at_a_tiny_size(tmp_path, monkeypatch):
    """wan21_t2v_1_3b_video's own settings (its prompt files, gradient checkpointing, one colocated
    worker, 4 of each video's frames scored) for one step, with the tiny Wan and the offline JPEG
    reward in place of the real model and CLIP."""
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    overrides = [
        "model.path=tiny:wan",
        "model.dtype=float32",
        "rollout.pipeline.height=16",
        "rollout.pipeline.width=16",
        "rollout.pipeline.num_frames=5",
        "rollout.pipeline.num_inference_steps=4",
        "rollout.pipeline.max_sequence_length=16",
        "rollout.sde.window_range=[0,3]",
        "reward.functions=!replace {jpeg_compressibility: {video_frames: 4}}",
        "trainer.total_steps=1",
        "trainer.save_freq=0",
        "trainer.test_freq=1",
        "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=p480",
    ]
    assert main(["train", "wan21_t2v_1_3b_video", *overrides]) == 0
    metrics = read_metrics(tmp_path / "p480" / "metrics.jsonl")
    assert math.isfinite(metrics[1]["actor/loss"]) and math.isfinite(metrics[1]["val/rewards/mean"])
    gifs = sorted((tmp_path / "p480" / "validation" / "step_000001").glob("*.gif"))
    assert len(gifs) == 4  # one per prompt of video_prompts_val.txt
