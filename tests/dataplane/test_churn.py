"""The client under churn, against real ``hetero serve`` processes found through a discovery
file: a server that joins mid-epoch, one killed and back at a new address, all gone for a few
seconds; two trainer ranks get every sample of the epoch exactly once in each; and the batch
order is the same, byte for byte, with one server, three, and three with one killed."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from training.dataplane.client import DataPlaneClient
from training.dataplane.discovery import FileServers
from training.dataplane.processes import ServerProcess, start_server_process

SAMPLES = 480
BATCH = 8
RANKS = 2
PER_RANK = SAMPLES // RANKS


class Fleet:
    """Data server processes and the discovery file that says which of them exist."""

    def __init__(self, spec: Path, listing: Path) -> None:
        self.spec = spec
        self.listing = listing
        self.servers: list[ServerProcess] = []
        self.list()

    def start(self, n: int) -> list[ServerProcess]:
        with ThreadPoolExecutor(n) as pool:
            started = list(pool.map(lambda _: start_server_process(self.spec, workers=1), range(n)))
        self.servers += started
        return started

    def list(self, *servers: ServerProcess) -> None:
        """Write the discovery file atomically (a reader never sees half of it)."""
        tmp = self.listing.with_suffix(".tmp")
        tmp.write_text("".join(f"{s.address}\n" for s in servers))
        tmp.replace(self.listing)

    def kill(self, server: ServerProcess) -> None:
        server.process.send_signal(signal.SIGKILL)
        assert server.process.wait(timeout=10) == -signal.SIGKILL

    def close(self) -> None:
        for s in self.servers:
            if s.process.poll() is None:
                s.process.terminate()
        for s in self.servers:
            try:
                s.process.wait(timeout=15)
            except Exception:
                s.process.kill()
                s.process.wait()


@pytest.fixture
def fleet(tmp_path: Path, make_spec: Callable[[Path, int], Path]) -> Iterator[Fleet]:
    f = Fleet(make_spec(tmp_path / "spec.toml", SAMPLES), tmp_path / "servers.txt")
    try:
        yield f
    finally:
        f.close()


def _client(fleet: Fleet, share: tuple[int, int] | None = None) -> DataPlaneClient:
    return DataPlaneClient(
        FileServers(fleet.listing),
        batch_size=BATCH,
        num_samples=SAMPLES,
        seed=11,
        share=share,
        refresh_s=0.2,
        backoff_s=0.05,
        max_backoff_s=0.5,
        rpc_timeout_s=30,
        wait_for_data_s=60,
    )


class Ranks:
    """Two trainer ranks, each a client over the fleet with its own block of the epoch, run in
    threads; ``on_batch(n)`` runs in rank 0 after its n-th batch (the test's fault injection)."""

    def __init__(self, fleet: Fleet) -> None:
        self.clients = [_client(fleet, (r * PER_RANK, (r + 1) * PER_RANK)) for r in range(RANKS)]
        self.ids: list[list[int]] = [[] for _ in range(RANKS)]
        self.longest_wait_s = [0.0] * RANKS
        self.errors: list[BaseException] = []

    def run(self, on_batch: Callable[[int], None], pace_s: float = 0.05) -> None:
        def rank(r: int) -> None:
            try:
                last = time.monotonic()
                for n, batch in enumerate(self.clients[r].iter_epoch(0), 1):
                    now = time.monotonic()
                    self.longest_wait_s[r] = max(self.longest_wait_s[r], now - last)
                    self.ids[r] += batch.sample_ids.tolist()
                    if r == 0:
                        on_batch(n)
                    time.sleep(pace_s)  # a trainer step
                    last = time.monotonic()
            except BaseException as e:
                self.errors.append(e)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(RANKS)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            assert not any(t.is_alive() for t in threads), "a rank did not finish its epoch"
        finally:
            for c in self.clients:
                c.close()
        assert not self.errors, self.errors

    def served(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for c in self.clients:
            total.update(c.batches_by_server)
        return total

    def assert_exactly_once(self) -> None:
        for r, ids in enumerate(self.ids):
            repeated = [i for i, c in Counter(ids).items() if c > 1]
            assert not repeated, f"rank {r} got sample ids twice: {repeated}"
            assert len(ids) == PER_RANK, f"rank {r} got {len(ids)} samples, not {PER_RANK}"
        assert set(self.ids[0]).isdisjoint(self.ids[1])
        assert sorted(self.ids[0] + self.ids[1]) == list(range(SAMPLES))


def test_server_added_mid_epoch_takes_ranges(fleet: Fleet) -> None:
    a, b = fleet.start(2)
    fleet.list(a)
    ranks = Ranks(fleet)
    before: Counter[str] = Counter()

    def on_batch(n: int) -> None:
        if n == 4:
            before.update(ranks.served())
            fleet.list(a, b)

    ranks.run(on_batch)
    ranks.assert_exactly_once()
    assert before[b.address] == 0 and before[a.address] >= 4
    served = ranks.served()
    assert served[b.address] > 0, f"the joining server got no range: {dict(served)}"
    assert served[a.address] + served[b.address] == SAMPLES // BATCH


def test_server_killed_and_back_at_a_new_address(fleet: Fleet) -> None:
    a, b, b_again = fleet.start(3)
    fleet.list(a, b)
    ranks = Ranks(fleet)

    def on_batch(n: int) -> None:
        if n == 4:
            fleet.kill(b)  # mid-range: its unreceived batches go back to the pool
            fleet.list(a, b_again)

    ranks.run(on_batch)
    ranks.assert_exactly_once()
    served = ranks.served()
    assert served[b_again.address] > 0, f"the replacement got no range: {dict(served)}"
    assert sum(served.values()) == SAMPLES // BATCH


def test_all_servers_gone_then_one_returns(fleet: Fleet) -> None:
    a, replacement = fleet.start(2)
    fleet.list(a)
    ranks = Ranks(fleet)
    gap_s = 3.0
    timer = threading.Timer(gap_s, lambda: fleet.list(replacement))

    def on_batch(n: int) -> None:
        if n == 4:
            fleet.kill(a)
            fleet.list()  # no server at all
            timer.start()

    try:
        ranks.run(on_batch)
    finally:
        timer.cancel()
    # Both ranks waited (no exception) and finished the epoch once a server came back.
    ranks.assert_exactly_once()
    assert min(ranks.longest_wait_s) > gap_s * 0.6, ranks.longest_wait_s
    assert ranks.served()[replacement.address] > 0


def _epoch(fleet: Fleet, on_batch: Callable[[int], None] = lambda n: None) -> tuple[list, Counter]:
    client = _client(fleet)
    out = []
    try:
        for n, batch in enumerate(client.iter_epoch(0), 1):
            out.append(
                (batch.sample_ids.tolist(), batch.images.numpy().tobytes(), batch.labels.tolist())
            )
            on_batch(n)
            time.sleep(0.02)
        return out, client.batches_by_server
    finally:
        client.close()


def test_same_bytes_in_the_same_order_with_one_three_and_a_killed_server(fleet: Fleet) -> None:
    a, b, c = fleet.start(3)
    fleet.list(a)
    one, _ = _epoch(fleet)
    fleet.list(a, b, c)
    three, served = _epoch(fleet)
    assert len([s for s in served.values() if s]) >= 2, f"one server did all: {dict(served)}"

    def kill_c(n: int) -> None:
        if n == 5:
            fleet.kill(c)

    killed, served = _epoch(fleet, kill_c)
    assert len(one) == SAMPLES // BATCH
    assert sorted(i for ids, _, _ in one for i in ids) == list(range(SAMPLES))
    for name, run in (("three servers", three), ("three, one killed", killed)):
        assert len(run) == len(one), name
        for k, (x, y) in enumerate(zip(one, run, strict=True)):
            assert x == y, f"{name}: batch {k} differs from the one-server run"
