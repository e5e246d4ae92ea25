"""What a readable image is: the one decode the data servers run on every sample
(``decode_image``, through ``training/data/augment.py``) and the check ``hetero dataset prep``
and ``verify`` make of every image (``image_problem``), with the same limits, and the words
both give each kind of unreadable file (``EMPTY`` ... ``CANNOT_READ``).

The limits are PIL's defaults, held here so that both sides apply the same ones whatever PIL's
module globals are: an image of more than ``MAX_PIXELS`` pixels is a decompression bomb
(PIL raises ``DecompressionBombError`` above twice ``Image.MAX_IMAGE_PIXELS``, 89,478,485), and
every mode PIL converts to RGB (CMYK, RGBA, 16-bit, palette, 1-bit, ...) is decoded.
"""

from __future__ import annotations

import io

from PIL import Image, UnidentifiedImageError

MAX_PIXELS = 178_956_970
"""The most pixels an image may declare: PIL's decompression-bomb error threshold (twice its
default ``Image.MAX_IMAGE_PIXELS``)."""

DECODE_ERRORS = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)
"""What PIL raises for bytes that are not a decodable image (truncated, corrupt, not an image)."""

EMPTY = "empty file"
NOT_AN_IMAGE = "not an image"
TOO_MANY_PIXELS = "too many pixels"
CORRUPT = "corrupt or truncated"
"""The kinds of unreadable image ``image_problem`` names, each its reason's first words."""
CANNOT_READ = "cannot read it"
"""The kind of a file whose bytes cannot be read at all (a dangling link, a file it may not
read, an S3 object that is gone or denied): the data path's reason for it, and prep's
(``training/data/prep_inputs.py``, ``read_problem``)."""


def open_image(data: bytes) -> Image.Image:
    """``data`` opened (its header read, nothing decoded yet) and checked against
    ``MAX_PIXELS``."""
    image = Image.open(io.BytesIO(data))
    if image.width * image.height > MAX_PIXELS:
        raise Image.DecompressionBombError(
            f"{image.width}x{image.height} is {image.width * image.height} pixels, more than "
            f"the {MAX_PIXELS} a data server decodes"
        )
    # The bytes are in memory: the decoder gets them in one call, not PIL's 64 KiB reads (each
    # one more call and a concatenation; 1.5-2.5 % of a 640 x 427 JPEG's decode).
    image.decodermaxblock = max(len(data), image.decodermaxblock)
    return image


def decode_image(data: bytes) -> Image.Image:
    """Decode JPEG/PNG/... bytes into an RGB PIL image; raises one of ``DECODE_ERRORS`` (PIL's
    ``UnidentifiedImageError`` and ``DecompressionBombError`` included) if the bytes are not a
    readable image."""
    return finish_decode(open_image(data))


def finish_decode(image: Image.Image) -> Image.Image:
    """An opened image (``open_image``) decoded to RGB; raises as ``decode_image`` does."""
    # The full decode here, so a truncated file fails here, not later. An RGB image is returned
    # as decoded: convert("RGB") would copy every pixel again (docs/dataplane.md, per core).
    image.load()
    return image if image.mode == "RGB" else image.convert("RGB")


def image_problem(data: bytes) -> str | None:
    """Why ``data`` is not an image a data server can decode (a reason starting with one of
    ``EMPTY``, ``NOT_AN_IMAGE``, ``TOO_MANY_PIXELS``, ``CORRUPT``), or None when it is. Checks
    the header and size, the format's own integrity check (PIL's ``verify``: PNG checksums)
    and the full decode the data servers make."""
    if not data:
        return EMPTY
    try:
        image = open_image(data)
    except DECODE_ERRORS as e:
        return decode_problem(data, e)
    try:
        image.verify()
        decode_image(data)
    except DECODE_ERRORS as e:
        return _corrupt(e)
    return None


def decode_problem(data: bytes, error: Exception) -> str:
    """Why ``data`` did not decode (``decode_image`` raised ``error``), in ``image_problem``'s
    words."""
    if not data:
        return EMPTY
    if isinstance(error, UnidentifiedImageError):
        # PIL's message names an in-memory file object: nothing the user can act on.
        return f"{NOT_AN_IMAGE}: no image format recognises its bytes"
    if isinstance(error, Image.DecompressionBombError):
        return f"{TOO_MANY_PIXELS}: {error}"
    return _corrupt(error)


def _corrupt(error: Exception) -> str:
    return f"{CORRUPT}: {error or type(error).__name__}"
