"""The data server on 127.0.0.1 (port 0): streaming, bad requests, health, Shutdown, skips."""

from __future__ import annotations

import io
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from training.data import epoch_order
from training.dataplane.server import SERVICE_NAME, create_server
from training.dataplane.sources import AugmentingBatchSource
from training.dataplane.v1 import dataplane_pb2 as pb
from training.dataplane.v1 import dataplane_pb2_grpc as pb_grpc
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
        assert not b.skipped_ids


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        ({"start": 0, "stop": 10, "batch_size": 0}, "batch_size must be at least 1"),
        ({"start": 10, "stop": 10, "batch_size": 4}, "empty range"),
        ({"start": 5, "stop": 2, "batch_size": 4}, "empty range"),
        ({"start": 0, "stop": 97, "batch_size": 4}, "beyond the epoch: the dataset has 96"),
        ({"start": 0, "stop": 8, "batch_size": 4, "recipe": "mixup"}, "unknown recipe 'mixup'"),
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


def test_get_info(channel: grpc.Channel) -> None:
    info = pb_grpc.DataPlaneStub(channel).GetInfo(pb.GetInfoRequest(), timeout=5)
    assert (info.num_samples, info.num_classes, info.image_size) == (96, 10, 32)
    assert list(info.recipes) == ["standard", "randaugment"]
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


def test_unreadable_image_is_skipped_and_counted(tmp_path: Path) -> None:
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
    skipped = [i for b in batches for i in b.skipped_ids]
    delivered = [i for b in batches for i in b.sample_ids]
    assert skipped == broken
    assert sorted(delivered + skipped) == list(range(11))
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
