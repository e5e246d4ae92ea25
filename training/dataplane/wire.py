"""The ``Batch`` message on the wire without copying its pixels more than gRPC must.

A 32 x 224 px batch is 4.8 MB of pixels. The generated protobuf code copies them three times on
the server (array to bytes, bytes into the message, message to wire bytes) and twice on the
trainer (wire bytes into the message, field to a new bytes object); on this project's 2-core
machine that halved the transport rate and doubled the trainer host's receive CPU.

``encode_batch`` writes the small fields with protobuf and appends the pixels field (field 3,
length-delimited) itself: one copy. ``decode_batch`` walks the top-level fields of the received
bytes, parses everything but the pixels with protobuf and returns the pixels as a view on the
received bytes: no copy. The bytes are standard protobuf encoding of ``Batch``: any protobuf
client reads them (fields may come in any order), and ``decode_batch`` reads any encoder's.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from training.data.augment import AugmentedSamples
from training.data.batch import Batch, Unreadable
from training.data.names import shown_text
from training.dataplane.v1 import dataplane_pb2

# Images are read-only views on the received bytes (no copy: receive CPU is what the design
# saves); torch warns that such tensors are not writable. Silence only that warning, only here.
warnings.filterwarnings(
    "ignore", message="The given buffer is not writable", category=UserWarning, module=__name__
)

_PIXELS_FIELD = dataplane_pb2.Batch.PIXELS_FIELD_NUMBER
_LEN = 2  # wire type of length-delimited fields
_PIXELS_TAG = bytes([(_PIXELS_FIELD << 3) | _LEN])


class WireError(ValueError):
    """Bytes that are not a well-formed ``Batch`` message."""


@dataclasses.dataclass(frozen=True)
class ReceivedBatch:
    """A decoded message: the trainer's ``Batch`` and where it sits in the epoch."""

    batch: Batch
    position_start: int
    position_stop: int

    @property
    def skipped(self) -> int:
        """Samples of the range that could not be read (``batch.skipped`` names them)."""
        return len(self.batch.skipped)

    def pinned(self) -> ReceivedBatch:
        """This batch with its images copied into page-locked memory (needs a CUDA host): a
        GPU then copies them straight from there, with no staging copy on the trainer's
        thread."""
        batch = dataclasses.replace(self.batch, images=self.batch.images.pin_memory())
        return dataclasses.replace(self, batch=batch)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise WireError("truncated or malformed varint")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def encode_batch(
    parts: Sequence[AugmentedSamples], position_start: int, position_stop: int
) -> bytes:
    """Serialize the ``parts`` of one batch, in order, as one ``Batch`` message, copying the
    pixels once (straight from each part into the message)."""
    pixels = [np.ascontiguousarray(p.pixels, dtype=np.uint8) for p in parts]
    shape = (sum(len(p) for p in pixels), *pixels[0].shape[1:])
    header = dataplane_pb2.Batch(
        shape=shape,
        dtype="uint8",
        labels=np.concatenate([p.labels for p in parts]).tolist(),
        sample_ids=np.concatenate([p.sample_ids for p in parts]).tolist(),
        position_start=position_start,
        position_stop=position_stop,
        unreadable=[
            # shown_text: a string field must be valid UTF-8, or serializing the batch fails.
            dataplane_pb2.Unreadable(
                sample=u.sample, name=shown_text(u.name), reason=shown_text(u.reason)
            )
            for p in parts
            for u in p.skipped
        ],
    ).SerializeToString()
    nbytes = sum(p.nbytes for p in pixels)
    if nbytes == 0:
        return header
    views = [p.data.cast("B") for p in pixels if p.nbytes]
    return b"".join((header, _PIXELS_TAG, _varint(nbytes), *views))


def decode_batch(data: bytes) -> ReceivedBatch:
    """Parse a ``Batch`` message; the images are a read-only view on ``data``."""
    pixels_at = pixels_len = -1
    parts: list[tuple[int, int]] = []  # byte ranges of every other field
    at = 0
    while at < len(data):
        start = at
        tag, at = _read_varint(data, at)
        wire_type = tag & 7
        if wire_type == 0:
            _, at = _read_varint(data, at)
        elif wire_type == 1:
            at += 8
        elif wire_type == 5:
            at += 4
        elif wire_type == _LEN:
            length, at = _read_varint(data, at)
            if at + length > len(data):
                raise WireError("field runs past the end of the message")
            if tag >> 3 == _PIXELS_FIELD:
                pixels_at, pixels_len = at, length
                at += length
                continue
            at += length
        else:
            raise WireError(f"unsupported wire type {wire_type}")
        if at > len(data):
            raise WireError("field runs past the end of the message")
        if parts and parts[-1][1] == start:
            parts[-1] = (parts[-1][0], at)
        else:
            parts.append((start, at))
    header = dataplane_pb2.Batch.FromString(b"".join(data[a:b] for a, b in parts))
    if header.dtype != "uint8" or len(header.shape) != 4:
        raise WireError(f"unexpected batch encoding: dtype {header.dtype!r}, shape {header.shape}")
    shape = tuple(header.shape)
    expected = shape[0] * shape[1] * shape[2] * shape[3]
    if expected == 0:
        images = torch.empty(shape, dtype=torch.uint8)
    elif pixels_len != expected:
        raise WireError(f"pixels hold {max(pixels_len, 0)} bytes, shape {shape} needs {expected}")
    else:
        images = torch.frombuffer(data, dtype=torch.uint8, count=expected, offset=pixels_at)
        images = images.view(shape)
    batch = Batch(
        images=images,
        labels=torch.tensor(header.labels, dtype=torch.int64),
        sample_ids=torch.tensor(header.sample_ids, dtype=torch.int64),
        skipped=tuple(Unreadable(u.sample, u.name, u.reason) for u in header.unreadable),
    )
    return ReceivedBatch(batch, header.position_start, header.position_stop)
