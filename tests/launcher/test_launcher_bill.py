"""The job's bill (``training.costs.bill``): every host's census of the cluster's instances,
merged, each instance from the middle of its launch second to the job's end (running then) or
the middle of its last sight running and its first sight gone, priced per group and market at
the prices the job recorded. Exact figures for instances alive at the end, a Spot loss, a hard
kill, a failed boot never seen running and a replacement; a job that started later than its
instances; a market the job did not price; and the job record's and ``hetero status``'s parts."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from small_spec import small_spec_text

from training.common.jobparam import GroupPrice
from training.common.jobrecord import JobRecord
from training.common.outcome import Outcome
from training.costs.bill import Census, Sighting, bill_lines, job_bill, sighting
from training.launcher.host_record import HostRecord
from training.spec import load_spec
from training.workstation.status import JobStatus, bill_of, bill_text

T0 = 1_800_000_000.0
PRICES = (
    GroupPrice("trainer", "g5.xlarge", "spot", 2, 0.36, "spot-price-history", "2027-01-15"),
    GroupPrice("dataprep", "c6i.4xlarge", "spot", 1, 0.18, "catalogue", "2026-07-20"),
)


def instance(instance_id: str, launched: float, market: str = "spot") -> dict[str, Any]:
    """An instance as DescribeInstances lists it (LaunchTime to the second, as EC2 gives it)."""
    return {
        "InstanceId": instance_id,
        "InstanceType": "c6i.4xlarge" if instance_id.startswith("d-") else "g5.xlarge",
        "LaunchTime": datetime.fromtimestamp(T0 + launched, UTC),
        **({"InstanceLifecycle": "spot"} if market == "spot" else {}),
    }


T_ALIVE, T_SPOT, T_REPL = instance("t-alive", 0), instance("t-spot", 0), instance("t-repl", 1020)
D_KILLED, D_REPL, T_BOOT = (
    instance("d-killed", 0),
    instance("d-repl", 540),
    instance("t-boot", 1500),
)


def hosts() -> dict[str, dict[str, Any]]:
    """Two hosts' job-record states, each with its census (times: seconds after T0)."""
    a, b = Census(), Census()  # a trainer host, a data server
    a.observe(T0 + 500, {"trainer": [T_ALIVE, T_SPOT], "dataprep": [D_KILLED]})
    a.observe(T0 + 1000, {"trainer": [T_ALIVE, T_SPOT], "dataprep": [D_REPL]})  # d-killed gone
    a.observe(T0 + 1010, {"trainer": [T_ALIVE], "dataprep": [D_REPL]})  # the Spot loss
    b.observe(T0 + 520, {"trainer": [T_ALIVE, T_SPOT], "dataprep": [D_KILLED]})
    b.observe(T0 + 530, {"trainer": [T_ALIVE, T_SPOT]})  # the hard kill, seen sooner here
    boot = sighting(
        {**T_BOOT, "Tags": [{"Key": "hetero:group", "Value": "trainer"}]}, gone=T0 + 1560
    )
    assert boot is not None
    b.add(boot)  # the boot watch: shut down, never seen running
    return {"i-a": {"instances": a.to_json()}, "i-b": {"instances": b.to_json()}}


END = T0 + 3600.5
AT_END = {"trainer": [T_ALIVE, T_REPL], "dataprep": [D_REPL]}


def test_each_instance_counts_from_its_launch_to_the_end_or_the_middle_of_its_going() -> None:
    bill = job_bill(hosts(), PRICES, until=END, running=AT_END)
    spans = {s.sighting.instance_id: (s.start - T0, s.end - T0, s.uncertain_s) for s in bill.spells}
    assert spans == {
        "t-alive": (0.5, 3600.5, 0.5),  # alive at the end: to the end, exactly
        "t-spot": (0.5, 1005.0, 5.5),  # last seen 1000 (a), gone 1010 (a)
        "t-repl": (1020.5, 3600.5, 0.5),  # first seen at the end's look
        "d-killed": (0.5, 525.0, 5.5),  # last seen 520 (b), gone 530 (b), not 1000 (a)
        "d-repl": (540.5, 3600.5, 0.5),
        "t-boot": (1500.5, 1530.25, 30.25),  # never seen running: the middle of (launch, gone]
    }
    trainer, dataprep = bill.lines
    assert (trainer.group, trainer.market, trainer.instances) == ("trainer", "spot", 4)
    assert trainer.instance_seconds == 3600 + 1004.5 + 2580 + 29.75 == 7214.25
    assert trainer.uncertain_s == 0.5 + 5.5 + 0.5 + 30.25
    assert trainer.usd == pytest.approx(7214.25 * 0.36 / 3600)  # 0.721425
    assert (dataprep.instances, dataprep.instance_seconds) == (2, 524.5 + 3060)
    assert dataprep.usd == pytest.approx(3584.5 * 0.18 / 3600)  # 0.179225
    recorded = bill.to_json()
    assert recorded["usd"] == pytest.approx(0.90065)
    assert recorded["instance_seconds"] == 10798.75
    assert recorded["running"] == 3
    assert recorded["lines"][0] == {
        "group": "trainer", "market": "spot", "instances": 4, "instance_seconds": 7214.25,
        "uncertain_s": 36.75, "types": ["g5.xlarge"], "usd_per_hour": 0.36,
        "priced_type": "g5.xlarge", "source": "spot-price-history", "as_of": "2027-01-15",
        "usd": 0.721425,
    }  # fmt: skip
    lines = bill_lines(recorded)
    assert lines[0].split() == [
        "group", "market", "instances", "instance-h", "±", "s", "USD/h", "each", "USD", "priced",
    ]  # fmt: skip
    assert lines[1].split() == [
        "trainer", "spot", "4", "2.0040", "37", "0.3600", "0.7214", "spot-price-history,",
        "2027-01-15",
    ]  # fmt: skip
    assert lines[-1] == "total: 0.9006 USD for 2.9997 instance-h (± 43 instance-s)"


def test_a_job_started_later_counts_from_its_start() -> None:
    """A job of ``hetero job start`` counts from its ``started``: an instance of the job before
    counts from there, one gone before it not at all, and no launch error is left."""
    bill = job_bill(hosts(), PRICES, until=END, since=T0 + 600, running=AT_END)
    spans = {s.sighting.instance_id: (s.start - T0, s.end - T0, s.uncertain_s) for s in bill.spells}
    assert spans["t-alive"] == (600.0, 3600.5, 0.0)
    assert spans["t-spot"] == (600.0, 1005.0, 5.0)
    assert "d-killed" not in spans  # gone at 525
    assert spans["d-repl"] == (600.0, 3600.5, 0.0)


def test_an_instance_of_a_market_the_job_did_not_price_is_unpriced() -> None:
    od = instance("t-od", 0, market="on-demand")
    census = Census()
    census.observe(T0 + 10, {"trainer": [od, T_ALIVE]})
    bill = job_bill({"i-a": {"instances": census.to_json()}}, PRICES, until=T0 + 100.5)
    assert [(line.market, line.instance_seconds, line.usd) for line in bill.lines] == [
        ("on-demand", 100.0, None),
        ("spot", 100.0, pytest.approx(0.01)),
    ]
    assert bill.usd == pytest.approx(0.01)
    rows = bill_lines(bill.to_json())
    assert rows[1].split()[-1] == "unpriced"
    assert rows[-1].endswith("; unpriced lines left out of the USD")


def test_the_census_sees_instances_go_and_come_back_and_merges_looks() -> None:
    census = Census()
    census.observe(T0 + 10, {"trainer": [T_ALIVE, T_SPOT]})
    census.observe(T0 + 20, {"trainer": [T_ALIVE]})
    gone = {s.instance_id: s.gone for s in census.sightings()}
    assert gone == {"t-alive": None, "t-spot": T0 + 20}
    census.observe(T0 + 30, {"trainer": [T_ALIVE, T_SPOT]})  # listed again (a late listing)
    again = {s.instance_id: (s.seen, s.gone) for s in census.sightings()}
    assert again["t-spot"] == (T0 + 30, None)
    # Another host saw it gone before this host last saw it running: that sight is dropped.
    early = Sighting("t-spot", "trainer", "g5.xlarge", "spot", T0, seen=T0 + 5, gone=T0 + 25)
    census.add(early)
    assert {s.instance_id: (s.seen, s.gone) for s in census.sightings()}["t-spot"] == (
        T0 + 30,
        None,
    )
    # A ledger as a host writes it reads back the same; broken entries are left out.
    copy = Census()
    copy.load({**census.to_json(), "i-broken": {"group": "trainer"}, "i-odd": 3})
    assert sorted(copy.sightings(), key=lambda s: s.instance_id) == sorted(
        census.sightings(), key=lambda s: s.instance_id
    )


def test_the_outcome_records_the_bill_once_at_the_bills_end(tmp_path: Path) -> None:
    record = JobRecord(str(tmp_path))
    calls: list[int] = []

    def bill() -> dict[str, Any]:
        calls.append(1)
        return job_bill(hosts(), PRICES, until=END, running=AT_END).to_json()

    first = record.end(Outcome.FINISHED, reason="training finished", by="i-a", bill=bill)
    assert first["time"] == END and first["bill"]["usd"] == pytest.approx(0.90065)
    again = record.end(Outcome.FAILED, reason="late", by="i-b", bill=bill)
    assert again == record.outcome() and calls == [1]  # a later end makes no bill


def test_a_host_that_ended_the_job_while_another_made_its_bill_keeps_its_outcome(
    tmp_path: Path,
) -> None:
    record = JobRecord(str(tmp_path))

    def slow_bill() -> dict[str, Any]:  # meanwhile the other host ends the job, groups to 0
        record.end(Outcome.FINISHED, reason="training finished", by="i-b")
        return job_bill(hosts(), PRICES, until=END).to_json()

    kept = record.end(Outcome.FINISHED, reason="training finished", by="i-a", bill=slow_bill)
    assert kept["by"] == "i-b" and "bill" not in kept and record.outcome() == kept


def test_a_host_writes_its_census_and_takes_it_up_after_a_restart(tmp_path: Path) -> None:
    record = JobRecord(str(tmp_path))
    host = HostRecord(record, "i-a", group="trainer", address="10.0.0.1", counters=dict)
    host.census.observe(T0 + 10, {"trainer": [T_ALIVE, T_SPOT]})
    host.census.observe(T0 + 20, {"trainer": [T_ALIVE]})
    host.set(state="running")
    written = record.hosts()["i-a"]["instances"]
    assert written["t-spot"]["gone"] == T0 + 20 and written["t-alive"]["seen"] == T0 + 20
    restarted = HostRecord(record, "i-a", group="trainer", address="10.0.0.1", counters=dict)
    restarted.set(state="waiting-for-peers")  # Docker restarted the launcher
    assert record.hosts()["i-a"]["instances"] == written


def test_status_shows_the_bill_so_far_and_the_recorded_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "spec.toml"
    path.write_text(small_spec_text("vit-bill"))
    spec = load_spec(path)
    job = {"job_id": "j-1", "checkpoint_uri": "s3://b/c/j-1/", "prices": [vars(p) for p in PRICES]}
    running = JobStatus(cluster="vit-bill", job=job, hosts=hosts())
    so_far, recorded = bill_of(spec, running, AT_END, now=END)
    assert not recorded and so_far is not None
    assert so_far["usd"] == pytest.approx(0.90065)
    running.bill = so_far
    text = bill_text(running)
    assert text[0] == "bill so far (the instances running now count to now):"
    assert text[-1] == "  total: 0.9006 USD for 2.9997 instance-h (± 43 instance-s)"
    # Ended: the outcome's bill as recorded; without one (an early exit ended the job), the bill
    # to the outcome's time from the job record, every instance's going as its hosts saw it.
    ended = JobStatus(cluster="vit-bill", job=job, hosts=hosts())
    ended.outcome = {"outcome": "finished", "time": END, "bill": so_far}
    assert bill_of(spec, ended, None) == (so_far, True)
    ended.outcome = {"outcome": "failed", "time": T0 + 2000.5}
    to_end, recorded = bill_of(spec, ended, None)
    assert not recorded and to_end is not None
    assert to_end["until"] == T0 + 2000.5
    assert to_end["instances"]["t-alive"]["end"] == T0 + 2000.5
    # A deploy's job records no prices: the spec's and the catalogue's, as its budget.
    deployed = JobStatus(cluster="vit-bill", job=None, hosts=hosts())
    catalogue, _ = bill_of(spec, deployed, AT_END, now=END)
    assert catalogue is not None
    assert {line["source"] for line in catalogue["lines"]} == {"catalogue"}
    capsys.readouterr()
