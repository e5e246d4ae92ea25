"""The kill-in-save fault without a cluster: the watcher fires on a ``step-N.partial`` folder in
a fake staging folder (and only then), gives up after its bound, and the injector records which
write it cut and the newest complete checkpoint in (a fake) S3; the launcher logs' resumes are
read in order."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from training.launcher.plan import checkpoint_staging_dir
from training.rehearsal import audit
from training.rehearsal.aws import ClusterNames
from training.rehearsal.events import EventLog
from training.rehearsal.faults import FaultKind, parse_instance_fault
from training.rehearsal.injector import FaultInjector, partial_steps, watch_save

POLL_S = 0.01


def later(seconds: float, action: Any) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        action()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_partial_steps_are_the_partial_folders_only(tmp_path: Path) -> None:
    assert partial_steps(tmp_path / "not-made-yet") == []
    (tmp_path / "step-4").mkdir()  # complete: renamed into place
    (tmp_path / "step-12.partial").mkdir()
    (tmp_path / "step-8.partial").mkdir()
    (tmp_path / "step-9.partial").write_text("a file, not a write in progress")
    (tmp_path / "step-x.partial").mkdir()
    assert partial_steps(tmp_path) == [8, 12]


def test_a_write_that_starts_fires_the_kill_with_its_step(tmp_path: Path) -> None:
    staging = tmp_path / "hetero" / "checkpoints"
    staging.mkdir(parents=True)
    (staging / "step-4").mkdir()  # an earlier, complete checkpoint: not a write
    cuts: list[int] = []
    writer = later(0.2, lambda: (staging / "step-8.partial").mkdir())
    started = time.monotonic()
    watch = watch_save(staging, cuts.append, timeout_s=10, poll_s=POLL_S)
    writer.join()
    assert cuts == [8]
    assert watch.cut_step == 8 and "step-8.partial" in watch.reason
    assert 0.15 <= watch.waited_s < 5 and time.monotonic() - started < 5


def test_the_staging_folder_may_appear_during_the_watch(tmp_path: Path) -> None:
    staging = tmp_path / "hetero" / "checkpoints"
    cuts: list[int] = []
    later(0.1, lambda: (staging / "step-8.partial").mkdir(parents=True))
    assert watch_save(staging, cuts.append, timeout_s=10, poll_s=POLL_S).cut_step == 8
    assert cuts == [8]


def test_no_write_within_the_bound_does_not_fire(tmp_path: Path) -> None:
    staging = tmp_path / "hetero" / "checkpoints"
    staging.mkdir(parents=True)
    (staging / "step-4").mkdir()
    cuts: list[int] = []
    watch = watch_save(staging, cuts.append, timeout_s=0.3, poll_s=POLL_S)
    assert cuts == [] and watch.cut_step is None
    assert "no checkpoint write started" in watch.reason and "0.3s" in watch.reason
    assert 0.3 <= watch.waited_s < 3


def test_the_watch_ends_when_told_to(tmp_path: Path) -> None:
    gone = threading.Event()
    later(0.1, gone.set)
    cuts: list[int] = []
    watch = watch_save(
        tmp_path,
        cuts.append,
        timeout_s=30,
        poll_s=POLL_S,
        stop_reason=lambda: "the instance was terminated first" if gone.is_set() else None,
    )
    assert cuts == [] and watch.cut_step is None
    assert watch.reason == "the instance was terminated first" and watch.waited_s < 5


# -- the fault in the injector, with stand-ins for the simulator, moto and the step watcher ----

PREFIX = "checkpoints/c/"


class FakeS3:
    def __init__(self, keys: list[str]) -> None:
        self.keys = keys

    def get_paginator(self, name: str) -> Any:
        assert name == "list_objects_v2"
        keys = self.keys
        return SimpleNamespace(
            paginate=lambda Bucket, Prefix: [
                {"Contents": [{"Key": k} for k in keys if k.startswith(Prefix)]}
            ]
        )


class FakeAws:
    def __init__(self, keys: list[str]) -> None:
        self.s3 = FakeS3(keys)
        self.terminated: list[str] = []

    def client(self, service: str) -> Any:
        assert service == "s3"
        return self.s3

    def terminate_instance(self, instance_id: str) -> None:
        self.terminated.append(instance_id)


class FakeSimulator:
    def __init__(self, run: Any, on_kill: Any = None) -> None:
        self.run = run
        self.on_kill = on_kill
        self.kills: list[str] = []
        self.frozen: list[str] = []

    def instance(self, group: str, index: int) -> Any:
        return self.run if (group, index) == ("trainer", 1) else None

    def freeze_tree(self, run: Any) -> None:
        self.frozen.append(run.instance_id)

    def kill_tree(self, run: Any) -> list[int]:
        # The injector freezes the tree first, so the kill lands inside the write.
        assert self.frozen == [*self.kills, run.instance_id], "killed before it was frozen"
        self.kills.append(run.instance_id)
        if self.on_kill is not None:
            self.on_kill()
        return [101, 102]


def injector(tmp_path: Path, simulator: FakeSimulator, aws: FakeAws, watch_s: float) -> Any:
    names = ClusterNames(
        cluster="c", region="us-east-1", bucket="b", checkpoint_prefix=PREFIX, asg_names={}
    )
    return FaultInjector(
        (parse_instance_fault(FaultKind.KILL_IN_SAVE, "trainer:1@6"),),
        simulator=simulator,  # type: ignore[arg-type]
        aws=aws,  # type: ignore[arg-type]
        names=names,
        proxy=None,  # type: ignore[arg-type]
        steps=SimpleNamespace(current_step=lambda: 8),  # type: ignore[arg-type]
        events=EventLog(echo=lambda line: None),
        notice_s=0,
        save_watch_s=watch_s,
        save_poll_s=POLL_S,
    )


def fire(inj: Any) -> Any:
    rec = inj.records[0]
    inj._fire(rec, 6)
    for t in inj._helpers:
        t.join(timeout=10)
    return rec


def test_the_injector_cuts_the_write_and_records_the_newest_complete_step(
    tmp_path: Path,
) -> None:
    run = SimpleNamespace(instance_id="i-1", tmpdir=tmp_path, terminated=False)
    staging = Path(checkpoint_staging_dir(tmp_path))
    staging.mkdir(parents=True)
    keys = [
        f"{PREFIX}step-4/.metadata",
        f"{PREFIX}step-4/COMPLETE",
        f"{PREFIX}step-8/__0_0.distcp",  # the other host's shards of the cut write: no marker
        f"{PREFIX}job/outcome.json",
    ]
    aws = FakeAws(keys)
    sim = FakeSimulator(run)
    inj = injector(tmp_path, sim, aws, watch_s=10)
    later(0.2, lambda: (staging / "step-8.partial").mkdir())
    rec = fire(inj)
    assert sim.kills == ["i-1"] and aws.terminated == ["i-1"]
    assert rec.state == "done" and rec.detail.startswith("killed inside the write of step 8")
    assert (rec.cut_step, rec.newest_complete_at_kill, rec.partial_at_kill) == (8, 4, True)
    assert rec.step_at_fire == 8 and rec.fired_t >= rec.watch_started_t
    report = rec.to_json()
    assert report["cut_step"] == 8 and report["newest_complete_at_kill"] == 4
    assert report["kind"] == "kill-in-save" and report["fault"] == "kill-in-save trainer:1@6"


def test_a_write_renamed_before_the_tree_died_is_reported(tmp_path: Path) -> None:
    run = SimpleNamespace(instance_id="i-1", tmpdir=tmp_path, terminated=False)
    staging = Path(checkpoint_staging_dir(tmp_path))
    (staging / "step-8.partial").mkdir(parents=True)

    def renamed() -> None:  # the save finished between the look and the kill
        (staging / "step-8.partial").rename(staging / "step-8")

    aws = FakeAws([f"{PREFIX}step-8/COMPLETE"])
    rec = fire(injector(tmp_path, FakeSimulator(run, renamed), aws, watch_s=10))
    assert (rec.cut_step, rec.newest_complete_at_kill, rec.partial_at_kill) == (8, 8, False)
    assert rec.detail.startswith("killed just after the write of step 8")


def test_no_write_within_the_bound_leaves_the_fault_not_fired(tmp_path: Path) -> None:
    run = SimpleNamespace(instance_id="i-1", tmpdir=tmp_path, terminated=False)
    aws = FakeAws([])
    sim = FakeSimulator(run)
    rec = fire(injector(tmp_path, sim, aws, watch_s=0.3))
    assert sim.kills == [] and aws.terminated == []
    assert rec.state == "skipped" and rec.cut_step is None
    assert rec.detail.startswith("not fired: no checkpoint write started")
    assert rec.to_json()["cut_step"] is None


# -- resumes, from the launcher logs --------------------------------------------------------


def test_resumes_are_rank_0s_lines_in_time_order(tmp_path: Path) -> None:
    msg = "INFO [rank {r}] training.trainer.checkpoint: resumed from {p} (step {s}) in 0.10s"
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text(
        "2025-01-01 10:00:05,100 "
        + msg.format(r=0, p="/tmp/x/step-8", s=8)
        + "\nnoise\n2025-01-01 10:00:01,000 "
        + msg.format(r=1, p="/tmp/x/step-4", s=4)
        + "\n"
    )
    b.write_text("2025-01-01 10:00:01,000 " + msg.format(r=0, p="/tmp/y/step-4", s=4) + "\n")
    found = audit.resumes([a, b, tmp_path / "missing.log"])
    assert [e["step"] for e in found] == [4, 8]
    assert found[0]["path"] == "/tmp/y/step-4" and found[0]["log"] == str(b)
