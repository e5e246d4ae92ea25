"""A JPEG decoded only down to the rows a crop needs (training/data/top_rows.py): those rows are
the full decode's, byte for byte, for every kind of JPEG encoders write, at full and at reduced
size; a file that cannot be cut short safely is decoded whole."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import sklearn.datasets
from PIL import Image

from training.data.decode import finish_decode, open_image
from training.data.top_rows import decode_only_top, frame_header, rows_to_decode

PHOTO = Path(sklearn.datasets.__file__).parent / "images" / "china.jpg"  # 640 x 427, 4:4:4

VARIANTS: dict[str, tuple[str, dict[str, object]]] = {
    "4:2:0": ("RGB", {"subsampling": 2}),
    "4:2:2": ("RGB", {"subsampling": 1}),
    "4:4:4": ("RGB", {"subsampling": 0}),
    "progressive": ("RGB", {"progressive": True}),
    "restart markers": ("RGB", {"restart_marker_rows": 1}),
    "optimized tables": ("RGB", {"optimize": True}),
    "grayscale": ("L", {}),
    "CMYK": ("CMYK", {}),
}


def encoded(variant: str) -> bytes:
    """china.jpg twice a side (1280 x 854), re-encoded as ``VARIANTS[variant]`` says."""
    mode, options = VARIANTS[variant]
    with Image.open(PHOTO) as im:
        image = im.convert("RGB").resize((1280, 854)).convert(mode)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90, **options)
    return out.getvalue()


def decoded(data: bytes, needed: int | None = None, reduction: int = 1) -> np.ndarray:
    """``data`` decoded (at ``1 / reduction``), only down to ``needed`` rows where given."""
    image = open_image(data)
    if needed is not None:
        height = image.height
        assert decode_only_top(image, data, needed) == (image.height < height)
    if reduction > 1:
        image.draft(None, (image.width // reduction, image.height // reduction))
    return np.asarray(finish_decode(image))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_rows_a_crop_needs_are_the_full_decodes_byte_for_byte(variant: str) -> None:
    data = encoded(variant)
    header = frame_header(data)
    assert header is not None and (header.width, header.height) == (1280, 854)
    for reduction in (1, 2, 4):
        full = decoded(data, reduction=reduction)
        cut_short = 0
        for needed in [*range(1, 854, 53), 800, 821]:
            top = decoded(data, needed, reduction)
            rows = -(-needed // reduction)
            assert np.array_equal(top[:rows], full[:rows]), (variant, reduction, needed)
            assert len(top) == -(-rows_to_decode(header, needed) // reduction)
            cut_short += len(top) < len(full)
        assert cut_short >= 15, (variant, reduction)  # every needed row count but the last few


def test_a_frame_header_says_where_the_height_is_and_how_high_an_mcu_row_is() -> None:
    for variant, mcu_rows in (("4:2:0", 16), ("4:2:2", 8), ("4:4:4", 8), ("grayscale", 8)):
        data = encoded(variant)
        header = frame_header(data)
        assert header is not None and header.mcu_rows == mcu_rows, variant
        assert data[header.height_at : header.height_at + 2] == (854).to_bytes(2, "big")
    assert header is not None
    assert rows_to_decode(header, 100) == 100 + 2 * 8
    assert rows_to_decode(header, 840) == 854


def test_a_file_that_cannot_be_cut_short_safely_is_decoded_whole() -> None:
    data = encoded("4:2:0")
    full = decoded(data)
    # Truncated: decoded whole, so it fails as before wherever its crop lies.
    truncated = data[: len(data) * 3 // 4]
    image = open_image(truncated)
    assert not decode_only_top(image, truncated, 10) and image.size == (1280, 854)
    with pytest.raises(OSError, match="truncated"):
        finish_decode(image)
    # Bytes after the end marker, or a crop that reaches the last MCU rows: whole.
    trailing = data + b"\x00" * 16
    assert not decode_only_top(open_image(trailing), trailing, 10)
    assert not decode_only_top(open_image(data), data, 830)
    # The height left to a DNL marker (0 in the frame header), a PNG, not an image at all.
    header = frame_header(data)
    assert header is not None
    dnl = bytearray(data)
    dnl[header.height_at : header.height_at + 2] = b"\x00\x00"
    assert frame_header(bytes(dnl)) is None
    png = io.BytesIO()
    Image.fromarray(full).save(png, "PNG")
    assert frame_header(png.getvalue()) is None
    assert not decode_only_top(open_image(png.getvalue()), png.getvalue(), 10)
    assert frame_header(b"\xff\xd8\xff\xe0\x00") is None
    assert frame_header(b"\xff\xd8\x00\x00\x00\x00") is None


@pytest.mark.parametrize("variant", ["4:2:0", "progressive"])
def test_the_decoder_gets_the_whole_file_in_one_read_and_makes_the_same_pixels(
    variant: str,
) -> None:
    """``open_image`` hands the decoder every byte at once (not PIL's 64 KiB reads): the same
    pixels as PIL's own decode, at full size and only down to the top rows."""
    data = encoded(variant)
    assert len(data) > 2 * 65536  # more than PIL's reads would take in one
    image = open_image(data)
    assert image.decodermaxblock >= len(data)
    with Image.open(io.BytesIO(data)) as plain:
        expected = np.asarray(plain.convert("RGB"))
    assert np.array_equal(decoded(data), expected)
    top = decoded(data, needed=300)
    assert np.array_equal(top[:300], expected[:300])
