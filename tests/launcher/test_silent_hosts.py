"""Silent hosts (training.launcher.silent_hosts) and the restart budget's reset on progress
(training.launcher.restart_budget): which running hosts count as silent, which live host takes
one out and when (SetInstanceHealth Unhealthy through botocore's Stubber, the eviction in a real
job record), and that a host whose own writes fail judges nobody. The whole path on emulated
EC2 is in tests/rehearsal/test_rehearse_silent.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from training.common.jobrecord import JobRecord
from training.launcher.host_record import HostRecord
from training.launcher.restart_budget import RestartBudget
from training.launcher.silent_hosts import SilentHostWatch, find_silent

NOW = 1_800_000_000.0
SILENT_AFTER = 16.0


def running(*ids: str, group: str = "trainer") -> dict[str, list[dict[str, Any]]]:
    tags = [{"Key": "hetero:group", "Value": group}]
    return {group: [{"InstanceId": i, "Tags": tags} for i in ids]}


def test_silent_is_a_running_host_whose_last_write_is_too_old() -> None:
    hosts = {
        "i-fresh": {"time": NOW - 3, "state": "running"},
        "i-old": {"time": NOW - 17, "state": "running"},
        "i-older": {"time": NOW - 40, "state": "waiting-for-peers", "group": "trainer"},
        "i-leaving": {"time": NOW - 60},
        "i-gone": {"time": NOW - 60},  # not running any more: not listed
        "i-served": {"time": NOW - 60, "state": "generation-finished"},  # a data server, done
        "i-ended": {"time": NOW - 60, "state": "job-finished"},
        "i-left": {"time": NOW - 60, "state": "left"},
    }
    listed = running(
        "i-own",
        "i-fresh",
        "i-old",
        "i-older",
        "i-leaving",
        "i-new",
        "i-served",
        "i-ended",
        "i-left",
    )
    silent, live = find_silent(
        listed, hosts, now=NOW, silent_after_s=SILENT_AFTER, gone={"i-leaving"}, own="i-own"
    )
    assert [(s.instance_id, s.last_write, s.state) for s in silent] == [
        ("i-older", NOW - 40, "waiting-for-peers"),
        ("i-old", NOW - 17, "running"),
    ]
    assert silent[0].group == "trainer"
    # i-new never wrote (its launcher has not started): neither silent nor live.
    assert live == ["i-fresh", "i-own"]
    assert silent[1].reason(NOW) == (
        "silent: no write to the job record for 17 s (last state running) while EC2 lists it "
        "running"
    )


class Host:
    """A host with a real job record (a folder) and a stubbed Auto Scaling client."""

    def __init__(self, root: Path, instance_id: str) -> None:
        self.record = JobRecord(str(root))
        self.record_host = HostRecord(
            self.record, instance_id, group="trainer", address="10.0.0.1",
            counters=lambda: {"generation": 1, "failures": 0},
        )  # fmt: skip
        self.autoscaling = boto3.client(
            "autoscaling", region_name="us-east-1", aws_access_key_id="x",
            aws_secret_access_key="x",
        )  # fmt: skip
        self.now = NOW
        self.watch = SilentHostWatch(
            self.record_host, self.autoscaling, silent_after_s=SILENT_AFTER, stagger_s=8.0,
            clock=lambda: self.now,
        )  # fmt: skip


def wrote(record: JobRecord, instance_id: str, at: float, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("training.common.jobrecord.time.time", lambda: at)
    record.set_host(instance_id, group="trainer", state="running")
    monkeypatch.undo()


def test_the_first_live_host_takes_a_silent_one_out_and_records_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = Host(tmp_path, "i-a")
    host.record_host.set(state="running")
    host.record_host.writing_since = NOW - 60  # writing for a minute
    wrote(host.record, "i-b", NOW - 5, monkeypatch)  # live, after i-a in id order
    wrote(host.record, "i-c", NOW - 20, monkeypatch)  # silent for 20 s
    listed = running("i-a", "i-b", "i-c")
    with Stubber(host.autoscaling) as stub:
        stub.add_response(
            "set_instance_health", {},
            {"InstanceId": "i-c", "HealthStatus": "Unhealthy", "ShouldRespectGracePeriod": False},
        )  # fmt: skip
        found = host.watch.check(listed)
        stub.assert_no_pending_responses()
    assert [s.instance_id for s in found] == ["i-c"]
    assert host.watch.silent_ids() == {"i-c"} and host.watch.taken_out == ["i-c"]
    evicted = host.record.evicted()
    assert set(evicted) == {"i-c"}
    assert evicted["i-c"]["by"] == "i-a" and evicted["i-c"]["group"] == "trainer"
    assert evicted["i-c"]["reason"].startswith("silent: no write to the job record for 20 s")
    # Taken out once: the next look leaves it to its group's termination.
    with Stubber(host.autoscaling) as stub:
        assert host.watch.check(listed) == []


def test_the_next_live_host_waits_its_turn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = Host(tmp_path, "i-b")
    host.record_host.set(state="running")
    host.record_host.writing_since = NOW - 60
    wrote(host.record, "i-a", NOW - 1, monkeypatch)  # live and first in id order: acts first
    wrote(host.record, "i-c", NOW - 20, monkeypatch)  # silent for 20 s
    listed = running("i-a", "i-b", "i-c")
    with Stubber(host.autoscaling) as stub:  # no call expected: 20 s < 16 s + one 8 s turn
        assert [s.instance_id for s in host.watch.check(listed)] == ["i-c"]
    assert host.watch.taken_out == [] and host.record.evicted() == {}
    host.now = NOW + 5  # i-a did not act: i-b's turn has come
    with Stubber(host.autoscaling) as stub:
        stub.add_response("set_instance_health", {}, None)
        host.watch.check(listed)
        stub.assert_no_pending_responses()
    assert host.watch.taken_out == ["i-c"]


def test_a_host_whose_own_writes_failed_lately_judges_nobody(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After an S3 outage every host looks silent to every other: each waits until it has
    written again for a whole ``silent_after_s`` before judging."""
    host = Host(tmp_path, "i-a")
    host.record_host.set(state="running")
    host.record_host.writing_since = NOW - 10  # writing again for 10 s only
    wrote(host.record, "i-c", NOW - 60, monkeypatch)
    with Stubber(host.autoscaling):
        assert host.watch.check(running("i-a", "i-c")) == []
    assert host.watch.silent_ids() == set()
    # A write that fails resets it.
    host.record_host.writing_since = NOW - 60
    monkeypatch.setattr(host.record, "set_host", lambda *a, **k: (_ for _ in ()).throw(OSError))
    host.record_host.set(state="running")
    assert host.record_host.writing_since is None


def test_the_restart_budget_counts_failures_without_progress() -> None:
    budget = RestartBudget(allowed=3)
    assert budget.count(8) is None and budget.failures == 1
    assert budget.count(8) is None and budget.failures == 2  # no new checkpoint: counted on
    assert budget.count(16) == 8 and budget.failures == 1  # step 16 since: starts over
    assert budget.checkpoint_at_failure == 16
    for _ in range(3):
        budget.count(16)
    assert budget.failures == 4 and budget.spent
    unknown = RestartBudget(allowed=1)
    assert unknown.count(None) is None and unknown.count(None) is None and unknown.spent


def test_a_first_checkpoint_after_a_failure_is_progress() -> None:
    """0 is "no checkpoint yet": the first one completed after a failure starts the count over."""
    budget = RestartBudget(allowed=3)
    budget.count(0)
    budget.count(0)
    assert budget.failures == 2
    assert budget.count(4) == 0 and budget.failures == 1
