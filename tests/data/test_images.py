"""Dataset images that Pillow refuses are user errors naming the file (diffrl.data.images.open_image)."""

import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from diffrl.data.images import load_image_rows


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG header claiming width x height (signature and IHDR, no pixel data)."""

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")


def test_an_image_over_pillows_cap_or_not_an_image_is_a_value_error_naming_it(tmp_path):
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(_png_claiming(20_000, 20_000))  # 400 M pixels: over Pillow's 2 x MAX_IMAGE_PIXELS
    cap = 2 * Image.MAX_IMAGE_PIXELS
    with pytest.raises(ValueError, match=rf"image {bomb} has more pixels than .* \({cap:,}\).*resize it"):
        load_image_rows("files", [str(bomb)], 32, 32, [0])
    junk = tmp_path / "notes.png"
    junk.write_text("not an image")
    with pytest.raises(ValueError, match=rf"image {junk} is not an image Pillow can read"):
        load_image_rows("files", [str(junk)], 32, 32, [0])
    good = tmp_path / "good.png"
    Image.fromarray(np.full((32, 32, 3), 7, np.uint8)).save(good)
    assert load_image_rows("files", [str(good)], 32, 32, [0]).tolist() == np.full((1, 32, 32, 3), 7).tolist()
