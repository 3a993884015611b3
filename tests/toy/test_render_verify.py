"""Shapes-world renderer and verifier, each checked against independent reference code, then the
verifier against the renderer: accept correct renderings, reject corrupted ones, survive blur/noise."""

from collections import deque

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from diffrl.seeding import derive_seed
from diffrl.toy.grammar import PALETTE, ObjectSpec, Scene, all_scenes, parse_prompt, relation_holds
from diffrl.toy.render import corrupt, render, render_batch
from diffrl.toy.verify import classify_pixels, label_components, verify, verify_batch

SCENES = all_scenes()


def _random_scenes(n: int, seed: int) -> list[Scene]:
    rng = np.random.default_rng(seed)
    return [SCENES[i] for i in rng.integers(0, len(SCENES), n)]


def _flood_components(image_HW3: np.ndarray) -> list[tuple[tuple[int, ...], int, tuple[int, int, int, int]]]:
    """Reference: (rgb, area, box) of 8-connected regions of exactly one palette colour, by BFS.

    Rendered objects have a flat interior of their exact palette colour (edges are anti-aliased),
    so this counts objects without any of the verifier's code.
    """
    height, width, _ = image_HW3.shape
    colours = {tuple(int(v) for v in rgb) for rgb in PALETTE.values()}
    seen = np.zeros((height, width), dtype=bool)
    found = []
    for y in range(height):
        for x in range(width):
            rgb = tuple(int(v) for v in image_HW3[y, x])
            if seen[y, x] or rgb not in colours:
                continue
            queue, pixels = deque([(y, x)]), []
            seen[y, x] = True
            while queue:
                cy, cx = queue.popleft()
                pixels.append((cy, cx))
                for ny in range(cy - 1, cy + 2):
                    for nx in range(cx - 1, cx + 2):
                        inside = 0 <= ny < height and 0 <= nx < width
                        if inside and not seen[ny, nx] and tuple(int(v) for v in image_HW3[ny, nx]) == rgb:
                            seen[ny, nx] = True
                            queue.append((ny, nx))
            ys, xs = zip(*pixels, strict=True)
            found.append((rgb, len(pixels), (min(xs), min(ys), max(xs) + 1, max(ys) + 1)))
    return found


def _degrade(image: np.ndarray, rng: np.random.Generator, blur: float, noise: float) -> np.ndarray:
    if blur:
        image = np.asarray(Image.fromarray(image).filter(ImageFilter.GaussianBlur(blur)))
    return np.clip(image + rng.normal(0.0, noise, image.shape), 0, 255).astype(np.uint8)


# ------------------------------------------------------------------------------------ renderer
@pytest.mark.parametrize("size", [32, 64])
def test_render_draws_the_scene_objects_flat_on_white(size):
    rng = np.random.default_rng(0)
    for scene in _random_scenes(40, seed=size):
        image = render(scene, size, rng)
        assert image.shape == (size, size, 3) and image.dtype == np.uint8
        assert (image == 255).all(axis=-1).mean() > 0.5  # mostly white background
        objects = _flood_components(image)
        assert len(objects) == scene.n_objects, scene.to_prompt()
        for spec in scene.objects:
            if spec.color is not None:
                assert sum(rgb == PALETTE[spec.color] for rgb, _, _ in objects) == spec.count
        for _, _, (x0, y0, x1, y1) in objects:
            # Box side 18-30% of the side (>= 8 px), the interior 1-2 px less after anti-aliasing.
            lo, hi = max(0.18 * size, 8.0) * 0.9**2 - 2, 0.30 * size + 1
            assert lo <= x1 - x0 <= hi and lo <= y1 - y0 <= hi, (x0, y0, x1, y1)


def test_render_relations_hold_with_a_margin():
    rng = np.random.default_rng(1)
    for scene in [s for s in SCENES if s.relation][:24]:
        for _ in range(3):
            image = render(scene, 64, rng)
            objects = _flood_components(image)
            assert len(objects) == 2
            (ax, ay), (bx, by) = [((x0 + x1) / 2, (y0 + y1) / 2) for _, _, (x0, y0, x1, y1) in objects]
            along = abs(ax - bx) if scene.relation in ("left of", "right of") else abs(ay - by)
            across = abs(ay - by) if scene.relation in ("left of", "right of") else abs(ax - bx)
            assert along > 10 and along > across, scene.to_prompt()


def test_render_is_deterministic_and_render_batch_is_per_sample():
    scenes = _random_scenes(6, seed=3)
    a = render(scenes[0], 64, np.random.default_rng(7))
    assert np.array_equal(a, render(scenes[0], 64, np.random.default_rng(7)))
    assert not np.array_equal(a, render(scenes[0], 64, np.random.default_rng(8)))
    batch = render_batch(scenes, 64, seed=11)
    assert batch.shape == (6, 3, 64, 64) and batch.dtype == torch.uint8
    for i, scene in enumerate(scenes):
        expected = render(scene, 64, np.random.default_rng(derive_seed(11, i)))
        assert torch.equal(batch[i], torch.from_numpy(expected).permute(2, 0, 1))
    assert torch.equal(render_batch(scenes[:3], 64, seed=11), batch[:3])  # independent of batch size


def test_render_rejects_bad_arguments():
    scene = parse_prompt("a red circle")
    with pytest.raises(ValueError, match=r"generator=numpy\.random\.Generator"):
        render(scene, 64)
    with pytest.raises(ValueError, match="size=16 is invalid"):
        render(scene, 16, np.random.default_rng(0))
    with pytest.raises(ValueError, match="needs a Scene"):
        render("a red circle", 64, np.random.default_rng(0))


def test_corrupt_always_changes_the_scene_and_every_kind_occurs():
    rng = np.random.default_rng(0)
    categories_seen = set()
    for scene in SCENES:
        for _ in range(4):
            bad = corrupt(scene, rng)
            assert isinstance(bad, Scene) and bad != scene
            assert bad.to_prompt() != scene.to_prompt()
            assert parse_prompt(bad.to_prompt()) == bad  # still inside the grammar
            categories_seen.add(bad.category)
    assert categories_seen == {s.category for s in SCENES}
    # color_attr: the swapped-binding negative is among the corruptions.
    scene = parse_prompt("a red circle and a blue square")
    negatives = {corrupt(scene, np.random.default_rng(i)).to_prompt() for i in range(200)}
    assert "a blue circle and a red square" in negatives
    assert "a red circle" in negatives and "a blue square" in negatives


# ------------------------------------------------------------------------------------ verifier
def test_components_match_a_breadth_first_reference():
    rng = np.random.default_rng(0)
    labels_BHW = torch.from_numpy(rng.choice([-1, -1, 0, 1, 2], size=(3, 20, 24))).long()
    comp_BHW = label_components(labels_BHW)
    for b in range(3):
        lab = labels_BHW[b].numpy()
        comp = comp_BHW[b].numpy()
        seen = np.zeros_like(lab, dtype=bool)
        for y, x in zip(*np.nonzero(lab >= 0), strict=True):
            if seen[y, x]:
                continue
            queue, members = deque([(y, x)]), []
            seen[y, x] = True
            while queue:
                cy, cx = queue.popleft()
                members.append(cy * 24 + cx)
                for ny in range(max(cy - 1, 0), min(cy + 2, 20)):
                    for nx in range(max(cx - 1, 0), min(cx + 2, 24)):
                        if not seen[ny, nx] and lab[ny, nx] == lab[y, x]:
                            seen[ny, nx] = True
                            queue.append((ny, nx))
            ids = {int(comp.flat[i]) for i in members}
            assert ids == {min(members)}  # one label per component: its smallest flat index
        assert (comp[lab < 0] == -1).all()


def test_pixel_classes_handle_anti_aliased_edges():
    blue = np.array(PALETTE["blue"], dtype=np.float64)
    # A 45% blue edge pixel: of the palette colours, purple is its nearest.
    pale = np.round(0.45 * blue + 0.55 * 255).astype(np.uint8)
    mostly = np.round(0.7 * blue + 0.3 * 255).astype(np.uint8)
    image = np.array([[[255, 255, 255], pale, mostly, [0, 0, 0], [128, 128, 128], [235, 235, 235]]], np.uint8)
    labels, color, coverage = classify_pixels(torch.from_numpy(image).unsqueeze(0))
    blue_index, other = list(PALETTE).index("blue"), len(PALETTE)
    assert labels[0, 0].tolist() == [-1, -1, blue_index, other, other, -1]
    assert color[0, 0, 1] == blue_index  # the pale edge is blue's (its fringe), never purple
    assert coverage[0, 0, 2].item() == pytest.approx(0.7, abs=0.02)


def test_verify_accepts_numpy_and_tensor_alike_and_scores_partially():
    rng = np.random.default_rng(4)
    scene = parse_prompt("a red circle")
    image = render(scene, 64, rng)
    ok = verify(image, scene)
    assert ok.correct and ok.score == 1.0
    assert verify(torch.from_numpy(image).permute(2, 0, 1), scene) == ok
    [found] = ok.detail["objects"]
    assert (found.shape, found.color) == ("circle", "red")
    # The same image asked for a blue circle: count and "no extra" hold, the colour does not.
    blue = verify(image, parse_prompt("a blue circle"))
    assert not blue.correct and blue.score == pytest.approx(2 / 3)
    assert blue.detail["checks"] == {"count:circle": True, "color:blue circle": False, "no_extra": True}
    # A blank image holds nothing: "a circle" fails both its checks.
    blank = verify(np.full((64, 64, 3), 255, np.uint8), parse_prompt("a circle"))
    assert blank.score == 0.0 and blank.detail["objects"] == []


def test_other_ink_counts_as_an_extra_object():
    image = np.full((64, 64, 3), 255, np.uint8)
    yy, xx = np.mgrid[:64, :64]
    image[(yy - 20) ** 2 + (xx - 20) ** 2 <= 64] = PALETTE["red"]
    scene = parse_prompt("a red circle")
    assert verify(image, scene).correct
    image[40:52, 40:52] = (40, 40, 40)  # a dark grey blot: no palette colour
    verdict = verify(image, scene)
    assert [o.color for o in verdict.detail["objects"]] == ["red", "other"]
    assert verdict.detail["checks"] == {"count:circle": True, "color:red circle": True, "no_extra": False}


def test_verify_rejects_bad_inputs():
    scene = parse_prompt("a circle")
    with pytest.raises(ValueError, match=r"\[3, H, W\]"):
        verify(torch.zeros(64, 64, 3, dtype=torch.uint8), scene)
    with pytest.raises(ValueError, match="uint8"):
        verify(np.zeros((64, 64, 3), np.float32), scene)
    with pytest.raises(ValueError, match="needs a Scene"):
        verify(np.zeros((64, 64, 3), np.uint8), "a circle")
    with pytest.raises(ValueError, match="B = len"):
        verify_batch(torch.zeros(2, 3, 64, 64, dtype=torch.uint8), [scene])


def _rates(size: int, n: int, seed: int, blur: float = 0.0, noise: float = 0.0) -> tuple[float, float]:
    """(fraction of correct renderings accepted, fraction of corrupted renderings rejected)."""
    rng = np.random.default_rng(seed)
    scenes = _random_scenes(n, seed)
    good = [render(s, size, rng) for s in scenes]
    bad = [render(corrupt(s, rng), size, rng) for s in scenes]
    if blur or noise:
        good = [_degrade(image, rng, blur, noise) for image in good]
        bad = [_degrade(image, rng, blur, noise) for image in bad]
    to_batch = lambda images: torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2)  # noqa: E731
    accepted, _ = verify_batch(to_batch(good), scenes)
    fooled, partial = verify_batch(to_batch(bad), scenes)
    assert (partial[~fooled] < 1).all()  # a rejected image never scores full partial credit
    return accepted.float().mean().item(), 1 - fooled.float().mean().item()


@pytest.mark.parametrize("size", [32, 64])
def test_verifier_accepts_renderings_and_rejects_corruptions(size):
    accept, reject = _rates(size, n=600, seed=size)
    assert accept >= 0.99 and reject >= 0.99, (accept, reject)


@pytest.mark.parametrize("size", [32, 64])
def test_verifier_tolerates_slight_blur_and_noise(size):
    accept, reject = _rates(size, n=300, seed=100 + size, blur=0.7, noise=8.0)
    assert accept >= 0.95 and reject >= 0.95, (accept, reject)


def test_verifier_uses_the_pixels_not_the_layout():
    # Hand-drawn images the renderer never made: a relation the other way round, a wrong count.
    image = np.full((64, 64, 3), 255, np.uint8)
    image[30:44, 40:54] = PALETTE["green"]  # a square on the right
    yy, xx = np.mgrid[:64, :64]
    image[(yy - 37) ** 2 + (xx - 14) ** 2 <= 49] = PALETTE["red"]  # a circle (r = 7) on the left
    assert verify(image, parse_prompt("a circle left of a square")).correct
    flipped = verify(image, parse_prompt("a circle right of a square"))
    assert not flipped.correct and flipped.detail["checks"] == {
        "count:circle": True,
        "count:square": True,
        "no_extra": True,
        "relation": False,
    }
    assert verify(image, parse_prompt("a red circle and a green square")).correct
    assert not verify(image, parse_prompt("two circles")).correct
    found = {o.shape: o.box for o in verify(image, parse_prompt("a circle")).detail["objects"]}
    assert relation_holds("left of", found["circle"], found["square"])
    assert Scene("counting", (ObjectSpec("circle", None, 2),)).n_objects == 2
