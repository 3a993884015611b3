"""Condition images in prompt rows (image-edit models): read and checked when the prompt file loads,
each failure a ValueError (or FileNotFoundError) naming the row, the image and the fix; the family
rules (count, aspect ratio, one condition size per run) in `diffrl.models.conditions`."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from edit_images import condition_image
from PIL import Image

from diffrl.data import load_prompts
from diffrl.data.images import MAX_CONDITION_PIXELS, read_condition_image
from diffrl.models.conditions import ConditionRule, check_condition_rows, kontext_size, qwen_edit_dimensions


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_paths_are_relative_to_the_prompt_file_and_leave_the_metadata(tmp_path):
    (tmp_path / "images").mkdir()
    condition_image(1).save(tmp_path / "images" / "a.png")
    condition_image(2, 32, 32).save(tmp_path / "images" / "b.jpg")
    data = write_jsonl(
        tmp_path / "edit.jsonl",
        [
            {"prompt": "make it red", "image": "images/a.png", "score": 1},
            {"prompt": "combine them", "image": ["images/a.png", "images/b.jpg"]},
            {"prompt": "no image here"},
        ],
    )
    one, two, none = load_prompts([data], image_key="image")
    assert [(i.name, i.width, i.height) for i in one.images] == [("images/a.png", 64, 48)]
    assert one.images[0].path == str((tmp_path / "images" / "a.png").resolve())
    assert one.metadata == {"score": 1, "data_source": "edit"}  # the image is not metadata
    assert [i.name for i in two.images] == ["images/a.png", "images/b.jpg"]
    assert none.images == ()  # the family's count rule reports it (test_edit_train)
    loaded = one.images[0].load()
    assert loaded.mode == "RGB" and np.array_equal(np.asarray(loaded), np.asarray(condition_image(1)))
    # without image_key (a text-to-image model) the column is plain metadata
    (plain, *_) = load_prompts([data])
    assert plain.images == () and plain.metadata["image"] == "images/a.png"


def test_parquet_bytes_and_hugging_face_image_columns(tmp_path):
    data = png_bytes(condition_image(3))
    path = tmp_path / "edit.parquet"
    hf_image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    pq.write_table(
        pa.table(
            {
                "prompt": ["a", "b"],
                "source": pa.array([data, data], pa.binary()),
                "hf": pa.array([{"bytes": data, "path": None}, {"bytes": None, "path": "x.png"}], hf_image),
            }
        ),
        path,
    )
    condition_image(4).save(tmp_path / "x.png")
    first, second = load_prompts([path], image_key="source")
    assert first.images[0].data == data and (first.images[0].width, first.images[0].height) == (64, 48)
    assert first.images[0].key == second.images[0].key  # the same bytes: one cache key
    assert np.array_equal(np.asarray(first.images[0].load()), np.asarray(condition_image(3)))
    by_bytes, by_path = load_prompts([path], image_key="hf")
    assert by_bytes.images[0].data == data and by_path.images[0].path == str((tmp_path / "x.png").resolve())
    assert by_bytes.images[0].key != by_path.images[0].key


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (
            "missing.png",
            r"edit\.jsonl:1: condition image 'missing\.png' not found \(looked for .*missing\.png\); paths are relative",
        ),
        ("notes.png", r"edit\.jsonl:1: condition image .*notes\.png is not an image Pillow can read"),
        ("truncated.png", r"edit\.jsonl:1: condition image .*truncated\.png does not decode"),
        ("tiny.png", r"edit\.jsonl:1: condition image 'tiny\.png' is 8x64; a side shorter than 16 pixels"),
        ("huge.png", rf"is 4097x4096, more than {MAX_CONDITION_PIXELS:,} pixels.*downscale it"),
        (
            7,
            r"edit\.jsonl:1: 'image' must be a condition image \(a path relative to the prompt file, or bytes",
        ),
        ({"url": "http://x"}, r"'image' is an object with keys \['url'\]"),
    ],
    ids=[
        "missing",
        "not_an_image",
        "truncated",
        "too_small",
        "too_many_pixels",
        "a_number",
        "unknown_object",
    ],
)
def test_a_bad_condition_image_names_the_row_and_the_fix(tmp_path, value, expected):
    (tmp_path / "notes.png").write_text("not an image")
    full = png_bytes(condition_image(5))
    (tmp_path / "truncated.png").write_bytes(full[: len(full) // 2])
    condition_image(6, 8, 64).save(tmp_path / "tiny.png")
    Image.new("L", (4097, 4096)).save(tmp_path / "huge.png")
    data = write_jsonl(tmp_path / "edit.jsonl", [{"prompt": "make it red", "image": value}])
    with pytest.raises((ValueError, FileNotFoundError), match=expected):
        load_prompts([data], image_key="image")


def test_bytes_that_are_not_an_image_and_txt_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"row 3: condition image 'image' bytes \(4 bytes\) is not an image"):
        read_condition_image(b"abcd", tmp_path, "row 3", "image")
    prompts = tmp_path / "p.txt"
    prompts.write_text("make it red\n")
    with pytest.raises(
        ValueError, match=r"a \.txt prompt file holds prompts only.*write the rows as \.jsonl"
    ):
        load_prompts([prompts], image_key="image")
    with pytest.raises(ValueError, match=r"image_key='prompt' is invalid"):
        load_prompts([prompts], image_key="prompt")


RULE = ConditionRule(
    family="EditPipeline",
    min_images=1,
    max_images=2,
    max_aspect=3.0,
    aspect_reason="the reason",
    encoded_size=lambda w, h: qwen_edit_dimensions(1024 * 1024, w, h),
)


def test_family_rules_on_count_aspect_ratio_and_one_condition_size():
    ok = [("f:1", [("a.png", 64, 48)]), ("f:2", [("b.png", 640, 480)])]  # one aspect ratio: one size
    check_condition_rows(RULE, ok, "data.train_files", "image")
    with pytest.raises(
        ValueError, match=r"f:1: the row has 0 condition image\(s\) in 'image', and EditPipeline takes 1 to 2"
    ):
        check_condition_rows(RULE, [("f:1", [])], "data.train_files", "image")
    with pytest.raises(ValueError, match=r"f:1: the row has 3 condition"):
        check_condition_rows(RULE, [("f:1", [("a", 10, 10)] * 3)], "data.train_files", "image")
    with pytest.raises(
        ValueError,
        match=r"condition image a\.png is 400x100 \(aspect ratio 4:1\); EditPipeline takes at most 3:1 \(the reason\): crop it",
    ):
        check_condition_rows(RULE, [("f:1", [("a.png", 400, 100)])], "data.train_files", "image")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "f:2: EditPipeline encodes this row's condition image(s) at 1024x1024 pixels, but f:1's at 1184x896"
        ),
    ):
        check_condition_rows(RULE, [ok[0], ("f:2", [("c.png", 50, 50)])], "data.train_files", "image")
    with pytest.raises(ValueError, match=r"1184x896 \+ 1184x896 pixels, but f:1's at 1184x896"):
        check_condition_rows(RULE, [ok[0], ("f:2", [("a", 64, 48)] * 2)], "data.train_files", "image")


def test_the_family_sizes_follow_the_pipelines():
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    for width, height in [(64, 48), (1000, 333), (17, 900), (1024, 1024), (3000, 2000)]:
        assert qwen_edit_dimensions(1024 * 1024, width, height) == calculate_dimensions(
            1024 * 1024, width / height
        )
        assert qwen_edit_dimensions(384 * 384, width, height) == calculate_dimensions(
            384 * 384, width / height
        )
        # FluxKontextPipeline.__call__: sides to multiples of 16, the nearest trained aspect ratio
        w, h = width - width % 16, height - height % 16
        expected = min((abs(w / h - a / b), a, b) for a, b in PREFERRED_KONTEXT_RESOLUTIONS)[1:]
        assert kontext_size(width, height) == expected
