"""A JPEG decoded only down to the last row its training crop needs: the same pixels, fewer rows.

libjpeg decodes a baseline or progressive JPEG from the top down, one row of MCUs after another,
and every output row depends only on the data of its own and its neighbouring block rows. So a
decoder told that the image is ``rows`` high (the height in the frame header, SOF, rewritten in
a copy of the bytes) makes exactly the first ``rows`` rows of the full decode and skips the rest
of the scan: a training crop that ends at 70 % of the height costs 70 % of the decode's
inverse DCT, upsampling and colour conversion, and of its entropy decode in a baseline JPEG.
``CONTEXT_IMCU_ROWS`` rows of MCUs more than the crop needs are decoded, so that the chroma
upsampling and block smoothing of the last needed rows see the neighbours they see in the full
decode (``tests/data/test_top_rows.py`` compares every row, byte for byte, over sampling
factors, progressive files and restart markers).

Only a file that ends in an EOI marker is cut short: a truncated file is decoded whole, so it
fails as it always did, whichever crop it was drawn.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image, ImageFile

_SOF_MARKERS = frozenset({0xC0, 0xC1, 0xC2})
"""The frames cut short: baseline, extended sequential and progressive, Huffman-coded (what
cameras and encoders write). Lossless, arithmetic-coded and hierarchical files decode whole."""

_SOS, _EOI_END = 0xDA, b"\xff\xd9"
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})
"""Markers without a length field (TEM, RST0-7) that may precede the frame header."""

CONTEXT_IMCU_ROWS = 2
"""MCU rows decoded below the last row a crop needs (an MCU row is 8 pixel rows times the
largest vertical sampling factor: 16 for 4:2:0)."""


@dataclass(frozen=True)
class FrameHeader:
    """Where a JPEG's frame header keeps its height, and what it says."""

    height_at: int
    """Offset of the two big-endian bytes of the height."""
    height: int
    width: int
    mcu_rows: int
    """Pixel rows per MCU row: 8 x the largest vertical sampling factor."""


def frame_header(data: bytes) -> FrameHeader | None:
    """The frame header of a JPEG that can be cut short, or None (another frame type, a
    malformed marker sequence, or a scan before any frame)."""
    if not data.startswith(b"\xff\xd8"):
        return None
    at, end = 2, len(data)
    while at + 4 <= end:
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in _STANDALONE:
            at += 2
            continue
        length = int.from_bytes(data[at + 2 : at + 4], "big")
        if marker in _SOF_MARKERS:
            return _frame(data, at + 4, length)
        if marker == _SOS or (0xC3 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC)):
            return None  # a scan before the frame, or a frame of another kind
        at += 2 + length
    return None


def _frame(data: bytes, at: int, length: int) -> FrameHeader | None:
    """The frame header whose fields (precision, height, width, components) start at ``at``."""
    if length < 8 or at + length - 2 > len(data):
        return None
    height = int.from_bytes(data[at + 1 : at + 3], "big")
    width = int.from_bytes(data[at + 3 : at + 5], "big")
    count = data[at + 5]
    if height == 0 or count == 0 or length != 8 + 3 * count:
        return None  # height 0: defined later by a DNL marker
    vertical = max(data[at + 7 + 3 * i] & 0x0F for i in range(count))
    return FrameHeader(at + 1, height, width, 8 * max(vertical, 1))


def rows_to_decode(header: FrameHeader, needed: int) -> int:
    """How many rows to decode so that the first ``needed`` are exactly the full decode's."""
    return min(header.height, needed + CONTEXT_IMCU_ROWS * header.mcu_rows)


def decode_only_top(image: Image.Image, data: bytes, needed: int) -> bool:
    """Make ``image`` (``data`` opened by PIL, not yet loaded or drafted) decode only what its
    first ``needed`` rows need; its height becomes the rows it will decode. False, and
    ``image`` untouched, where the file cannot be cut short or nothing would be saved."""
    if not (
        isinstance(image, ImageFile.ImageFile) and data.endswith(_EOI_END) and len(image.tile) == 1
    ):
        return False
    header = frame_header(data)
    width, height = image.size
    if header is None or (header.width, header.height) != (width, height):
        return False
    rows = rows_to_decode(header, needed)
    tile = image.tile[0]
    if rows >= height or tile.codec_name != "jpeg" or tile.extents != (0, 0, width, height):
        return False
    cut = bytearray(data)
    cut[header.height_at : header.height_at + 2] = rows.to_bytes(2, "big")
    # What PIL's own ``draft`` changes to decode another size: the size and the tile's extent.
    image.fp = io.BytesIO(cut)
    image._size = (width, rows)
    image.tile = [tile._replace(extents=(0, 0, width, rows))]
    return True
