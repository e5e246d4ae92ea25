"""The batch codec: standard protobuf bytes, pixels copied once on send and never on receive."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from training.data.augment import AugmentedSamples
from training.data.batch import Unreadable
from training.data.names import shown_path
from training.dataplane.v1 import dataplane_pb2
from training.dataplane.wire import WireError, decode_batch, encode_batch


def unreadable(sample: int) -> Unreadable:
    return Unreadable(sample, f"/data/cat/{sample}.jpg", "not a readable image: truncated")


def samples(n: int = 3, size: int = 4) -> AugmentedSamples:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (n, 3, size, size), dtype=np.uint8)
    ids = np.arange(10, 10 + n, dtype=np.int64)
    return AugmentedSamples(pixels, ids % 7, ids, [unreadable(99)])


def test_round_trip_keeps_every_field_and_views_the_bytes() -> None:
    s = samples()
    data = encode_batch([s], 10, 14)
    got = decode_batch(data)
    assert torch.equal(got.batch.images, torch.from_numpy(s.pixels))
    assert got.batch.labels.tolist() == s.labels.tolist()
    assert got.batch.sample_ids.tolist() == [10, 11, 12]
    assert (got.position_start, got.position_stop, got.skipped) == (10, 14, 1)
    assert got.batch.skipped == (unreadable(99),)
    # The images share memory with the received bytes: no copy on the trainer host.
    base = np.frombuffer(data, dtype=np.uint8).ctypes.data
    assert base <= got.batch.images.data_ptr() < base + len(data)


def test_parts_are_one_batch_in_their_order() -> None:
    """A batch made in parts (one per worker) is the message of the parts joined, a part left
    empty by skips included."""
    s = samples(5)
    empty = AugmentedSamples(
        np.zeros((0, 3, 4, 4), np.uint8),
        np.zeros(0, np.int64),
        np.zeros(0, np.int64),
        [unreadable(7)],
    )
    first = AugmentedSamples(s.pixels[:2], s.labels[:2], s.sample_ids[:2], [])
    last = AugmentedSamples(s.pixels[2:], s.labels[2:], s.sample_ids[2:], [unreadable(99)])
    got = decode_batch(encode_batch([first, empty, last], 10, 16))
    assert torch.equal(got.batch.images, torch.from_numpy(s.pixels))
    assert got.batch.sample_ids.tolist() == [10, 11, 12, 13, 14]
    assert got.batch.labels.tolist() == s.labels.tolist()
    assert (got.position_start, got.position_stop, got.skipped) == (10, 16, 2)
    assert got.batch.skipped == (unreadable(7), unreadable(99))
    parsed = dataplane_pb2.Batch.FromString(encode_batch([first, empty, last], 10, 16))
    assert [u.sample for u in parsed.unreadable] == [7, 99]
    assert parsed.pixels == s.pixels.tobytes()


def test_encoding_is_standard_protobuf_both_ways() -> None:
    s = samples()
    parsed = dataplane_pb2.Batch.FromString(encode_batch([s], 0, 3))
    assert parsed.pixels == s.pixels.tobytes() and list(parsed.shape) == [3, 3, 4, 4]
    assert [(u.sample, u.name, u.reason) for u in parsed.unreadable] == [
        (99, "/data/cat/99.jpg", "not a readable image: truncated")
    ]
    # And a message from the generated serializer (pixels in the middle) decodes the same.
    standard = dataplane_pb2.Batch(
        shape=s.pixels.shape,
        dtype="uint8",
        pixels=s.pixels.tobytes(),
        labels=s.labels.tolist(),
        sample_ids=s.sample_ids.tolist(),
        position_start=0,
        position_stop=3,
    ).SerializeToString()
    got = decode_batch(standard)
    assert torch.equal(got.batch.images, torch.from_numpy(s.pixels))
    assert got.batch.sample_ids.tolist() == [10, 11, 12] and got.position_stop == 3


def test_empty_batch_after_skips() -> None:
    empty = AugmentedSamples(
        np.zeros((0, 3, 4, 4), np.uint8),
        np.zeros(0, np.int64),
        np.zeros(0, np.int64),
        [unreadable(5), unreadable(6)],
    )
    got = decode_batch(encode_batch([empty], 4, 6))
    assert len(got.batch) == 0 and got.skipped == 2 and got.position_stop == 6
    assert got.batch.skipped == (unreadable(5), unreadable(6))


def test_unreadable_samples_travel_by_name_with_their_reason() -> None:
    """A file name whose bytes are not UTF-8 arrives as the data path shows it (``\\xNN``)."""
    name = shown_path(os.fsdecode(b"/data/caf\xe9/\xff\xfe.png"))
    assert name == "/data/caf\\xe9/\\xff\\xfe.png"
    skipped = [
        Unreadable(4, name, "not a readable image: cannot identify image file"),
        Unreadable(9, "s3://images/train/dog/9.jpg", "cannot read it: NoSuchKey"),
    ]
    s = samples()
    got = decode_batch(encode_batch([dataclasses.replace(s, skipped=skipped)], 0, 5))
    assert got.batch.skipped == tuple(skipped) and got.skipped == 2
    assert got.batch.sample_ids.tolist() == [10, 11, 12]


def test_a_name_that_is_not_utf8_cannot_break_the_message() -> None:
    """A source that hands over a file name as Python keeps it (surrogate escapes, which no
    protobuf string field takes) still gets its batch sent: the name is shown escaped."""
    raw = os.fsdecode(b"/data/cat/\xff.jpg")
    skipped = [Unreadable(3, raw, f"cannot read it: {raw}\ud800")]
    got = decode_batch(encode_batch([dataclasses.replace(samples(), skipped=skipped)], 0, 4))
    assert got.batch.skipped == (
        Unreadable(3, "/data/cat/\\xff.jpg", "cannot read it: /data/cat/\\xff.jpg\\ud800"),
    )


def test_pinned_keeps_the_unreadable_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    # pin_memory needs a CUDA host; a copy stands in for it.
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())
    got = decode_batch(encode_batch([samples()], 0, 4)).pinned()
    assert got.batch.skipped == (unreadable(99),) and got.skipped == 1
    assert got.batch.sample_ids.tolist() == [10, 11, 12]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (encode_batch([samples()], 0, 3)[:-5], "runs past the end"),
        (b"\x1a\xff\xff", "truncated or malformed varint"),
        (b"\x0f", "unsupported wire type"),
        (dataplane_pb2.Batch(shape=[1, 3, 2, 2], dtype="uint8").SerializeToString(), "needs 12"),
        (dataplane_pb2.Batch(shape=[1, 3, 2, 2], dtype="float32").SerializeToString(), "dtype"),
    ],
)
def test_malformed_messages_are_refused(data: bytes, message: str) -> None:
    with pytest.raises(WireError, match=message):
        decode_batch(data)
