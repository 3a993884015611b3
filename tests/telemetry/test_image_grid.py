import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.telemetry import image_grid, save_png


def distinct_images(count, height, width):
    """(B, 3, H, W) uint8; every pixel of every image and channel differs (orientation is checkable)."""
    values = torch.arange(count * 3 * height * width) % 251
    return values.reshape(count, 3, height, width).to(torch.uint8)


def test_tile_positions_padding_and_empty_slots():
    images = distinct_images(5, 4, 3)
    grid = image_grid(images, nrow=2, padding=1, pad_value=7)
    # 2 columns, 3 rows: H = 1 + 3·(4 + 1), W = 1 + 2·(3 + 1)
    assert grid.shape == (16, 9, 3) and grid.dtype == np.uint8
    covered = np.zeros(grid.shape[:2], bool)
    for i in range(5):
        y, x = 1 + (i // 2) * 5, 1 + (i % 2) * 4
        np.testing.assert_array_equal(grid[y : y + 4, x : x + 3], images[i].permute(1, 2, 0).numpy())
        covered[y : y + 4, x : x + 3] = True
    assert (grid[~covered] == 7).all()  # borders, gaps and the empty sixth slot


def test_fewer_images_than_nrow_and_gray_and_alpha_inputs():
    gray = np.full((2, 1, 2, 2), 200, np.uint8)
    grid = image_grid(gray, nrow=8, padding=0)
    assert grid.shape == (2, 4, 3) and (grid == 200).all()
    rgba = np.zeros((1, 4, 2, 2), np.uint8)
    rgba[:, 3] = 255  # alpha is dropped
    assert (image_grid(rgba, padding=0) == 0).all()


def test_video_first_frame_and_frame_strip():
    # (B=2, T=4, C=3, H=2, W=3): frame t of video b is filled with 10·b + t
    videos = np.zeros((2, 4, 3, 2, 3), np.uint8)
    for b in range(2):
        for t in range(4):
            videos[b, t] = 10 * b + t
    first = image_grid(videos, nrow=2, padding=0)
    assert first.shape == (2, 6, 3)
    assert (first[:, :3] == 0).all() and (first[:, 3:] == 10).all()
    strip = image_grid(videos, nrow=1, padding=1, pad_value=255, frames="strip", max_frames=2)
    # each tile: frames 0 and 3 side by side (W = 2·3); tiles stacked in one column
    assert strip.shape == (1 + 2 * (2 + 1), 1 + 6 + 1, 3)
    for b in range(2):
        y = 1 + b * 3
        assert (strip[y : y + 2, 1:4] == 10 * b + 0).all()
        assert (strip[y : y + 2, 4:7] == 10 * b + 3).all()


def test_captions_sit_under_their_tiles():
    images = torch.zeros(3, 3, 8, 40, dtype=torch.uint8)  # black tiles
    captions = ["a red circle", "two blue squares left of a green triangle, very long caption", "x"]
    plain = image_grid(images, nrow=3, padding=2, pad_value=128)
    grid = image_grid(images, nrow=3, captions=captions, padding=2, pad_value=128)
    caption_h = grid.shape[0] - plain.shape[0]
    assert caption_h > 0 and grid.shape[1] == plain.shape[1]
    for i in range(3):
        x = 2 + i * (40 + 2)
        assert (grid[2:10, x : x + 40] == 0).all()  # tile unchanged, same place
        strip = grid[10 : 10 + caption_h, x : x + 40]
        assert (strip.max(axis=2) == 255).mean() > 0.5  # white background
        assert (strip.max(axis=2) < 128).any()  # dark text drawn
    assert (grid[10 : 10 + caption_h, 0:2] == 128).all()  # the padding stays padding
    with pytest.raises(ValueError, match="2 captions for 3 images"):
        image_grid(images, captions=captions[:2])


def test_bad_inputs():
    with pytest.raises(ValueError, match="uint8"):
        image_grid(torch.zeros(1, 3, 2, 2))
    with pytest.raises(ValueError, match="shape"):
        image_grid(torch.zeros(3, 2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="at least one"):
        image_grid(torch.zeros(0, 3, 2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="channels"):
        image_grid(torch.zeros(1, 2, 2, 2, dtype=torch.uint8))


def test_save_png_round_trip(tmp_path):
    image = image_grid(distinct_images(3, 5, 7), nrow=2)
    path = save_png(tmp_path / "validation" / "step_000010.png", image)
    np.testing.assert_array_equal(np.asarray(Image.open(path)), image)
    assert [p.name for p in path.parent.iterdir()] == ["step_000010.png"]  # no temp file left


def test_scale_repeats_pixels_and_a_newline_starts_a_caption_line():
    images = np.arange(2 * 3 * 4 * 4, dtype=np.uint8).reshape(2, 3, 4, 4)
    grid = image_grid(images, nrow=2, scale=3, padding=1)
    tile = images[1].transpose(1, 2, 0)
    expected = np.kron(tile, np.ones((3, 3, 1), dtype=np.uint8))  # every pixel a 3×3 block
    np.testing.assert_array_equal(grid[1:13, 14:26], expected)
    one = image_grid(images[:1], captions=["pass"], scale=8, caption_lines=2)
    two = image_grid(images[:1], captions=["x\npass"], scale=8, caption_lines=2)
    assert one.shape == two.shape
    strip = 2 + 32  # caption strip starts under the 32-pixel tile
    line2 = slice(strip + (two.shape[0] - strip - 2) // 2, two.shape[0] - 2)
    inside = slice(2, 2 + 32)  # the strip's columns, without the black border
    assert (two[line2, inside] < 128).any() and not (one[line2, inside] < 128).any()  # "pass" on line 2
    with pytest.raises(ValueError, match="scale"):
        image_grid(images, scale=0)
