"""The trainer on the real data plane: gRPC servers on 127.0.0.1, disjoint rank shares, job end."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from training.common.outcome import EXIT_STOPPED
from training.data.augment import AugmentedSamples
from training.data.batch import Unreadable
from training.dataplane.processes import start_server_process
from training.dataplane.server import create_server
from training.dataplane.sources import BatchWork, PremadeBatchSource
from training.spec import load_spec
from training.trainer.config import TrainerConfig
from training.trainer.remote import DataPlaneBatches
from training.trainer.sample_log import read_sample_log
from training.trainer.stream import EndOfData
from training.trainer.train import Trainer

from .conftest import load_params, write_spec

SAMPLES = 64


@pytest.fixture
def servers() -> Iterator[list[tuple[grpc.Server, str]]]:
    started = []
    for _ in range(2):
        source = PremadeBatchSource(SAMPLES, image_size=32, max_batch=8, num_classes=10)
        server, port = create_server(source, port=0)
        started.append((server, f"127.0.0.1:{port}"))
    yield started
    for server, _ in started:
        server.stop(0)


def config(
    tmp_path: Path,
    addresses: list[str],
    epochs: int | None = None,
    *,
    max_unreadable: float | None = None,
) -> TrainerConfig:
    spec = write_spec(tmp_path, batch_size=4, steps=5)
    if epochs is not None:
        spec.write_text(spec.read_text().replace("steps = 5", f"epochs = {epochs}"))
    if max_unreadable is not None:
        spec.write_text(
            spec.read_text().replace(
                "[job.dataset]\n", f"[job.dataset]\nmax_unreadable = {max_unreadable}\n"
            )
        )
    run_dir = tmp_path / "run"
    return TrainerConfig.from_spec(load_spec(spec), run_dir=run_dir, data_servers=addresses)


def test_ranks_get_disjoint_shares_of_each_epoch(tmp_path: Path, servers) -> None:
    cfg = config(tmp_path, [a for _, a in servers], epochs=1)
    seen: list[list[int]] = []
    for rank in range(2):
        stream = DataPlaneBatches(cfg, rank=rank, world_size=2)
        ids: list[int] = []
        with pytest.raises(EndOfData):
            while True:
                ids += stream.next().sample_ids.tolist()
        assert stream.batches_per_epoch == 8
        stream.close(job_done=False)
        seen.append(ids)
    assert len(seen[0]) == len(seen[1]) == SAMPLES // 2
    assert set(seen[0]).isdisjoint(seen[1]) and set(seen[0]) | set(seen[1]) == set(range(SAMPLES))


def test_training_from_data_servers_ends_them_at_job_end(tmp_path: Path, servers) -> None:
    trainer = Trainer(config(tmp_path, [a for _, a in servers]))
    try:
        assert trainer.train() == 0
    finally:
        trainer.close()
    assert trainer.summary["steps"] == 5 and trainer.summary["stopped_by"] == "steps"
    # rank 0 sent Shutdown: every server stops by itself.
    for server, address in servers:
        # grpc's wait_for_termination returns True when it timed out.
        assert not server.wait_for_termination(timeout=10), f"{address} still running"


class _SampleZeroUnreadable(PremadeBatchSource):
    """Premade batches, except that the batch holding sample 0 comes back with every sample
    skipped (as when all its files are unreadable)."""

    def submit(self, work: BatchWork) -> Future[AugmentedSamples]:
        if 0 not in work.indices:
            return super().submit(work)
        empty = np.empty((0, 3, self.image_size, self.image_size), dtype=np.uint8)
        none = np.empty(0, dtype=np.int64)
        future: Future[AugmentedSamples] = Future()
        skipped = [Unreadable(i, f"synthetic:{i}", "not a readable image") for i in work.indices]
        future.set_result(AugmentedSamples(empty, none, none, skipped))
        return future


def test_batch_of_unreadable_samples_still_takes_a_step(tmp_path: Path) -> None:
    source = _SampleZeroUnreadable(SAMPLES, image_size=32, max_batch=8, num_classes=10)
    server, port = create_server(source, port=0)
    try:
        # 4 of the epoch's samples unreadable: more than the default share a job accepts.
        cfg = config(tmp_path, [f"127.0.0.1:{port}"], epochs=1, max_unreadable=0.5)
        trainer = Trainer(cfg)
        try:
            assert trainer.train() == 0
        finally:
            trainer.close()
    finally:
        server.stop(0)
    # Every batch of the epoch took its step, the empty one included (ranks agree on the
    # count), and its zero-weighted loss left the model finite.
    assert trainer.summary["steps"] == SAMPLES // 4 and trainer.summary["stopped_by"] == "epochs"
    assert math.isfinite(trainer.summary["final_loss"])
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_resume_on_three_servers_equals_an_uninterrupted_run_on_one(tmp_path: Path) -> None:
    """Real `hetero serve` processes (seeded augmentation in worker processes): 3 steps on three
    servers, a restart on three others (new addresses), 3 more steps, ends with the same
    weights, bit for bit, as 6 steps on one server. (Each run that reaches its step count ends
    the job: it shuts its servers down, so every run gets its own.)"""
    runs = {name: tmp_path / name for name in ("one", "three")}
    specs = {}
    for name, folder in runs.items():
        folder.mkdir()
        specs[name] = write_spec(folder, batch_size=4, steps=6, interval=100)
    with ThreadPoolExecutor(7) as pool:
        servers = list(pool.map(lambda _: start_server_process(specs["one"], workers=1), range(7)))
    try:

        def train(name: str, addresses: list[str], steps: int) -> Trainer:
            cfg = TrainerConfig.from_spec(
                load_spec(specs[name]), run_dir=runs[name] / "run", data_servers=addresses,
                steps=steps,
            )  # fmt: skip
            trainer = Trainer(cfg)
            try:
                assert trainer.train() == 0
            finally:
                trainer.close()
            return trainer

        train("one", [servers[0].address], 6)
        train("three", [s.address for s in servers[1:4]], 3)
        resumed = train("three", [s.address for s in servers[4:7]], 6)
        assert resumed.restored is not None and resumed.restored.step == 3
        served = resumed.stream.client.batches_by_server  # type: ignore[attr-defined]
        assert sum(1 for n in served.values() if n) >= 2, served
        # Every run ended the job: its servers took the Shutdown RPC and exited 0.
        assert [s.stop(timeout_s=30) for s in servers] == [0] * 7
    finally:
        for s in servers:
            if s.process.poll() is None:
                s.process.kill()
                s.process.wait()
    one = load_params(runs["one"] / "checkpoints" / "step-6")
    three = load_params(runs["three"] / "checkpoints" / "step-6")
    assert one.keys() == three.keys()
    for key in one:
        assert torch.equal(one[key], three[key]), key


@pytest.mark.parametrize("take_ahead", [False, True], ids=["cpu", "gpu-order"])
def test_stop_while_waiting_for_data_applies_no_step_without_its_batch(
    tmp_path: Path, take_ahead: bool
) -> None:
    """The data servers are gone and the trainer waits for data; a stop request (SIGTERM's
    flag) ends the wait at once, no step is applied without its batch, and the position to
    checkpoint is just after the last applied step's batches. On the CPU the trainer waits at
    the start of the next step, which is then void (not applied). In a GPU's order
    (``Trainer.take_ahead``) it waits for the next step's first batch before it applies the step
    in flight, whose batches had all arrived: that step is applied and the run stops there."""
    source = PremadeBatchSource(SAMPLES, image_size=32, max_batch=8, num_classes=10)
    server, port = create_server(source, port=0)
    cfg = config(tmp_path, [f"127.0.0.1:{port}"], epochs=1000)
    cfg = dataclasses.replace(cfg, sample_log_dir=tmp_path / "samples")
    trainer = Trainer(cfg)
    trainer.take_ahead = take_ahead
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(trainer.train()))
    try:
        thread.start()
        deadline = time.monotonic() + 60
        while trainer.step < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.stop(0).wait()  # every data server gone: the trainer runs out and waits
        steps, still = trainer.step, time.monotonic()
        while time.monotonic() - still < 1.5 and time.monotonic() < deadline:
            if trainer.step != steps:
                steps, still = trainer.step, time.monotonic()
            time.sleep(0.05)
        asked = time.monotonic()
        trainer.stop.request()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the trainer did not stop while waiting for data"
        assert time.monotonic() - asked < 10
    finally:
        trainer.stop.request()
        thread.join(timeout=30)
        trainer.close()
        server.stop(0)
    applied = steps + 1 if take_ahead else steps
    assert result == [EXIT_STOPPED] and trainer.step == applied
    assert trainer.summary["stopped_by"] == "peer" and trainer.summary["steps"] == applied
    # A void step leaves its position from before it; a step boundary, the stream's own.
    assert (trainer._data_state is not None) is not take_ahead
    saved = trainer._data()
    assert saved is not None and saved["client"] is not None
    consumed = sum(b - a for a, b in saved["client"]["consumed"])
    per_epoch = SAMPLES // 4
    assert saved["epoch"] * per_epoch * 4 + consumed == applied * 4
    # The sample log has every applied step, and no other.
    logged = read_sample_log(tmp_path / "samples" / "rank-0.jsonl")
    assert [line["step"] for line in logged] == list(range(1, applied + 1))
    assert all(len(line["sample_ids"]) == 4 for line in logged)
