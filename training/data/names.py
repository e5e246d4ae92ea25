"""How a sample's location and what went wrong with it are shown to a person: as valid UTF-8
text that can be printed, logged, stored and sent in a protobuf string field anywhere."""

from __future__ import annotations

import re

# Lone surrogates other than U+DC80..U+DCFF, the surrogate escapes of bytes 0x80..0xFF.
_NOT_AN_ESCAPED_BYTE = re.compile("[\ud800-\udc7f\udd00-\udfff]")


def shown_text(text: str) -> str:
    """``text`` (a file name, or a message that may quote one) as valid UTF-8 text:
    surrogate-escaped bytes (how Python keeps the bytes of a file name that are not UTF-8)
    written as ``\\xNN``, any other lone surrogate as ``\\uNNNN``."""
    text = _NOT_AN_ESCAPED_BYTE.sub(lambda m: f"\\u{ord(m[0]):04x}", text)
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def shown_path(path: str) -> str:
    """``path`` as text that can be printed and stored anywhere: bytes of a file name that are
    not UTF-8 (kept by Python as surrogate escapes) written as ``\\xNN``."""
    return shown_text(path)
