"""The client against real servers: exactly-once epochs, failover, resume, unreachable servers."""

from __future__ import annotations

import signal
import socket
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from training.data.batch import Batch, Unreadable
from training.data.loader import local_loader
from training.data.order import epoch_order
from training.dataplane.client import (
    DataPlaneClient,
    DataPlaneError,
    DataPlaneUnavailable,
    Intervals,
)
from training.dataplane.processes import ServerProcess, start_server_process
from training.dataplane.server import create_server
from training.dataplane.sources import AugmentingBatchSource, PremadeBatchSource
from training.spec import DatasetSource, DatasetSpec, JobSpec


def _ids(batches: list[Batch]) -> list[int]:
    return [i for b in batches for i in b.sample_ids.tolist()]


def test_epoch_delivers_every_sample_once(two_servers: list[str]) -> None:
    with DataPlaneClient(two_servers, batch_size=8, seed=3, chunk_batches=2) as client:
        assert client.wait_for_servers(timeout_s=10) == two_servers
        batches = list(client.iter_epoch(0))
    assert sorted(_ids(batches)) == list(range(96))
    b = batches[0]
    assert b.images.dtype.is_floating_point is False and b.images.shape[1:] == (3, 32, 32)
    assert (b.labels == b.sample_ids % 10).all()


def test_shares_split_the_epoch_between_clients(two_servers: list[str]) -> None:
    # Two trainer ranks, each with its own client over both servers and its own block.
    ids = []
    for share in ((0, 48), (48, 96)):
        with DataPlaneClient(two_servers, batch_size=8, seed=3, share=share) as client:
            got = _ids(list(client.iter_epoch(0)))
        assert len(got) == 48
        ids.append(got)
    assert not set(ids[0]) & set(ids[1])
    assert sorted(ids[0] + ids[1]) == list(range(96))
    with pytest.raises(ValueError, match="stop > start"):
        DataPlaneClient(two_servers, batch_size=8, share=(10, 10))
    beyond = DataPlaneClient(two_servers, batch_size=8, share=(0, 200))
    with pytest.raises(DataPlaneError, match="beyond the epoch's 96 samples"):
        list(beyond.iter_epoch(0))
    beyond.close()


def test_state_restore_resumes_without_loss_or_repeat(two_servers: list[str]) -> None:
    first = DataPlaneClient(two_servers, batch_size=8, seed=5, prefetch_batches=3)
    seen: list[Batch] = []
    for batch in first.iter_epoch(2):
        seen.append(batch)
        if len(seen) == 5:
            break
    state = first.state_dict()
    first.close()
    assert state["epoch"] == 2 and Intervals([list(s) for s in state["consumed"]]).total() == 40

    second = DataPlaneClient(two_servers, batch_size=8, seed=5)
    second.load_state_dict(state)
    rest = list(second)
    assert second.epoch == 3  # iterating the restored epoch to its end moves to the next
    second.close()
    ids = _ids(seen) + _ids(rest)
    assert sorted(ids) == list(range(96))

    mismatched = DataPlaneClient(two_servers, batch_size=8, seed=6)
    with pytest.raises(ValueError, match="seed 5"):
        mismatched.load_state_dict(state)
    mismatched.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_no_server_reachable_is_a_clear_error() -> None:
    address = f"127.0.0.1:{_free_port()}"
    client = DataPlaneClient(
        [address], batch_size=4, num_samples=16, backoff_s=0.05, wait_for_data_s=1.5
    )
    with pytest.raises(DataPlaneUnavailable, match="no data server is reachable") as err:
        client.wait_for_servers(timeout_s=1.0)
    assert address in str(err.value) and "UNAVAILABLE" in str(err.value)
    # Iterating waits (bounded by wait_for_data_s), then names the address and its error.
    with pytest.raises(DataPlaneUnavailable, match="no batch for position 0 of epoch 0") as err:
        list(client.iter_epoch(0))
    assert address in str(err.value) and "UNAVAILABLE" in str(err.value)
    assert "wait_for_data_s" in str(err.value)
    client.close()


def test_killing_one_of_two_server_processes_loses_and_repeats_nothing(spec_path: Path) -> None:
    servers: list[ServerProcess] = [start_server_process(spec_path, workers=1) for _ in range(2)]
    try:
        client = DataPlaneClient(
            [s.address for s in servers],
            batch_size=8,
            prefetch_batches=2,
            chunk_batches=3,
            rpc_timeout_s=30,
            backoff_s=0.05,
        )
        client.wait_for_servers(timeout_s=60)
        ids: list[int] = []
        per_batch: list[int] = []
        for batch in client.iter_epoch(0):
            ids += batch.sample_ids.tolist()
            per_batch.append(len(batch))
            if len(per_batch) == 6:
                servers[0].process.send_signal(signal.SIGKILL)
        repeated = [i for i, c in Counter(ids).items() if c > 1]
        assert not repeated, f"repeated sample ids: {repeated}"
        assert sorted(ids) == list(range(400))
        assert servers[0].process.wait(timeout=10) == -signal.SIGKILL
        # The survivor takes the Shutdown RPC and `hetero serve` exits 0.
        assert client.shutdown_servers(grace_s=1.0) == [servers[1].address]
        assert servers[1].stop(timeout_s=30) == 0
        client.close()
    finally:
        for s in servers:
            if s.process.poll() is None:
                s.process.kill()
                s.process.wait()


def test_server_of_another_dataset_is_not_admitted(two_servers: list[str]) -> None:
    other = PremadeBatchSource(64, image_size=32, max_batch=8, num_classes=10)
    server, port = create_server(other, port=0)
    odd = f"127.0.0.1:{port}"
    try:
        with DataPlaneClient([*two_servers, odd], batch_size=8, num_samples=96) as client:
            assert client.wait_for_servers(timeout_s=3, settle_s=1) == two_servers
            assert "serves 64 samples, the job has 96" in client.pool.errors()[odd]
            assert sorted(_ids(list(client.iter_epoch(0)))) == list(range(96))
            assert client.batches_by_server[odd] == 0
    finally:
        server.stop(0).wait()


def test_batch_of_unreadable_samples_keeps_its_slot(tmp_path: Path) -> None:
    """Batch size 1: each broken file is a batch with no image. It is still yielded, so every
    rank counts the same batches per epoch (a rank short of one would hang the last step)."""
    for cls in ("cat", "dog"):
        (tmp_path / cls).mkdir()
        for i in range(4):
            Image.new("RGB", (40, 40), (30 * i, 90, 10)).save(tmp_path / cls / f"{i}.png")
    for name in ("cat/broken.png", "dog/broken.jpg"):
        (tmp_path / name).write_bytes(b"not an image")
    source = AugmentingBatchSource(
        DatasetSpec(source=DatasetSource.FOLDER, path=str(tmp_path), image_size=32),
        workers=1,
        processes=False,
    )
    server, port = create_server(source, port=0)
    try:
        counts = []
        for share in ((0, 5), (5, 10)):
            with DataPlaneClient([f"127.0.0.1:{port}"], batch_size=1, share=share) as client:
                batches = list(client.iter_epoch(0))
                counts.append([len(b) for b in batches])
                assert client.skipped_samples == counts[-1].count(0)
    finally:
        server.stop(0).wait()
        source.close()
    assert [len(c) for c in counts] == [5, 5]
    assert sum(c.count(0) for c in counts) == 2 and sum(map(sum, counts)) == 8


def test_unreadable_samples_reach_the_trainer_by_name_on_both_data_paths(tmp_path: Path) -> None:
    """A zero-byte ``.png`` and a text file named ``.jpg`` among valid images: the batch from a
    data server (through the client) and the local loader's batch name exactly those two, with
    why, and deliver every other sample."""
    for cls in ("cat", "dog"):
        (tmp_path / cls).mkdir()
        for i in range(3):
            Image.new("RGB", (40, 40), (30 * i, 90, 10)).save(tmp_path / cls / f"{i}.png")
    (tmp_path / "cat" / "empty.png").write_bytes(b"")
    (tmp_path / "dog" / "notes.jpg").write_text("a text file, not an image\n")
    # Classes sorted, then files: cat/0..2.png, cat/empty.png, dog/0..2.png, dog/notes.jpg.
    expected = {
        3: Unreadable(3, str(tmp_path / "cat" / "empty.png"), "not a readable image: empty file"),
        7: Unreadable(
            7,
            str(tmp_path / "dog" / "notes.jpg"),
            "not a readable image: not an image: no image format recognises its bytes",
        ),
    }
    order = epoch_order(5, 0, 8).tolist()
    skipped = tuple(expected[i] for i in order if i in expected)
    delivered = [i for i in order if i not in expected]
    dataset = DatasetSpec(source=DatasetSource.FOLDER, path=str(tmp_path), image_size=32)
    source = AugmentingBatchSource(dataset, workers=1, processes=False)
    server, port = create_server(source, port=0)
    try:
        with DataPlaneClient([f"127.0.0.1:{port}"], batch_size=8, seed=5) as client:
            remote = list(client.iter_epoch(0))
            assert client.skipped_samples == 2
    finally:
        server.stop(0).wait()
        source.close()
    job = JobSpec(batch_size=8, seed=5, dataset=dataset)
    local = list(local_loader(job, rank=0, world_size=1, epoch=0, num_workers=0))
    for batches in (remote, local):
        assert len(batches) == 1
        assert batches[0].skipped == skipped
        assert batches[0].sample_ids.tolist() == delivered
