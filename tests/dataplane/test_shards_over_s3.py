"""A prepared dataset (``source = "shards"``) served by real ``hetero serve`` processes from
moto's S3 behind a loopback HTTP proxy that adds 30 ms to every request (as a remote S3 would):
two trainer ranks get every sample of the epoch exactly once, with far fewer requests than
samples (the proxy counts them), a data-wait share under 5% at the pace of a trainer step, and
the same batches, byte for byte, from one server, three, and three with one SIGKILLed."""

from __future__ import annotations

import http.client
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import aws_calls
import boto3
import pytest
from realdata import DigitsFolders, write_digits
from shards_support import Prepared, write_prepared

from training.common.names import ENV_SHARD_CACHE_DIR
from training.dataplane.client import DataPlaneClient
from training.dataplane.discovery import FileServers
from training.dataplane.processes import ServerProcess, start_server_process

LATENCY_S = 0.030
BATCH = 8
PER_SHARD = 100
STEP_S = 0.04  # the trainer's step, between two batches


class LatencyProxy:
    """Forwards every HTTP request to ``upstream`` after ``delay_s``; counts them by method and
    path (one line per request, whatever the connection)."""

    def __init__(self, upstream: tuple[str, int], delay_s: float) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()
        lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _forward(self) -> None:
                with lock:
                    proxy.requests[(self.command, self.path.split("?")[0])] += 1
                time.sleep(delay_s)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection(*upstream, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def gets(self, suffix: str) -> int:
        return sum(n for (m, p), n in self.requests.items() if m == "GET" and p.endswith(suffix))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


SPEC = """
name = "shards-over-s3"
[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge"]
count = 1
[[groups]]
name = "dataprep"
role = "dataprep"
instance_types = ["c6i.4xlarge"]
count = 3
[job]
batch_size = 8
augmentation = "standard"
[job.dataset]
source = "shards"
path = "s3://data/digits/"
image_size = 16
shuffle_shards = 4
[job.dataplane]
workers_per_server = 1
"""


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> DigitsFolders:
    return write_digits(tmp_path_factory.mktemp("digits"), val_every=5, size=16)


@pytest.fixture(scope="module")
def prepared(digits: DigitsFolders, tmp_path_factory: pytest.TempPathFactory) -> Prepared:
    """The 1,437 training digits in 15 shards of 100."""
    root = tmp_path_factory.mktemp("shards")
    return write_prepared(root, {"train": digits.train_dir}, per_shard=PER_SHARD)


@pytest.fixture(scope="module")
def small(digits: DigitsFolders, tmp_path_factory: pytest.TempPathFactory) -> Prepared:
    """The 360 validation digits as a training split of 8 shards of 45 (three epochs of it
    are enough to compare orders)."""
    root = tmp_path_factory.mktemp("small")
    return write_prepared(root, {"train": digits.val_dir}, per_shard=45)


class Cluster:
    """moto, the proxy in front of it, and data server processes that each have a cache of
    their own (an instance's disk) and reach S3 only through the proxy."""

    def __init__(self, prepared: Prepared, tmp: Path) -> None:
        from moto.server import ThreadedMotoServer

        self.tmp = tmp
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.moto.start()
        host, port = self.moto.get_host_and_port()
        s3 = boto3.client(
            "s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )  # fmt: skip
        s3.create_bucket(Bucket="data")
        for f in prepared.root.iterdir():
            s3.upload_file(str(f), "data", f"digits/{f.name}")
        self.proxy = LatencyProxy((host, port), LATENCY_S)
        self.spec = tmp / "spec.toml"
        self.spec.write_text(SPEC)
        self.listing = tmp / "servers.txt"
        self.servers: list[ServerProcess] = []
        self.list()

    def start(self, n: int) -> list[ServerProcess]:
        env = {
            "AWS_ENDPOINT_URL": self.proxy.url, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
        }  # fmt: skip
        started = []
        for _ in range(n):
            cache = self.tmp / f"instance-{len(self.servers)}"
            cache.mkdir()
            saved = dict(os.environ)
            # The instance's own cache, as its boot provisions it (not TMPDIR: the forkserver's
            # socket lives there, and a deep test folder passes AF_UNIX's 108-byte limit).
            os.environ.update(env, **{ENV_SHARD_CACHE_DIR: str(cache)})
            try:
                started.append(start_server_process(self.spec, workers=1))
            finally:
                os.environ.clear()
                os.environ.update(saved)
            self.servers.append(started[-1])
        return started

    def list(self, *servers: ServerProcess) -> None:
        tmp = self.listing.with_suffix(".tmp")
        tmp.write_text("".join(f"{s.address}\n" for s in servers))
        tmp.replace(self.listing)

    def close(self) -> None:
        for s in self.servers:
            if s.process.poll() is None:
                s.process.kill()
            s.process.wait(timeout=15)
        self.proxy.close()
        self.moto.stop()


@pytest.fixture
def cluster(prepared: Prepared, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(prepared, tmp_path)
    try:
        yield c
    finally:
        c.close()


def _epoch(cluster: Cluster, samples: int, on_batch: Any = None) -> tuple[list[Any], float]:
    """One epoch through a client paced like a trainer; (batches, data-wait share after the
    first batch: the time spent waiting for a batch over the time of the epoch)."""
    client = DataPlaneClient(
        FileServers(cluster.listing), batch_size=BATCH, num_samples=samples, seed=11,
        refresh_s=0.2, backoff_s=0.05, max_backoff_s=0.5, rpc_timeout_s=30, wait_for_data_s=60,
    )  # fmt: skip
    out, waited, started = [], 0.0, None
    try:
        it = iter(client.iter_epoch(0))
        while True:
            t0 = time.monotonic()
            try:
                batch = next(it)
            except StopIteration:
                break
            if started is None:
                started = time.monotonic()  # the first batch: start-up, not steady state
            else:
                waited += time.monotonic() - t0
            out.append((batch.sample_ids.tolist(), batch.images.numpy().tobytes()))
            if on_batch is not None:
                on_batch(len(out))
            time.sleep(STEP_S)
    finally:
        client.close()
    assert started is not None
    return out, waited / (time.monotonic() - started)


def test_an_epoch_from_s3_shards_reads_few_objects_and_keeps_the_trainer_fed(
    cluster: Cluster, prepared: Prepared, record_aws_calls: Callable[..., Path]
) -> None:
    # The data server reads the dataset as it does on a dataprep instance, with its role.
    record_aws_calls(aws_calls.Names(cluster="vit", dataset="s3://data/digits/"), "instance")
    samples = len(prepared.images["train"])
    (server,) = cluster.start(1)
    cluster.list(server)
    batches, wait_share = _epoch(cluster, samples)
    ids = [i for b, _ in batches for i in b]
    assert sorted(ids) == list(range(samples))  # every sample of the epoch exactly once
    shards = len(prepared.manifest.splits["train"].shards)
    shard_gets = cluster.proxy.gets(".tar")
    manifest_gets = cluster.proxy.gets("/manifest.json")
    # Each shard read whole, once, into the server's cache (not one request per sample); the
    # manifest once per process (the server and its one worker).
    assert shard_gets == shards, dict(cluster.proxy.requests)
    assert manifest_gets == 2
    assert sum(cluster.proxy.requests.values()) < samples / 20, dict(cluster.proxy.requests)
    assert wait_share < 0.05, f"data-wait share {wait_share:.1%}"


def test_the_same_bytes_from_one_three_and_a_killed_server(small: Prepared, tmp_path: Path) -> None:
    cluster = Cluster(small, tmp_path)
    try:
        _same_bytes(cluster, len(small.images["train"]))
    finally:
        cluster.close()


def _same_bytes(cluster: Cluster, samples: int) -> None:
    a, b, c = cluster.start(3)
    cluster.list(a)
    one, _ = _epoch(cluster, samples)
    cluster.list(a, b, c)
    three, _ = _epoch(cluster, samples)

    def kill_c(n: int) -> None:
        if n == 5:
            c.process.send_signal(signal.SIGKILL)

    killed, _ = _epoch(cluster, samples, kill_c)
    assert c.process.wait(timeout=10) == -signal.SIGKILL
    assert sorted(i for ids, _ in one for i in ids) == list(range(samples))
    for name, run in (("three servers", three), ("three, one killed", killed)):
        assert len(run) == len(one), name
        for k, (x, y) in enumerate(zip(one, run, strict=True)):
            assert x == y, f"{name}: batch {k} differs from the one-server run"
