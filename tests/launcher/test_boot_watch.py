"""Failed boots are counted by the launchers that run: EC2's state reason
``Client.InstanceInitiatedShutdown`` (a boot's ``shutdown -h now``) on the cluster's instances,
in the job record's ``replaced/`` beside the early exits, and past the budget the watch says why
the job must end. moto stands in for EC2 and Auto Scaling (the rehearsal's emulator, which sets
the state reason an OS shutdown leaves); the job record is a real one in a folder."""

from __future__ import annotations

import time
from pathlib import Path

from small_spec import small_spec_text

from training.common.jobrecord import JobRecord
from training.costs.bill import Census
from training.launcher.boot_watch import BOOT_REASON, LAUNCH_SLACK_S, BootWatch, failed_boots
from training.rehearsal.aws import AwsEmulator
from training.spec import ClusterSpec, load_spec


def spec(tmp_path: Path, name: str) -> ClusterSpec:
    path = tmp_path / f"{name}.toml"
    path.write_text(small_spec_text(name))
    return load_spec(path)


def ids(aws: AwsEmulator, cluster: str, group: str) -> list[str]:
    return [
        i.instance_id for i in aws.instances(cluster) if i.group == group and i.state == "running"
    ]


def test_only_this_clusters_os_shutdowns_since_the_job_began_count(
    aws: AwsEmulator, tmp_path: Path
) -> None:
    aws.provision(spec(tmp_path, "vit"))
    aws.provision(spec(tmp_path, "other"))
    t0, t1 = ids(aws, "vit", "trainer")
    (d0,) = ids(aws, "vit", "dataprep")
    (other,) = ids(aws, "other", "dataprep")
    aws.shut_down_from_os(t1)  # counts
    aws.shut_down_from_os(d0)  # counts
    aws.shut_down_from_os(other)  # another cluster's
    aws.terminate_instance(t0)  # through the API (Spot, scale-in): not a failed boot
    ec2 = aws.client("ec2")
    found = failed_boots(ec2, "vit", since=time.time() - 60)
    assert {(b.instance_id, b.group) for b in found} == {(t1, "trainer"), (d0, "dataprep")}
    # Launched before ``since`` (an earlier job's instances): not this job's.
    assert failed_boots(ec2, "vit", since=time.time() + 60) == []


def test_the_watch_counts_each_boot_once_beside_early_exits_and_ends_past_the_budget(
    aws: AwsEmulator, tmp_path: Path
) -> None:
    aws.provision(spec(tmp_path, "vit"))
    record = JobRecord(str(tmp_path / "record"))
    record.mark_replaced("i-early", group="dataprep", reason="job pointer: not found")
    started = time.time() + LAUNCH_SLACK_S - 30  # the first instances launched 30 s "early"
    watch = BootWatch(aws.client("ec2"), "vit", record, budget=2, job_started=lambda: started)
    assert watch.check() is None  # nothing failed yet
    first, other = ids(aws, "vit", "trainer")
    aws.shut_down_from_os(first)
    assert watch.check() is None  # 2 replaced: within the budget of 2
    replaced = record.replaced()
    assert set(replaced) == {"i-early", first}
    assert replaced[first]["group"] == "trainer" and replaced[first]["reason"] == BOOT_REASON
    written = replaced[first]["time"]
    assert watch.check() is None and record.replaced()[first]["time"] == written  # counted once
    # The group's replacement fails its boot too: the third, past the budget.
    (replacement,) = set(ids(aws, "vit", "trainer")) - {other}
    aws.shut_down_from_os(replacement)
    assert watch.check() == (
        "3 instances never reached the launcher's job loop, past the budget of 2 replacements; "
        f"the last, {replacement} (trainer): {BOOT_REASON}"
    )


def test_no_decision_without_the_jobs_start(aws: AwsEmulator, tmp_path: Path) -> None:
    aws.provision(spec(tmp_path, "vit"))
    for instance in ids(aws, "vit", "trainer"):
        aws.shut_down_from_os(instance)
    record = JobRecord(str(tmp_path / "record"))
    watch = BootWatch(aws.client("ec2"), "vit", record, budget=0, job_started=lambda: None)
    assert watch.check() is None and record.replaced() == {}


def test_an_early_exit_no_host_saw_running_is_in_the_census_once_it_is_gone(
    aws: AwsEmulator, tmp_path: Path
) -> None:
    """An early exit (its launcher wrote it to ``replaced/`` and its group replaced it) may end
    before any host listed it running: the watch adds it to the census, gone when first looked
    at after it ended, so the job's bill counts it; one still running is left to the census's
    own looks."""
    aws.provision(spec(tmp_path, "vit"))
    record = JobRecord(str(tmp_path / "record"))
    census = Census()
    started = time.time()
    watch = BootWatch(
        aws.client("ec2"), "vit", record, budget=5, job_started=lambda: started, census=census
    )
    (early,) = ids(aws, "vit", "dataprep")
    trainer, _ = ids(aws, "vit", "trainer")
    record.mark_replaced(early, group=None, reason="no hetero:group tag")  # as early_exit does
    record.mark_replaced(trainer, group="trainer", reason="still shutting down")
    before = time.time()
    assert watch.check() is None
    assert census.sightings() == []  # both still run
    aws.terminate_in_group(early, decrement=False)  # SetInstanceHealth Unhealthy: replaced
    assert watch.check() is None
    (seen,) = census.sightings()
    assert (seen.instance_id, seen.group, seen.seen) == (early, "dataprep", None)
    assert seen.gone is not None and before <= seen.gone <= time.time()
    assert seen.launched <= seen.gone
    gone = seen.gone
    assert watch.check() is None and census.sightings() == [seen]  # added once
    assert census.sightings()[0].gone == gone
