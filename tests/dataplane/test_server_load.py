"""A data server's load (``ServerInfo.busy_s``/``uptime_s``/``active_streams``), the throttle
that stands in for a slower machine (``max_images_per_s``), and ``ServerPool.server_loads``:
real servers on 127.0.0.1 (port 0), and the meters on a fake clock."""

from __future__ import annotations

import argparse
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from training.dataplane import serve_cli
from training.dataplane.budget import MB, ByteBudget
from training.dataplane.discovery import StaticServers
from training.dataplane.load import (
    ENV_MAX_IMAGES_PER_S,
    ImageRateThrottle,
    PoolLoad,
    check_images_per_s,
)
from training.dataplane.membership import ServerPool
from training.dataplane.server import DataPlaneServicer, create_server
from training.dataplane.sources import AugmentingBatchSource, PremadeBatchSource
from training.dataplane.v1 import dataplane_pb2 as pb
from training.dataplane.v1 import dataplane_pb2_grpc as pb_grpc

_SIZE = 32  # px: premade batches are cheap, so the throttle is all that takes time


def _info(address: str) -> pb.ServerInfo:
    with grpc.insecure_channel(address) as ch:
        info: pb.ServerInfo = pb_grpc.DataPlaneStub(ch).GetInfo(pb.GetInfoRequest(), timeout=5)
        return info


def _wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture
def start_server() -> Iterator[Callable[..., tuple[grpc.Server, str]]]:
    """``start_server(max_images_per_s=...)``: a server of premade 32 px batches; all stopped
    at the end."""
    servers: list[grpc.Server] = []

    def start(max_images_per_s: float | None = None) -> tuple[grpc.Server, str]:
        source = PremadeBatchSource(512, image_size=_SIZE, max_batch=16)
        server, port = create_server(source, port=0, max_images_per_s=max_images_per_s)
        servers.append(server)
        return server, f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0).wait()


# ---- the wire: new fields, old readers -------------------------------------------------------

_OLD_FIELDS = {
    "num_samples": 1,
    "num_classes": 2,
    "image_size": 3,
    "default_recipe": 4,
    "recipes": 5,
    "max_message_bytes": 6,
    "workers": 7,
    "num_val_samples": 8,
}


def test_server_info_fields_keep_their_numbers() -> None:
    numbers = {f.name: f.number for f in pb.ServerInfo.DESCRIPTOR.fields}
    assert {n: numbers[n] for n in _OLD_FIELDS} == _OLD_FIELDS
    assert {n: numbers[n] for n in ("busy_s", "uptime_s", "active_streams")} == {
        "busy_s": 9,
        "uptime_s": 10,
        "active_streams": 11,
    }


def test_server_info_from_an_old_server_reads_zero_load() -> None:
    old = pb.ServerInfo(num_samples=96, num_classes=10, image_size=32, workers=2)
    info = pb.ServerInfo.FromString(old.SerializeToString())
    assert (info.busy_s, info.uptime_s, info.active_streams) == (0.0, 0.0, 0)
    assert (info.num_samples, info.workers) == (96, 2)


def test_an_old_client_reads_a_new_server_info() -> None:
    """ServerInfo as version 1 had it before the load fields (built from the descriptor without
    fields 9-11) parses a new server's message: the old fields as sent, the new ones skipped."""
    file_proto = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(file_proto)
    file_proto.name = "old/dataplane.proto"
    file_proto.package = "old.training.dataplane.v1"
    del file_proto.service[:]
    for m in file_proto.message_type:  # fields of message types name them in the new package
        for f in m.field:
            if f.type_name.startswith(".training.dataplane.v1."):
                f.type_name = ".old" + f.type_name
    (message,) = [m for m in file_proto.message_type if m.name == "ServerInfo"]
    kept = [f for f in message.field if f.number <= 8]
    del message.field[:]
    message.field.extend(kept)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_proto)
    old_type = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("old.training.dataplane.v1.ServerInfo")
    )
    new = pb.ServerInfo(
        num_samples=96, recipes=["standard"], workers=3, busy_s=1.5, uptime_s=9.0, active_streams=2
    )
    old: Any = old_type.FromString(new.SerializeToString())
    assert (old.num_samples, list(old.recipes), old.workers) == (96, ["standard"], 3)
    # And what an old server sends reads as no load here.
    from_old = pb.ServerInfo.FromString(old_type(num_samples=96, workers=3).SerializeToString())
    assert (from_old.num_samples, from_old.workers) == (96, 3)
    assert (from_old.busy_s, from_old.uptime_s, from_old.active_streams) == (0.0, 0.0, 0)


# ---- the meters on a fake clock --------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pool_load_counts_the_share_of_workers_busy() -> None:
    clock = FakeClock()
    load = PoolLoad(2, clock=clock)
    a: Future[None] = Future()
    b: Future[None] = Future()
    c: Future[None] = Future()
    load.track(a)
    clock.now += 1.0  # one of two workers: 0.5
    load.track(b)
    load.track(c)
    clock.now += 2.0  # three batches for two workers: all of it, 2.0
    a.set_result(None)
    b.cancel()
    clock.now += 1.0  # one left: 0.5
    assert load.in_flight == 1
    assert load.busy_s() == pytest.approx(3.0)
    c.set_result(None)
    clock.now += 5.0  # idle
    assert load.busy_s() == pytest.approx(3.0) and load.in_flight == 0
    done: Future[None] = Future()
    done.set_result(None)
    load.track(done)  # a batch done when submitted (premade) costs nothing
    assert load.in_flight == 0 and load.busy_s() == pytest.approx(3.0)


def test_pool_load_without_workers_counts_one() -> None:
    clock = FakeClock()
    load = PoolLoad(0, clock=clock)
    f: Future[None] = Future()
    load.track(f)
    clock.now += 2.0
    f.set_result(None)
    assert load.busy_s() == pytest.approx(2.0)


def test_throttle_books_one_pipeline_and_counts_its_busy_time() -> None:
    clock = FakeClock()
    throttle = ImageRateThrottle(10.0, clock=clock)
    assert throttle.reserve(5) == pytest.approx(100.5)
    assert throttle.reserve(10) == pytest.approx(101.5)  # queued behind the first
    assert throttle.busy_s() == 0.0  # booked, not yet spent
    clock.now = 101.0
    assert throttle.busy_s() == pytest.approx(1.0)
    clock.now = 103.0  # idle since 101.5
    assert throttle.busy_s() == pytest.approx(1.5)
    assert throttle.reserve(20) == pytest.approx(105.0)  # starts now, not at 101.5
    clock.now = 110.0
    assert throttle.busy_s() == pytest.approx(3.5)


# ---- real servers ----------------------------------------------------------------------------


def test_throttled_server_delivers_at_its_rate_and_reports_itself_busy(
    start_server: Callable[..., tuple[grpc.Server, str]],
) -> None:
    rate, images = 400.0, 320  # 0.8 s of work
    _, address = start_server(max_images_per_s=rate)
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.DataPlaneStub(ch)
        before = stub.GetInfo(pb.GetInfoRequest(), timeout=5)
        request = pb.StreamBatchesRequest(stop=images, batch_size=16, image_size=_SIZE)
        t0 = time.monotonic()
        batches = list(stub.StreamBatches(request, timeout=20))
        elapsed = time.monotonic() - t0
        after = stub.GetInfo(pb.GetInfoRequest(), timeout=5)
    assert sum(len(b.sample_ids) for b in batches) == images
    assert elapsed >= 0.9 * images / rate
    assert elapsed < images / rate + 3.0
    busy = (after.busy_s - before.busy_s) / (after.uptime_s - before.uptime_s)
    assert 0.75 <= busy <= 1.0 + 1e-6
    assert after.busy_s == pytest.approx(images / rate, rel=0.01)


def test_idle_server_reports_no_load_and_its_uptime(
    start_server: Callable[..., tuple[grpc.Server, str]],
) -> None:
    _, address = start_server()
    first = _info(address)
    time.sleep(0.3)
    second = _info(address)
    assert first.uptime_s > 0 and second.uptime_s >= first.uptime_s + 0.25
    assert second.busy_s == 0.0 and second.active_streams == 0


def test_worker_pool_load_stays_within_capacity(channel: grpc.Channel) -> None:
    """Augmenting server (2 worker threads): the load grows with work, never past the uptime."""
    stub = pb_grpc.DataPlaneStub(channel)
    request = pb.StreamBatchesRequest(stop=96, batch_size=8)
    assert len(list(stub.StreamBatches(request, timeout=30))) == 12
    info = stub.GetInfo(pb.GetInfoRequest(), timeout=5)
    assert 0.0 < info.busy_s <= info.uptime_s and info.workers == 2


def test_active_streams_counts_a_running_stream(
    start_server: Callable[..., tuple[grpc.Server, str]],
) -> None:
    _, address = start_server(max_images_per_s=50.0)  # 512 images: 10 s, cancelled long before
    with grpc.insecure_channel(address) as ch:
        call = pb_grpc.DataPlaneStub(ch).StreamBatches(
            pb.StreamBatchesRequest(stop=512, batch_size=8, image_size=_SIZE), timeout=20
        )
        try:
            assert len(next(iter(call)).sample_ids) == 8
            assert _info(address).active_streams == 1
        finally:
            call.cancel()  # type: ignore[attr-defined]
    assert _wait_until(lambda: _info(address).active_streams == 0, timeout_s=5)


def test_server_pool_reports_the_loads_of_serving_servers(
    start_server: Callable[..., tuple[grpc.Server, str]],
) -> None:
    _, kept = start_server()
    stopped_server, stopped = start_server()
    pool = ServerPool(StaticServers([kept, stopped]), refresh_s=60.0)
    try:
        pool.start()
        assert pool.wait(lambda: len(pool.serving()) == 2, timeout_s=10)
        loads = pool.server_loads(timeout_s=2.0)
        assert sorted(loads) == sorted([kept, stopped])
        for busy_s, uptime_s in loads.values():
            assert busy_s == 0.0 and uptime_s > 0
        stopped_server.stop(0).wait()
        # Still listed as serving (the next check is a minute away); its call fails: left out.
        assert pool.is_serving(stopped)
        t0 = time.monotonic()
        later = pool.server_loads(timeout_s=1.0)
        assert time.monotonic() - t0 < 3.0
        assert list(later) == [kept] and later[kept][1] > loads[kept][1]
    finally:
        pool.close()
    with pytest.raises(ValueError, match="timeout_s must be a positive"):
        pool.server_loads(timeout_s=0)


# ---- a bad rate is refused -------------------------------------------------------------------


@pytest.mark.parametrize("rate", [0.0, -5.0, math.nan, math.inf])
def test_bad_rate_is_refused_by_the_server(
    small_source: AugmentingBatchSource, rate: float
) -> None:
    message = "max_images_per_s must be a positive, finite number of images per second"
    with pytest.raises(ValueError, match=message):
        check_images_per_s(rate)
    with pytest.raises(ValueError, match=message):
        create_server(small_source, port=0, max_images_per_s=rate)
    with pytest.raises(ValueError, match=message):
        DataPlaneServicer(
            small_source,
            lambda _: None,
            memory_budget=ByteBudget(MB),
            max_images_per_s=rate,
        )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetero serve")
    serve_cli.add_arguments(parser)
    return parser


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "fast"])
def test_bad_rate_is_refused_on_the_command_line(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["--max-images-per-s", text])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--max-images-per-s" in err
    assert f"must be a positive, finite number of images per second, got {text!r}" in err


def test_rate_from_the_environment_and_the_command_line_wins(
    spec_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    got: list[float | None] = []

    def fake_serve(spec: object, **kwargs: object) -> int:
        got.append(kwargs["max_images_per_s"])  # type: ignore[arg-type]
        return 0

    monkeypatch.setattr("training.dataplane.server.serve", fake_serve)
    args = ["--spec", str(spec_path), "--port", "0"]
    monkeypatch.delenv(ENV_MAX_IMAGES_PER_S, raising=False)
    assert serve_cli.run(_parser().parse_args(args)) == 0
    monkeypatch.setenv(ENV_MAX_IMAGES_PER_S, "250")
    assert serve_cli.run(_parser().parse_args(args)) == 0
    assert serve_cli.run(_parser().parse_args([*args, "--max-images-per-s", "40"])) == 0
    assert got == [None, 250.0, 40.0]
    monkeypatch.setenv(ENV_MAX_IMAGES_PER_S, "-3")
    assert serve_cli.run(_parser().parse_args(args)) == 2
    assert f"{ENV_MAX_IMAGES_PER_S} must be a positive" in capsys.readouterr().err
    assert got == [None, 250.0, 40.0]


def test_throttle_is_shared_by_the_streams_of_a_server(
    start_server: Callable[..., tuple[grpc.Server, str]],
) -> None:
    """Two streams at once share one pipeline: together they take the time of their sum."""
    rate, images = 400.0, 160
    _, address = start_server(max_images_per_s=rate)
    counts: list[int] = []
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.DataPlaneStub(ch)

        def read(start: int) -> None:
            request = pb.StreamBatchesRequest(
                start=start, stop=start + images, batch_size=16, image_size=_SIZE
            )
            counts.append(sum(len(b.sample_ids) for b in stub.StreamBatches(request, timeout=20)))

        threads = [threading.Thread(target=read, args=(s,)) for s in (0, images)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        elapsed = time.monotonic() - t0
    assert counts == [images, images]
    assert elapsed >= 0.9 * 2 * images / rate
