"""``hetero status``: the job as AWS and its job record see it.

The current job (the SSM job pointer ``/hetero/<cluster>/job``, when the stack created it: its
id and checkpoint URI, which is where the job record is), its spend against its caps, its prices
and its bill (``training.costs.bill``: recorded at its end, else so far), groups (desired,
minimum, maximum and in-service counts), instances by group, market and AZ, the job's outcome,
each host's last reported state and metrics (with its last validation top-1 and the accuracy
targets reached), the data-tier controller's last decisions (an elastic dataprep group:
``JobRecord.decisions``) and the newest complete checkpoint. Read-only: it calls only
Describe/List/Get APIs. Runs on the person's machine: credentials, region and endpoint come from
the usual places (``AWS_PROFILE``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``...).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from training.common.aws import client
from training.common.hosts import instance_market, list_cluster_instances
from training.common.jobparam import (
    MAX_ATTEMPTS,
    GroupPrice,
    JobParameterNotFound,
    JobPointer,
    parse_job_pointer,
    read_job_pointer,
)
from training.common.jobrecord import JobRecord
from training.common.names import ENV_CHECKPOINT_URI, asg_name, job_parameter_name
from training.common.s3 import is_s3_uri, parse_s3_uri, s3_uri
from training.common.tensorboard_paths import every_job_uri, logdir_command, tensorboard_uri
from training.costs.bill import bill_lines, job_bill
from training.costs.budget import Budget, parse_started
from training.costs.deploy_prices import recorded_prices
from training.prices import offline_prices, price_lines
from training.spec import ClusterSpec, load_spec
from training.trainer.checkpoint_s3 import S3CheckpointStore

log = logging.getLogger(__name__)


@dataclass
class JobStatus:
    cluster: str
    job: dict[str, Any] | None = None
    """The job pointer (``job_id``, ``checkpoint_uri``, ``started``, ``resumed_from``,
    ``max_usd``, ``max_hours``, ``prices``), if any."""
    checkpoint_uri: str | None = None
    """Where the job record and the checkpoints were read."""
    recorded_prices: tuple[GroupPrice, ...] | None = None
    """The job record's prices (a deploy's job: its first host priced it, ``deploy_prices``);
    None when it has none."""
    groups: list[dict[str, Any]] = field(default_factory=list)
    instances: list[dict[str, Any]] = field(default_factory=list)
    outcome: dict[str, Any] | None = None
    hosts: dict[str, dict[str, Any]] = field(default_factory=dict)
    newest_checkpoint: str | None = None
    model: str | None = None
    """The finished job's ``model/`` (``model.safetensors`` + ``config.json``), once written."""
    budget: str | None = None
    """Spend so far against ``job.max_usd`` / ``job.max_hours`` (``budget.Budget.describe``)."""
    bill: dict[str, Any] | None = None
    """What the job cost (``bill.Bill.to_json``): the outcome's for a job that ended, else so
    far, from the job record and the instances running now."""
    bill_recorded: bool = False
    """``bill`` is the one the job's end recorded (else made now from the job record)."""
    evicted: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Hosts taken out of their groups (silent: ``silent_hosts``; hung twice: ``ec2_job``), by
    id: ``group``, ``reason``, ``by``, ``time``."""
    hangs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Hung trainer generations (``hang_watch``), by ``<instance-id>-<generation>``: ``reason``,
    ``time``, each rank's stacks under ``ranks``."""
    decisions: list[dict[str, Any]] = field(default_factory=list)
    """The data-tier controller's newest decisions, oldest first (``JobRecord.decisions``):
    ``time``, ``step``, ``from_count``, ``to_count``, ``reason``, ``acted``..."""
    errors: list[str] = field(default_factory=list)


def collect(
    spec: ClusterSpec,
    *,
    checkpoint_uri: str | None,
    ec2: Any,
    autoscaling: Any,
    s3: Any | None = None,
    ssm: Any | None = None,
    default_uri: str | None = None,
) -> JobStatus:
    """Everything ``hetero status`` shows; each source's failure is kept in ``errors``.

    The job record is read at ``checkpoint_uri`` when given, else at the job pointer's (read
    with ``ssm``, when the parameter exists), else at ``default_uri``."""
    status = JobStatus(cluster=spec.name)
    if ssm is not None:
        pointer, error = current_pointer(ssm, spec.name)
        if pointer is not None:
            status.job = json.loads(pointer.to_json())  # as the parameter holds it
            checkpoint_uri = checkpoint_uri or pointer.checkpoint_uri
        if error is not None:
            status.errors.append(error)
    checkpoint_uri = checkpoint_uri or default_uri
    status.checkpoint_uri = checkpoint_uri
    names = [asg_name(spec.name, g.name) for g in spec.groups]
    try:
        found = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=names)
        by_name = {g["AutoScalingGroupName"]: g for g in found.get("AutoScalingGroups", [])}
        for g, name in zip(spec.groups, names, strict=True):
            asg = by_name.get(name)
            status.groups.append(
                {
                    "group": g.name,
                    "asg": name,
                    "desired": asg["DesiredCapacity"] if asg else None,
                    "min": asg["MinSize"] if asg else None,
                    "max": asg["MaxSize"] if asg else None,
                    "elastic": g.elastic,
                    "in_service": sum(
                        1 for i in (asg or {}).get("Instances", [])
                        if i.get("LifecycleState") == "InService"
                    ),
                }
            )  # fmt: skip
    except Exception as e:
        status.errors.append(f"Auto Scaling: {e}")
    running: dict[str, list[dict[str, Any]]] | None = None
    try:
        running = list_cluster_instances(ec2, spec.name)
        for group, instances in sorted(running.items()):
            for inst in instances:
                status.instances.append(
                    {
                        "group": group,
                        "instance_id": inst["InstanceId"],
                        "type": inst.get("InstanceType"),
                        "market": instance_market(inst),
                        "az": inst.get("Placement", {}).get("AvailabilityZone"),
                        "address": inst.get("PrivateIpAddress"),
                    }
                )  # fmt: skip
    except Exception as e:
        status.errors.append(f"EC2: {e}")
    if checkpoint_uri:
        try:
            record = JobRecord(checkpoint_uri, s3_client=s3)
            status.outcome = record.outcome()
            status.hosts = record.hosts()
            status.evicted = record.evicted()
            status.hangs = record.hangs()
            if not (status.job or {}).get("prices"):  # a deploy's job: its first host's
                status.recorded_prices = recorded_prices(record)
            status.budget = budget_line(spec, status, record)
            status.bill, status.bill_recorded = bill_of(spec, status, running)
        except Exception as e:
            status.errors.append(f"job record in {checkpoint_uri}: {e}")
        try:
            status.decisions = JobRecord(checkpoint_uri, s3_client=s3).decisions()
        except Exception as e:
            status.errors.append(f"data-tier decisions in {checkpoint_uri}: {e}")
        if is_s3_uri(checkpoint_uri):
            try:
                store = S3CheckpointStore(checkpoint_uri, client=s3)
                step = store.latest_complete()
                status.newest_checkpoint = store.step_uri(step) if step is not None else None
                status.model = _model_folder(s3, checkpoint_uri)
            except Exception as e:
                status.errors.append(f"checkpoints in {checkpoint_uri}: {e}")
    return status


def budget_line(
    spec: ClusterSpec, status: JobStatus, record: JobRecord, now: float | None = None
) -> str:
    """Spend from the job's start (the pointer's ``started``, else the record's) to its end
    (the outcome's time) or ``now``, against the spec's caps."""
    pointer = parse_job_pointer(json.dumps(status.job)) if status.job else None
    budget = Budget.of(spec, pointer, recorded=status.recorded_prices)
    started = parse_started((status.job or {}).get("started"))
    if started is None:
        started = record.started_at()
    if started is None:
        return budget.describe(None)
    end = (status.outcome or {}).get("time")
    until = float(end) if isinstance(end, int | float) else (time.time() if now is None else now)
    return budget.describe(until - started)


def bill_of(
    spec: ClusterSpec,
    status: JobStatus,
    running: dict[str, list[dict[str, Any]]] | None,
    now: float | None = None,
) -> tuple[dict[str, Any] | None, bool]:
    """(the bill, whether the job's end recorded it): the outcome's ``bill``; for a job that
    ended without one (its end could not make it), the bill to the outcome's time from the job
    record; for a running job, the bill so far, from the job record and ``running`` (the
    cluster's running instances now), at the prices its budget uses."""
    outcome = status.outcome or {}
    if isinstance(outcome.get("bill"), dict):
        return outcome["bill"], True
    pointer = parse_job_pointer(json.dumps(status.job)) if status.job else None
    # As the budget (``Budget.of``, which warns about the catalogue once already).
    prices = (
        (pointer.prices if pointer else None)
        or status.recorded_prices
        or offline_prices(spec).prices
    )
    since = parse_started((status.job or {}).get("started"))
    end = outcome.get("time")
    if isinstance(end, int | float):
        bill = job_bill(status.hosts, prices, until=float(end), since=since)
    else:
        until = time.time() if now is None else now
        bill = job_bill(status.hosts, prices, until=until, since=since, running=running)
    return bill.to_json(), False


def _model_folder(s3: Any, checkpoint_uri: str) -> str | None:
    """``<checkpoint_uri>model/`` when its ``config.json`` (written last) is there."""
    # Deferred: the export module loads torch and timm, which `hetero status` otherwise never does.
    from training.trainer.export import MODEL_FOLDER

    bucket, prefix = parse_s3_uri(checkpoint_uri)
    key = f"{prefix.rstrip('/')}/{MODEL_FOLDER}/config.json".lstrip("/")
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)
    found = any(o["Key"] == key for o in listed.get("Contents", []))
    return s3_uri(bucket, f"{key.rpartition('/')[0]}/") if found else None


def render(status: JobStatus) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    outcome = status.outcome or {}
    job = status.job or {}
    console.print(
        f"[bold]{status.cluster}[/]: job "
        + (f"{job['job_id']} " if job.get("job_id") else "")
        + f"{outcome.get('outcome', 'running (no outcome recorded)')}"
        + (f" ({outcome.get('reason')})" if outcome.get("reason") else "")
    )
    if job:
        console.print(
            f"checkpoints {job.get('checkpoint_uri')}, started {job.get('started') or '-'}"
            + (f", resumed from job {job['resumed_from']}" if job.get("resumed_from") else "")
        )
    if status.budget:
        console.print(f"spend {status.budget}", markup=False)
    for line in prices_text(job, status.recorded_prices):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    for line in bill_text(status):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    groups = Table("group", "Auto Scaling group", "desired", "min", "max", "in service")
    for g in status.groups:
        cells = {k: str(g[k]) for k in ("group", "asg", "desired", "min", "max", "in_service")}
        if g.get("elastic"):  # the data-tier controller moves desired between min and max
            cells["desired"] += f" (elastic {g['min']}-{g['max']})"
        groups.add_row(*cells.values())
    console.print(groups)
    if status.decisions or any(g.get("elastic") for g in status.groups):
        if status.decisions:
            console.print(f"data tier, last {len(status.decisions)} decision(s):")
            for d in status.decisions:
                console.print(f"  {decision_text(d)}", markup=False, highlight=False)
        else:
            console.print("data tier: no decision yet")
    instances = Table(
        "group", "instance", "type", "market", "AZ", "address", "state", "last metrics"
    )
    for inst in status.instances:
        host = status.hosts.get(inst["instance_id"], {})
        metrics = host.get("metrics") or {}
        shown = ", ".join(
            f"{k} {metrics[k]:.4g}" if isinstance(metrics[k], float) else f"{k} {metrics[k]}"
            for k in ("step", "samples_per_s", "data_wait_share", "loss")
            if k in metrics
        )
        validation = validation_text(metrics.get("eval"))
        if validation:
            shown = f"{shown}; {validation}" if shown else validation
        instances.add_row(
            inst["group"], inst["instance_id"], str(inst["type"]), inst["market"],
            str(inst["az"]), str(inst["address"]), str(host.get("state", "-")), shown or "-",
        )  # fmt: skip
    console.print(instances)
    lines = [
        *unreadable_text(status.hosts),
        *evicted_text(status.evicted),
        *hangs_text(status.hangs, status.checkpoint_uri),
    ]
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    console.print(f"newest complete checkpoint: {status.newest_checkpoint or 'none'}")
    console.print(f"model (model.safetensors + config.json): {status.model or 'not yet'}")
    for e in status.errors:
        console.print(f"[red]could not read[/] {e}")


def unreadable_text(hosts: dict[str, dict[str, Any]]) -> list[str]:
    """The training samples the job left out as unreadable, from the trainer's last metrics
    (rank 0's host): the count and the first names; the run's summary.json lists them all."""
    counts = [
        (m.get("unreadable_samples") or 0, m.get("unreadable_first") or [])
        for m in (h.get("metrics") or {} for h in hosts.values())
    ]
    count, first = max(counts, key=lambda c: c[0], default=(0, []))
    if not count:
        return []
    more = ", ..." if count > len(first) else ""
    return [
        f"unreadable training samples: {count}, left out ({', '.join(first)}{more}); the run's "
        "summary.json names every one"
    ]


def evicted_text(evicted: dict[str, dict[str, Any]]) -> list[str]:
    """The hosts taken out (silent, or hung twice), oldest first: who, when, by whom, why."""
    if not evicted:
        return []
    lines = [f"taken out of their groups ({len(evicted)}):"]
    for instance_id, e in sorted(evicted.items(), key=lambda kv: kv[1].get("time") or 0):
        lines.append(
            f"  {instance_id} ({e.get('group') or '?'}) at {_clock(e.get('time'))} by "
            f"{e.get('by') or '?'}: {e.get('reason') or '?'}"
        )
    return lines


def hangs_text(hangs: dict[str, dict[str, Any]], checkpoint_uri: str | None) -> list[str]:
    """The hung generations, oldest first: which host and generation, when, why, and where
    their ranks' stacks are."""
    if not hangs:
        return []
    lines = [f"hung generations, ended after their stacks were taken ({len(hangs)}):"]
    for key, h in sorted(hangs.items(), key=lambda kv: kv[1].get("time") or 0):
        lines.append(f"  {key} at {_clock(h.get('time'))}: {h.get('reason') or '?'}")
    where = f"{checkpoint_uri.rstrip('/')}/job/hangs/" if checkpoint_uri else "job/hangs/"
    lines.append(f"  each rank's stacks: {where}<instance-id>-<generation>.json")
    return lines


def _clock(when: Any) -> str:
    """Epoch seconds as ``HH:MM:SSZ`` (``?`` when unknown)."""
    return time.strftime("%H:%M:%S", time.gmtime(when)) + "Z" if when else "?"


def prices_text(job: dict[str, Any], in_record: tuple[GroupPrice, ...] | None = None) -> list[str]:
    """The job's prices, each group's at its most, with their source and date: the job
    pointer's (``hetero job start`` records them), else the job record's (``in_record``: a
    deploy's job, priced by its first host); or why there are none; nothing without a
    pointer."""
    if not job:
        return []
    if job.get("prices"):
        prices = [GroupPrice(**p) for p in job["prices"]]
        title = "prices at the job's start, each group at its most:"
    elif in_record:
        prices = list(in_record)
        title = "prices at the job's start (its first host's, in the job record), each at its most:"
    else:
        return [
            "prices: none recorded in the job pointer or the job record: its budget prices the "
            "groups at their most from the spec and the dated catalogue"
        ]
    return [title] + [f"  {line}" for line in price_lines(prices)]


def bill_text(status: JobStatus) -> list[str]:
    """The job's bill as a table (``bill.bill_lines``) under what it is: recorded at the job's
    end, or so far; nothing without one."""
    if not status.bill:
        return []
    if status.bill_recorded:
        head = "bill, recorded at the job's end:"
    elif status.outcome:
        head = "bill to the job's end, from the job record (its end recorded none):"
    else:
        head = "bill so far (the instances running now count to now):"
    return [head] + [f"  {line}" for line in bill_lines(status.bill)]


def decision_text(decision: dict[str, Any]) -> str:
    """One decision of the data-tier controller in words, e.g. ``step 200: 3 -> 4 (servers
    busy), acted``."""
    d = decision
    return (
        f"step {d.get('step')}: {d.get('from_count')} -> {d.get('to_count')}"
        + (f" ({d['reason']})" if d.get("reason") else "")
        + (", acted" if d.get("acted") else ", not acted")
    )


def _share(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return f"{value * 100:.1f} %"


def validation_text(last_eval: Any) -> str:
    """A host's last validation record (``metrics["eval"]`` of the job record: the trainer's
    ``last_eval.json``, put there by the EC2 launcher's heartbeat) in words, e.g. ``val top-1
    81.2 % (EMA 82.0 %) at step 120, targets reached 50 %, 80 %``; "" without one."""
    if not isinstance(last_eval, dict):
        return ""
    top1 = _share(last_eval.get("top1"))
    if top1 is None:
        return ""
    ema = _share(last_eval.get("ema_top1"))
    text = f"val top-1 {top1}" + (f" (EMA {ema})" if ema else "")
    if last_eval.get("step") is not None:
        text += f" at step {last_eval['step']}"
    reached = [
        f"{t * 100:.4g} %"
        for t in last_eval.get("targets_reached") or []
        if isinstance(t, int | float) and not isinstance(t, bool)
    ]
    if reached:
        text += ", targets reached " + ", ".join(reached)
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", default="cluster.toml", help="the deployed cluster spec")
    parser.add_argument(
        "--checkpoint-uri",
        help="where the checkpoints and the job record are (default: the current job's, from "
        "the SSM parameter /hetero/<name>/job; without that parameter "
        f"${ENV_CHECKPOINT_URI}, else the spec's job.checkpoint.dir)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--tensorboard",
        action="store_true",
        help="print the tensorboard command that shows this stack's jobs (their event files "
        "in S3, beside the checkpoints) and nothing else",
    )


def current_pointer(ssm: Any, cluster: str) -> tuple[JobPointer | None, str | None]:
    """The stack's job pointer (None where its parameter does not exist: a stack from before
    it, whose checkpoint URI comes from elsewhere), and what kept it from being read (a denial,
    no connection), as ``hetero status`` reports a source it could not read; else None."""
    name = job_parameter_name(cluster)
    try:
        return read_job_pointer(ssm, name), None
    except JobParameterNotFound:
        return None, None
    except Exception as e:
        return None, f"job pointer {name}: {e}"


def tensorboard_lines(checkpoint_uri: str | None) -> list[str]:
    """The commands that show the job's event files and every job's, or why there are none."""
    if not checkpoint_uri or not is_s3_uri(checkpoint_uri):
        return [
            f"no TensorBoard events in S3: the checkpoints are at {checkpoint_uri or 'no URI'}; "
            "a local run's are in its run folder (hetero local prints the command)"
        ]
    return [
        f"every job of the stack: {logdir_command(every_job_uri(checkpoint_uri))}",
        f"this job: {logdir_command(tensorboard_uri(checkpoint_uri))}",
        "(TensorBoard reads S3 with your AWS credentials: AWS_REGION or AWS_DEFAULT_REGION set)",
    ]


def print_tensorboard(spec: ClusterSpec, checkpoint_uri: str | None) -> int:
    """``hetero status --tensorboard``: the commands for the job at ``checkpoint_uri``, else the
    job pointer's, else ``$HETERO_CHECKPOINT_URI``'s; a pointer that cannot be read (a denial)
    ends it with why, and how to go without it."""
    uri = checkpoint_uri or os.environ.get(ENV_CHECKPOINT_URI, "").strip() or None
    if checkpoint_uri is None:
        pointer, error = current_pointer(client("ssm", attempts=MAX_ATTEMPTS), spec.name)
        if error is not None:
            print(f"could not read {error}", file=sys.stderr)
            print("(name the job's checkpoints with --checkpoint-uri instead)", file=sys.stderr)
            return 1
        uri = pointer.checkpoint_uri if pointer is not None else uri
    print("\n".join(tensorboard_lines(uri)))
    return 0


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    if args.tensorboard:
        return print_tensorboard(spec, args.checkpoint_uri)
    status = collect(
        spec,
        checkpoint_uri=args.checkpoint_uri,
        ec2=client("ec2"),
        autoscaling=client("autoscaling"),
        s3=client("s3"),
        ssm=client("ssm", attempts=MAX_ATTEMPTS),
        default_uri=(os.environ.get(ENV_CHECKPOINT_URI, "").strip() or spec.job.checkpoint.dir),
    )
    if args.json:
        json.dump(asdict(status), sys.stdout, indent=2, default=str)
        print()
    else:
        render(status)
    return 1 if status.errors else 0
