"""The memory budget of a real ``hetero serve``: many streams whose clients stop reading make
the server wait, not grow.

Two servers run side by side over the same 224 px dataset, one with a tight budget (64 MB) and
one with a budget that never binds (4096 MB). Each gets 24 streams whose client reads the first
batch and then holds the stream open without reading. The RSS of each server's process tree
(server, forkserver, workers) is sampled meanwhile: the bounded one must stay within its budget
plus ``SLACK_MB``; the unbounded one must grow past that, which shows the bound is what holds the
first one back.

Figures measured on the project's 2-core machine (shared with other work), peak growth of the
process tree over its idle baseline: 37-71 MB with --memory-mb 64; 156-304 MB within 6-12 s with
--memory-mb 4096 (it keeps growing while the workers make batches nobody reads). With a batch's
charge given back as soon as gRPC had taken its message (gRPC still holds about one message per
stream then), the 64 MB server grew 129-136 MB: this test fails on that.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from training.dataplane.processes import ServerProcess, start_server_process
from training.dataplane.rpc import channel_options
from training.dataplane.v1 import dataplane_pb2 as pb
from training.dataplane.v1 import dataplane_pb2_grpc as pb_grpc

MB = 1024 * 1024
TIGHT_MB = 64
LOOSE_MB = 4096
STREAMS = 24
BATCH = 32
BATCHES_PER_STREAM = 8
# Growth beyond the budget that is not batches: per-stream gRPC and Python state, allocator
# slack (freed batches that glibc keeps for reuse), the workers' own buffers.
SLACK_MB = 48
# The streams are held open at least MIN_HOLD_S, then until the unbounded server has clearly
# outgrown the bound (on a slow or busy machine its workers take longer), at most MAX_HOLD_S.
MIN_HOLD_S = 6.0
MAX_HOLD_S = 20.0
SAMPLE_EVERY_S = 0.1

SPEC = """
name = "memory-test"
[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge"]
count = 1
[job]
batch_size = 32
[job.dataset]
source = "synthetic"
num_samples = 2048
num_classes = 10
image_size = 224
"""


def tree_rss(root: psutil.Process) -> int:
    """RSS of ``root`` and all its descendants, in bytes (processes that vanish count 0)."""
    total = 0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total


class HeldStreams:
    """``STREAMS`` StreamBatches calls on one server whose client reads the first message and
    then stops reading; ``close()`` cancels them all."""

    def __init__(self, stubs: list[pb_grpc.DataPlaneStub]) -> None:
        self.calls = [
            stubs[i % len(stubs)].StreamBatches(
                pb.StreamBatchesRequest(seed=i, stop=BATCH * BATCHES_PER_STREAM, batch_size=BATCH),
                timeout=60,
            )
            for i in range(STREAMS)
        ]
        self._threads = [
            threading.Thread(target=self._read_first, args=(call,), daemon=True)
            for call in self.calls
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _read_first(call: grpc.Call) -> None:
        # Ends with CANCELLED at the end of the test if the stream was still waiting then.
        with contextlib.suppress(grpc.RpcError):
            next(call)  # type: ignore[call-overload]

    def close(self) -> None:
        for call in self.calls:
            call.cancel()
        deadline = time.monotonic() + 10
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))


def _warm_up(stub: pb_grpc.DataPlaneStub) -> None:
    """One full-size batch per worker and ``STREAMS`` concurrent tiny streams: the threads, gRPC
    and allocator state that any such load creates are in the baseline, not in the growth."""
    list(stub.StreamBatches(pb.StreamBatchesRequest(stop=2 * BATCH, batch_size=BATCH), timeout=60))

    def tiny(seed: int) -> int:
        request = pb.StreamBatchesRequest(
            seed=seed, stop=2 * BATCH, batch_size=BATCH, image_size=16
        )
        return len(list(stub.StreamBatches(request, timeout=60)))

    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        assert list(pool.map(tiny, range(STREAMS))) == [2] * STREAMS


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[dict[int, ServerProcess]]:
    """A tight-budget and an unbounded ``hetero serve`` (2 workers each), by budget in MB."""
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    started: dict[int, ServerProcess] = {}
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = {
                mb: pool.submit(start_server_process, spec, workers=2, memory_mb=mb)
                for mb in (TIGHT_MB, LOOSE_MB)
            }
            failures: list[BaseException] = []
            for mb, future in futures.items():
                try:
                    started[mb] = future.result()
                except RuntimeError as e:  # the other one is stopped below all the same
                    failures.append(e)
        if failures:
            raise failures[0]
        yield started
    finally:
        for server in started.values():
            if server.process.poll() is None:
                try:
                    with grpc.insecure_channel(server.address) as ch:
                        pb_grpc.DataPlaneStub(ch).Shutdown(
                            pb.ShutdownRequest(grace_s=1.0), timeout=5
                        )
                except grpc.RpcError:
                    pass  # stop() below terminates it
        for server in started.values():
            server.stop(timeout_s=15)


def test_tight_budget_bounds_server_memory(servers: dict[int, ServerProcess]) -> None:
    # Half the streams come from a client like the trainer's (HTTP/2 BDP probing: receive
    # windows of several MB, so gRPC lets batches go ahead of the reader and keeps about one
    # sent message per stream); half from a client with small windows (unread batches stay in
    # the server).
    options = [channel_options(), [*channel_options(), ("grpc.http2.bdp_probe", 0)]]
    channels = {
        mb: [grpc.insecure_channel(s.address, options=o) for o in options]
        for mb, s in servers.items()
    }
    held: list[HeldStreams] = []
    try:
        stubs = {mb: [pb_grpc.DataPlaneStub(ch) for ch in chs] for mb, chs in channels.items()}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(_warm_up, [s[0] for s in stubs.values()]))
        roots = {mb: psutil.Process(s.process.pid) for mb, s in servers.items()}
        time.sleep(0.5)
        baseline = {mb: tree_rss(root) for mb, root in roots.items()}
        growth = dict.fromkeys(roots, 0)
        held = [HeldStreams(stub) for stub in stubs.values()]
        bound = (TIGHT_MB + SLACK_MB) * MB
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) < MAX_HOLD_S:
            for mb, root in roots.items():
                growth[mb] = max(growth[mb], tree_rss(root) - baseline[mb])
            if elapsed >= MIN_HOLD_S and growth[LOOSE_MB] > 1.5 * bound:
                break
            time.sleep(SAMPLE_EVERY_S)
    finally:
        for streams in held:
            streams.close()
        for chs in channels.values():
            for ch in chs:
                ch.close()
    figures = {mb: f"{g / MB:.0f} MB" for mb, g in growth.items()}
    print(f"RSS growth of each server's process tree, by --memory-mb: {figures}")  # for -s
    assert growth[TIGHT_MB] < bound, f"growth by budget (MB): {figures}"
    assert growth[LOOSE_MB] > bound, f"the unbounded server did not outgrow the bound: {figures}"


def test_serve_refuses_a_negative_memory_budget(spec_path: Path) -> None:
    cmd = [sys.executable, "-m", "training.cli", "serve", "--spec", str(spec_path)]
    done = subprocess.run(
        [*cmd, "--port", "0", "--memory-mb", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--memory-mb must be 0 (derived from the host's memory) or more, got -1" in done.stderr
