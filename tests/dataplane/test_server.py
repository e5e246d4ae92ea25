"""The data server on 127.0.0.1 (port 0): streaming, bad requests, health, Shutdown, skips,
the memory budget."""

from __future__ import annotations

import io
import logging
import math
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from training.data.order import batch_seed, epoch_order
from training.dataplane.rpc import SERVICE_NAME, channel_options
from training.dataplane.server import PART_IMAGES, batch_memory_bytes, create_server
from training.dataplane.sources import AugmentingBatchSource, BatchWork, PremadeBatchSource
from training.dataplane.v1 import dataplane_pb2 as pb
from training.dataplane.v1 import dataplane_pb2_grpc as pb_grpc
from training.dataplane.wire import decode_batch
from training.spec import DatasetSource, DatasetSpec


def test_streams_the_epoch_order_in_batches(channel: grpc.Channel) -> None:
    stub = pb_grpc.DataPlaneStub(channel)
    request = pb.StreamBatchesRequest(seed=7, epoch=3, start=10, stop=50, batch_size=16)
    batches = list(stub.StreamBatches(request, timeout=30))
    # 40 positions in batches of 16: 16, 16, 8, each saying which positions it covers.
    assert [(b.position_start, b.position_stop) for b in batches] == [(10, 26), (26, 42), (42, 50)]
    ids = [i for b in batches for i in b.sample_ids]
    assert ids == epoch_order(7, 3, 96)[10:50].tolist()
    for b in batches:
        n = len(b.sample_ids)
        assert list(b.shape) == [n, 3, 32, 32] and b.dtype == "uint8"
        assert len(b.pixels) == n * 3 * 32 * 32
        assert list(b.labels) == [i % 10 for i in b.sample_ids]
        assert not b.unreadable


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        ({"start": 0, "stop": 10, "batch_size": 0}, "batch_size must be at least 1"),
        ({"start": 10, "stop": 10, "batch_size": 4}, "empty range"),
        ({"start": 5, "stop": 2, "batch_size": 4}, "empty range"),
        ({"start": 0, "stop": 97, "batch_size": 4}, "beyond the epoch: the dataset has 96"),
        ({"start": 0, "stop": 8, "batch_size": 4, "recipe": "mixup"}, "unknown recipe 'mixup'"),
        (
            {"start": 0, "stop": 8, "batch_size": 4, "recipe": '{"train": {"hflip": 2}}'},
            "hflip: must be in [0, 1], got 2",
        ),
        (
            {"start": 0, "stop": 8, "batch_size": 4, "recipe": '{"eval": {"crop_pct": 0}}'},
            "crop_pct must be in (0, 1]",
        ),
        ({"start": 0, "stop": 8, "batch_size": 4, "recipe": "{not json"}, "not valid JSON"),
        ({"start": 0, "stop": 8, "batch_size": 4, "image_size": 8}, "image_size must be"),
        ({"start": 0, "stop": 8, "batch_size": 100_000, "image_size": 224}, "use at most"),
    ],
)
def test_bad_request_is_invalid_argument_and_server_keeps_serving(
    channel: grpc.Channel, request_fields: dict[str, object], message: str
) -> None:
    stub = pb_grpc.DataPlaneStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.StreamBatches(pb.StreamBatchesRequest(**request_fields), timeout=10))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    # The same server still serves a good request.
    good = list(stub.StreamBatches(pb.StreamBatchesRequest(stop=4, batch_size=4), timeout=30))
    assert len(good) == 1 and len(good[0].sample_ids) == 4


def test_table_and_eval_recipes_are_served_as_the_local_transform_makes_them(
    channel: grpc.Channel, small_source: AugmentingBatchSource
) -> None:
    """A recipe table and the eval transform travel as JSON; the eval transform has no
    randomness, so the server makes exactly the pixels it makes here."""
    from training.data.augment import augment_samples
    from training.data.order import epoch_order
    from training.data.transforms import (
        EvalTransform,
        build_transform,
        encode_recipe,
    )
    from training.spec import parse_augmentation

    stub = pb_grpc.DataPlaneStub(channel)
    ev = EvalTransform(crop_pct=0.9)
    batches = list(
        stub.StreamBatches(
            pb.StreamBatchesRequest(seed=3, stop=8, batch_size=8, recipe=encode_recipe(ev)),
            timeout=30,
        )
    )
    ids = epoch_order(3, 0, 96)[:8].tolist()
    expected = augment_samples(small_source._source, build_transform(ev, 32), ids, 32)
    got = np.frombuffer(batches[0].pixels, dtype=np.uint8).reshape(8, 3, 32, 32)
    assert list(batches[0].sample_ids) == ids
    assert np.array_equal(got, expected.pixels)
    table = parse_augmentation({"preset": "standard", "scale": [0.9, 1.0], "hflip": 0.0})
    request = pb.StreamBatchesRequest(seed=3, stop=8, batch_size=8, recipe=encode_recipe(table))
    (batch,) = list(stub.StreamBatches(request, timeout=30))
    assert list(batch.sample_ids) == ids and list(batch.shape) == [8, 3, 32, 32]


def _is_serving(channel: grpc.Channel) -> bool:
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _serves_a_good_request(channel: grpc.Channel) -> bool:
    stub = pb_grpc.DataPlaneStub(channel)
    good = list(stub.StreamBatches(pb.StreamBatchesRequest(stop=4, batch_size=4), timeout=30))
    return len(good) == 1 and len(good[0].sample_ids) == 4


@pytest.mark.parametrize(
    ("method", "message_type", "body"),
    [
        ("StreamBatches", "StreamBatchesRequest", b"\xff\xff\xff"),
        # Field 6 (recipe, a string) holding bytes that are not UTF-8.
        ("StreamBatches", "StreamBatchesRequest", b"\x32\x02\xff\xfe"),
        ("GetInfo", "GetInfoRequest", b"\xff\xff\xff"),
        ("Shutdown", "ShutdownRequest", b"\xff\xff\xff"),
        ("Shutdown", "ShutdownRequest", b"\x09\x00"),  # grace_s (a double) cut short
    ],
)
def test_undecodable_request_is_invalid_argument_and_server_keeps_serving(
    channel: grpc.Channel,
    caplog: pytest.LogCaptureFixture,
    method: str,
    message_type: str,
    body: bytes,
) -> None:
    path = f"/{SERVICE_NAME}/{method}"
    with caplog.at_level(logging.WARNING), pytest.raises(grpc.RpcError) as err:
        if method == "StreamBatches":
            call = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
            list(call(body, timeout=10))
        else:
            channel.unary_unary(path, request_serializer=None, response_deserializer=None)(
                body, timeout=10
            )
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"request is not a valid {message_type}" in err.value.details()
    # Refused, not crashed: no traceback logged (gRPC logs one when a deserializer raises).
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    # A garbage Shutdown did not shut the server down; it still serves.
    assert _is_serving(channel) and _serves_a_good_request(channel)


@pytest.mark.parametrize("grace_s", [math.nan, math.inf, -math.inf, -1.0, 3600.5, 1e12])
def test_shutdown_refuses_a_bad_grace_and_keeps_serving(
    channel: grpc.Channel, grace_s: float
) -> None:
    stub = pb_grpc.DataPlaneStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.Shutdown(pb.ShutdownRequest(grace_s=grace_s), timeout=5)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "grace_s must be between 0 and 3600 seconds" in err.value.details()
    assert _is_serving(channel) and _serves_a_good_request(channel)


def test_shutdown_with_zero_grace_uses_the_default(small_source: AugmentingBatchSource) -> None:
    server, port = create_server(small_source, port=0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            pb_grpc.DataPlaneStub(ch).Shutdown(pb.ShutdownRequest(grace_s=0), timeout=5)
        assert server.wait_for_termination(timeout=10) is False
    finally:
        server.stop(0).wait()


def test_get_info(channel: grpc.Channel) -> None:
    info = pb_grpc.DataPlaneStub(channel).GetInfo(pb.GetInfoRequest(), timeout=5)
    assert (info.num_samples, info.num_classes, info.image_size) == (96, 10, 32)
    assert list(info.recipes) == ["standard", "randaugment", "none"]
    assert info.default_recipe == "standard" and info.max_message_bytes > 5_000_000


def test_health_then_shutdown_stops_the_server(small_source: AugmentingBatchSource) -> None:
    server, port = create_server(small_source, port=0)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", SERVICE_NAME):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        pb_grpc.DataPlaneStub(ch).Shutdown(pb.ShutdownRequest(grace_s=1.0), timeout=5)
        # wait_for_termination returns False when the server stopped (True: timed out).
        assert server.wait_for_termination(timeout=10) is False
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=2)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE


def _write_image(path: Path, colour: tuple[int, int, int], fmt: str) -> None:
    buf = io.BytesIO()
    Image.fromarray(np.full((40, 48, 3), colour, dtype=np.uint8)).save(buf, format=fmt)
    path.write_bytes(buf.getvalue())


def test_unreadable_image_is_skipped_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for c, cls in enumerate(["cat", "dog"]):
        (tmp_path / cls).mkdir()
        for i in range(5):
            _write_image(tmp_path / cls / f"{i}.jpg", (40 * c, 100, 20 * i), "JPEG")
    (tmp_path / "dog" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    source = AugmentingBatchSource(
        DatasetSpec(source=DatasetSource.FOLDER, path=str(tmp_path), image_size=32),
        workers=1,
        processes=False,
    )
    server, port = create_server(source, port=0)
    caplog.set_level(logging.WARNING, logger="training.dataplane.server")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.DataPlaneStub(ch)
            batches = list(
                stub.StreamBatches(pb.StreamBatchesRequest(stop=11, batch_size=4), timeout=30)
            )
    finally:
        server.stop(0).wait()
        source.close()
    broken = [i for i, (p, _) in enumerate(source._source.samples) if p.endswith("broken.png")]  # type: ignore[attr-defined]
    skipped = [(u.sample, u.name, u.reason) for b in batches for u in b.unreadable]
    delivered = [i for b in batches for i in b.sample_ids]
    assert skipped == [
        (
            broken[0],
            str(tmp_path / "dog" / "broken.png"),
            "not a readable image: corrupt or truncated: Truncated File Read",
        )
    ]
    skipped_ids = [i for i, _, _ in skipped]
    assert sorted(delivered + skipped_ids) == list(range(11))
    # The server's log names it, with why.
    start, stop = next((b.position_start, b.position_stop) for b in batches if b.unreadable)
    assert (
        f"batch [{start}, {stop}): skipped 1 unreadable sample(s): {tmp_path}/dog/broken.png: "
        "not a readable image: corrupt or truncated: Truncated File Read"
    ) in [r.getMessage() for r in caplog.records if r.name == "training.dataplane.server"]
    # Every position is still covered, so the client knows the range is complete.
    assert batches[-1].position_stop == 11


def test_worker_processes_augment_reproducibly() -> None:
    """Real worker processes; a batch is augmented the same way each time it is made."""
    source = AugmentingBatchSource(
        DatasetSpec(num_samples=16, num_classes=4, image_size=32), workers=1, processes=True
    )
    server, port = create_server(source, port=0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.DataPlaneStub(ch)
            request = pb.StreamBatchesRequest(seed=1, stop=16, batch_size=8, recipe="randaugment")
            first = list(stub.StreamBatches(request, timeout=60))
            second = list(stub.StreamBatches(request, timeout=60))
    finally:
        server.stop(0).wait()
        source.close()
    assert [b.pixels for b in first] == [b.pixels for b in second]
    assert first[0].pixels != first[1].pixels


def test_a_big_batch_is_made_in_parts_by_all_the_workers() -> None:
    """An 80-image batch goes to the workers as parts of 32, 32 and 16 positions, each seeded
    by its first position: in two worker processes, its bytes are those of the three batches
    of 32, 32 and 16 that start at the same positions."""
    assert PART_IMAGES == 32
    submitted: list[BatchWork] = []

    class Recording(AugmentingBatchSource):
        def submit(self, work: BatchWork):  # type: ignore[no-untyped-def]
            submitted.append(work)
            return super().submit(work)

    source = Recording(
        DatasetSpec(num_samples=96, num_classes=10, image_size=32), workers=2, processes=True
    )
    server, port = create_server(source, port=0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.DataPlaneStub(ch)
            whole = list(stub.StreamBatches(
                pb.StreamBatchesRequest(seed=4, epoch=1, start=8, stop=88, batch_size=80),
                timeout=60,
            ))  # fmt: skip
            parts = submitted[:]
            small = list(stub.StreamBatches(
                pb.StreamBatchesRequest(seed=4, epoch=1, start=8, stop=88, batch_size=32),
                timeout=60,
            ))  # fmt: skip
    finally:
        server.stop(0).wait()
        source.close()
    order = epoch_order(4, 1, 96).tolist()
    assert [(w.indices, w.rng_seed) for w in parts] == [
        (tuple(order[8:40]), batch_seed(4, 1, 8)),
        (tuple(order[40:72]), batch_seed(4, 1, 40)),
        (tuple(order[72:88]), batch_seed(4, 1, 72)),
    ]
    assert [(b.position_start, b.position_stop) for b in whole] == [(8, 88)]
    assert [(b.position_start, b.position_stop) for b in small] == [(8, 40), (40, 72), (72, 88)]
    assert list(whole[0].shape) == [80, 3, 32, 32]
    assert whole[0].pixels == b"".join(b.pixels for b in small)
    assert list(whole[0].sample_ids) == [i for b in small for i in b.sample_ids] == order[8:88]


def test_batch_of_only_unreadable_samples_is_still_sent(tmp_path: Path) -> None:
    for c, cls in enumerate(["cat", "dog", "eel"]):
        (tmp_path / cls).mkdir()
        for i in range(4):
            _write_image(tmp_path / cls / f"{i}.png", (40 * c, 100, 20 * i), "PNG")
    source = AugmentingBatchSource(
        DatasetSpec(source=DatasetSource.FOLDER, path=str(tmp_path), image_size=32),
        workers=1,
        processes=False,
    )
    # Break every sample of the second batch (positions [4, 8) of epoch 0, seed 0).
    broken = sorted(epoch_order(0, 0, 12)[4:8].tolist())
    for index in broken:
        Path(source._source.samples[index][0]).write_bytes(b"not an image")  # type: ignore[attr-defined]
    server, port = create_server(source, port=0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stream = ch.unary_stream(
                f"/{SERVICE_NAME}/StreamBatches",
                request_serializer=pb.StreamBatchesRequest.SerializeToString,
                response_deserializer=None,
            )
            raw = list(stream(pb.StreamBatchesRequest(stop=12, batch_size=4), timeout=30))
    finally:
        server.stop(0).wait()
        source.close()
    assert len(raw) == 3
    empty = pb.Batch.FromString(raw[1])
    assert (empty.position_start, empty.position_stop) == (4, 8)
    assert list(empty.shape) == [0, 3, 32, 32] and not empty.pixels and not empty.sample_ids
    assert sorted(u.sample for u in empty.unreadable) == broken
    received = decode_batch(raw[1])
    assert received.batch.images.shape == (0, 3, 32, 32) and received.skipped == 4
    assert sorted((u.sample, u.name) for u in received.batch.skipped) == [
        (i, source._source.samples[i][0])  # type: ignore[attr-defined]
        for i in broken
    ]
    assert (received.position_start, received.position_stop) == (4, 8)
    assert [len(pb.Batch.FromString(m).sample_ids) for m in (raw[0], raw[2])] == [4, 4]


# ---- the memory budget -----------------------------------------------------------------------

_BIG = 224  # px: a 32-image batch is 4.8 MB, more than a client's receive window
# Small receive windows: what a client does not read stays in the server (BDP probing would let
# several MB through to the client).
_SMALL_WINDOW = [*channel_options(), ("grpc.http2.bdp_probe", 0)]


@pytest.fixture
def one_batch_server() -> Iterator[str]:
    """A server whose memory budget holds one 32 x 224 px batch, with a 2 s batch timeout."""
    source = PremadeBatchSource(512, image_size=_BIG, max_batch=32)
    server, port = create_server(
        source, port=0, memory_budget_bytes=batch_memory_bytes(32, _BIG), batch_timeout_s=2.0
    )
    yield f"127.0.0.1:{port}"
    server.stop(0).wait()


class FirstMessage:
    """Reads a stream's first message in a thread: ``get(timeout_s)`` returns it, or the stream's
    error, or None if neither came yet."""

    def __init__(self, call: Iterator[pb.Batch]) -> None:
        self._got: list[pb.Batch | grpc.RpcError] = []
        self._done = threading.Event()
        threading.Thread(target=self._read, args=(call,), daemon=True).start()

    def _read(self, call: Iterator[pb.Batch]) -> None:
        try:
            self._got.append(next(call))
        except grpc.RpcError as e:
            self._got.append(e)
        self._done.set()

    def get(self, timeout_s: float) -> pb.Batch | grpc.RpcError | None:
        return self._got[0] if self._done.wait(timeout_s) else None


def test_stream_beyond_the_budget_waits_until_another_lets_go(one_batch_server: str) -> None:
    with grpc.insecure_channel(one_batch_server, options=_SMALL_WINDOW) as ch:
        stub = pb_grpc.DataPlaneStub(ch)
        request = pb.StreamBatchesRequest(stop=96, batch_size=32)
        holder = stub.StreamBatches(request, timeout=30)
        waiter: Iterator[pb.Batch] | None = None
        try:
            # The holder reads one batch, then stops reading: the budget stays with it.
            assert isinstance(FirstMessage(holder).get(10), pb.Batch)
            waiter = stub.StreamBatches(request, timeout=30)
            waiter_first = FirstMessage(waiter)
            assert waiter_first.get(1.0) is None
            holder.cancel()  # its bytes go back to the budget: the waiter goes on
            first = waiter_first.get(10)
            assert isinstance(first, pb.Batch) and first.position_start == 0
            assert [b.position_start for b in waiter] == [32, 64]
            # Nothing is left charged: a new stream runs to its end.
            assert len(list(stub.StreamBatches(request, timeout=30))) == 3
        finally:
            holder.cancel()
            if waiter is not None:
                waiter.cancel()  # type: ignore[attr-defined]


def test_stream_waiting_for_the_budget_too_long_is_resource_exhausted(
    one_batch_server: str,
) -> None:
    with grpc.insecure_channel(one_batch_server, options=_SMALL_WINDOW) as ch:
        stub = pb_grpc.DataPlaneStub(ch)
        request = pb.StreamBatchesRequest(stop=96, batch_size=32)
        holder = stub.StreamBatches(request, timeout=30)
        try:
            assert isinstance(FirstMessage(holder).get(10), pb.Batch)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.StreamBatches(request, timeout=30))
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "memory budget" in err.value.details()
        finally:
            holder.cancel()
