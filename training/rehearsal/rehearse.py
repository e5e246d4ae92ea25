"""One rehearsal run, start to end: emulators up, instances launched by their groups, faults
fired, the job watched until it ends (or the time runs out), then everything audited.

``run_once`` returns the run's facts (the report without the verdict); ``rehearse`` adds the
baseline (an uninterrupted run of the same spec and seed, run first or reused), the invariants
and the exit code, and writes ``rehearsal.json``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from training.common import call_log
from training.common.jobrecord import JobRecord
from training.common.names import CHECKPOINT_PREFIX
from training.common.steps import MARKER, step_name, step_of
from training.common.tensorboard_paths import FOLDER as TB_FOLDER
from training.data.order import order_for
from training.data.splits import Split, build_split
from training.rehearsal import audit, params, report
from training.rehearsal.aws import FAKE_CREDENTIALS, AwsEmulator, ClusterNames, region_for
from training.rehearsal.bill_check import bill_facts
from training.rehearsal.containers import (
    ROLE_TAGS,
    STAND_INS,
    ContainerLauncher,
    docker_client,
)
from training.rehearsal.datatier import DesiredWatch, data_tier_facts
from training.rehearsal.events import EventLog
from training.rehearsal.faults import NO_OUTCOME, FaultKind, Scenario
from training.rehearsal.injector import FaultInjector, FaultRecord
from training.rehearsal.instances import (
    LAUNCHER_LOG,
    GroupSimulator,
    InstanceContext,
    InstanceRun,
)
from training.rehearsal.s3proxy import SwitchableProxy
from training.rehearsal.samples import StepWatcher, read_sample_logs
from training.spec import ClusterSpec, DataPlaneSpec, Role, load_spec

log = logging.getLogger(__name__)

REPORT_FILE = "rehearsal.json"
SAMPLES_DIR = "samples"
INSTANCES_DIR = "instances"
FINAL_CHECKPOINT_DIR = "final-checkpoint"
BASELINE_DIR = "baseline"
DEFAULT_NOTICE_S = 15.0
DEFAULT_TIMEOUT_S = 600.0
SETTLE_S = 15.0
"""With every launcher exited and instances still running, how long nothing may change before
the rehearsal ends (nothing else will happen: the groups were not scaled to zero)."""
_LOOP_S = 0.5
MAX_DECISIONS = 1000
"""The most data-tier decisions read back from the job record for the report."""
REPLACED_PREFIX = "job/replaced/"
"""The job record's count of instances taken out of service, relative to the checkpoint URI."""
_INSTANCE_LOSS = (
    FaultKind.INTERRUPT,
    FaultKind.REBALANCE,
    FaultKind.KILL,
    FaultKind.KILL_IN_SAVE,
    FaultKind.KILL_DATA_SERVER,
    FaultKind.KILL_LAUNCHER,
    FaultKind.HANG,
    FaultKind.HANG_DATA_SERVER,
)


@dataclass(frozen=True)
class RehearsalOptions:
    spec_path: Path
    out_dir: Path
    scenario: Scenario = field(default_factory=Scenario)
    notice_s: float = DEFAULT_NOTICE_S
    timeout_s: float = DEFAULT_TIMEOUT_S
    settle_s: float = SETTLE_S
    launcher_args: tuple[str, ...] = ()
    echo: Callable[[str], None] | None = None
    resume_stopped: int = 0
    """How many times a job that ends ``stopped`` (its budget) is continued with
    ``hetero job start --resume`` (the real command, against the emulated AWS)."""
    image: str | None = None
    """The repository of the images every launcher runs in (``hetero rehearse --image``: each
    role's tag, ``training.rehearsal.containers``); None: as processes of this checkout."""
    resume_max_usd: tuple[float, ...] = ()
    """Each continued job's own budget (``--max-usd``), in order, the last for every later one;
    empty: the spec's."""


def spec_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def training_digest(spec: ClusterSpec) -> str:
    """What the final parameters depend on: the spec without its budget (``job.max_usd``,
    ``job.max_hours`` only decide when a job stops, and a stopped job resumes bit for bit),
    without how many data servers serve (the dataprep groups' ``count``, ``min_count``,
    ``max_count`` and the data-tier controller's ``autoscale_*`` settings: every batch is the
    same whichever server makes it, its augmentation seeded by seed, epoch and position) and
    without where it was read from, so a capped job that was resumed, or one whose data tier
    sized itself, compares with a fixed-size, uncapped baseline."""
    default_dp = DataPlaneSpec()
    dataplane = replace(
        spec.job.dataplane,
        autoscale_target_wait=default_dp.autoscale_target_wait,
        autoscale_max_busy=default_dp.autoscale_max_busy,
        autoscale_window=default_dp.autoscale_window,
        autoscale_cooldown_s=default_dp.autoscale_cooldown_s,
    )
    groups = tuple(
        replace(g, count=0, min_count=None, max_count=None) if g.role is Role.DATAPREP else g
        for g in spec.groups
    )
    job = replace(spec.job, max_usd=None, max_hours=None, dataplane=dataplane)
    normalized = replace(spec, groups=groups, job=job, source="")
    return hashlib.sha256(repr(normalized).encode()).hexdigest()


def _prepare(out: Path) -> None:
    """An output folder for a fresh run: the previous run's files there are removed (the
    sample logs are appended to, so stale ones would corrupt the audit)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in (SAMPLES_DIR, INSTANCES_DIR, FINAL_CHECKPOINT_DIR):
        shutil.rmtree(out / name, ignore_errors=True)
    (out / REPORT_FILE).unlink(missing_ok=True)
    (out / SAMPLES_DIR).mkdir()


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def read_outcome(aws: AwsEmulator, names: ClusterNames) -> dict[str, Any] | None:
    """The launcher's job record, or None while there is none."""
    body = aws.read_object(names.bucket, names.job_record_key)
    if body is None:
        return None
    try:
        record = json.loads(body)
    except json.JSONDecodeError:
        return {"outcome": "unreadable", "raw": body[:200].decode(errors="replace")}
    return record if isinstance(record, dict) else {"outcome": "unreadable", "raw": str(record)}


def replaced_instances(aws: AwsEmulator, names: ClusterNames) -> list[str]:
    """The instances the job record counts as taken out of service before their job loop
    (``job/replaced/<id>.json``: early exits and failed boots)."""
    prefix = names.checkpoint_prefix + REPLACED_PREFIX
    keys = aws.list_keys(names.bucket, prefix)
    return sorted(k[len(prefix) : -len(".json")] for k in keys if k.endswith(".json"))


def complete_steps(aws: AwsEmulator, names: ClusterNames) -> list[int]:
    """Checkpoint steps whose COMPLETE marker is in S3."""
    keys = aws.list_keys(names.bucket, names.checkpoint_prefix)
    steps = (step_of(k.split("/")[-2]) for k in keys if k.endswith(f"/{MARKER}"))
    return sorted(n for n in steps if n is not None)


def run_once(options: RehearsalOptions, spec: ClusterSpec) -> dict[str, Any]:
    """Run the scenario once into ``options.out_dir``; the facts for the report."""
    out = options.out_dir.resolve()
    _prepare(out)
    events = EventLog(options.echo)
    cpu_before = _own_cpu_seconds()
    sample_dir = out / SAMPLES_DIR
    run_id = uuid.uuid4().hex
    facts: dict[str, Any] = {
        "scenario": {**options.scenario.to_json(), "notice_seconds": options.notice_s},
        "spec": {
            "path": str(options.spec_path.resolve()),
            "name": spec.name,
            "sha256": spec_digest(options.spec_path),
            "training_sha256": training_digest(spec),
            "seed": spec.job.seed,
            "steps": spec.job.total_steps,
        },
        "out_dir": str(out),
        "started_wall": events.started_wall,
    }
    aws = AwsEmulator(region_for(spec)).start()
    proxy: SwitchableProxy | None = None
    simulator: GroupSimulator | None = None
    injector: FaultInjector | None = None
    try:
        names = aws.provision(spec, options.spec_path.read_text())
        proxy = SwitchableProxy(("127.0.0.1", aws.port)).start()
        events.add(
            "emulators",
            f"moto {aws.endpoint_url} (S3 via {proxy.url}); groups "
            + ", ".join(f"{n} x{spec.group(g).count}" for g, n in names.asg_names.items())
            + f"; checkpoints {names.checkpoint_uri}",
        )
        steps = StepWatcher(sample_dir)
        ctx = InstanceContext(
            names=names,
            moto_url=aws.endpoint_url,
            s3_url=proxy.url,
            sample_dir=sample_dir,
            run_id=run_id,
        )
        containers = _containers(options, names, run_id, out)
        if containers is not None:
            events.add(
                "containers",
                "every launcher in a container: "
                + ", ".join(f"{role} {containers.image(role)}" for role in ROLE_TAGS),
            )
            facts["containers"] = {
                "images": {role: containers.image(role) for role in ROLE_TAGS},
                "stand_ins": dict(STAND_INS),
            }
        simulator = GroupSimulator(
            aws=aws,
            ctx=ctx,
            spec_path=options.spec_path,
            out_dir=out,
            events=events,
            launcher_args=options.launcher_args,
            containers=containers,
        )
        injector = FaultInjector(
            options.scenario.faults,
            simulator=simulator,
            aws=aws,
            names=names,
            proxy=proxy,
            steps=steps,
            events=events,
            notice_s=options.notice_s,
        )
        simulator.launch_fault = injector.on_launch
        simulator.start()
        injector.start()
        stopped_jobs: list[dict[str, Any]] = []
        desired = DesiredWatch()
        end_reason, timed_out = _watch(
            options, spec, aws, names, simulator, injector, steps, events, stopped_jobs, desired
        )
        injector.stop()
        facts["end_reason"], facts["timed_out"] = end_reason, timed_out
        facts["stopped_jobs"] = stopped_jobs
        facts["groups_desired_at_end"] = aws.desired_capacities(names)
        facts["groups_max_at_end"] = aws.max_sizes(names)
        facts["scheduled_actions_at_end"] = aws.scheduled_actions(names)
        facts["instances_running_at_end"] = [
            i.instance_id for i in aws.instances(names.cluster) if i.state == "running"
        ]
        # What is still alive before the rehearsal cleans up: the report says what it found.
        facts["processes_left"] = simulator.processes_left()
        simulator.shutdown()
        record = read_outcome(aws, names)
        facts["outcome"] = record.get("outcome", "unknown") if record else NO_OUTCOME
        facts["job_record"] = record
        facts["replaced_in_record"] = replaced_instances(aws, names)
        job_record = JobRecord(names.checkpoint_uri, s3_client=aws.client("s3"))
        facts["evicted_in_record"] = job_record.evicted()
        facts["hangs_in_record"] = job_record.hangs()
        decisions = job_record.decisions(limit=MAX_DECISIONS)
        records = read_sample_logs(sample_dir)
        final = audit.final_step(records)
        facts["final_step"] = final
        facts["final_checkpoint"] = _save_final_checkpoint(aws, names, out, final, events)
        facts["tensorboard"] = _save_tensorboard(aws, names, out, events)
        facts["s3_proxy"] = {"connections": proxy.connections, "reset": proxy.refused}
    finally:
        if injector is not None and injector.is_alive():
            injector.stop()
        if simulator is not None:
            simulator.shutdown()
        if proxy is not None:
            proxy.stop()
        aws.stop()
    facts["wall_seconds"] = round(events.elapsed(), 1)
    # The emulators' own cost (moto, IMDS, the proxy, the polling), apart from the instances'.
    facts["rehearsal_cpu_seconds"] = round(_own_cpu_seconds() - cpu_before, 1)
    facts.update(_audit(spec, records, injector, simulator, events.started_wall))
    facts["data_tier"] = data_tier_facts(
        spec,
        names.asg_names,
        decisions,
        desired,
        facts["instances"],
        started_wall=events.started_wall,
        ended_t=facts["wall_seconds"],
        jobs_resumed=len(facts["stopped_jobs"]),
    )
    facts["bill"] = bill_facts(
        (facts.get("job_record") or {}).get("bill"),
        facts["instances"],
        ended_t=facts["wall_seconds"],
        started_wall=events.started_wall,
        resumed=bool(facts.get("stopped_jobs")),
    )
    facts["events"] = [e.to_json() for e in events.events()]
    return facts


def _containers(
    options: RehearsalOptions, names: ClusterNames, run_id: str, out: Path
) -> ContainerLauncher | None:
    """The container launcher of ``--image`` (None without it; the CLI has checked that its
    images are here, ``containers.check_images``)."""
    if options.image is None:
        return None
    return ContainerLauncher(
        docker=docker_client(),
        repository=options.image,
        names=names,
        spec_text=options.spec_path.read_text(),
        run_id=run_id,
        out_dir=out,
    )


def _watch(
    options: RehearsalOptions,
    spec: ClusterSpec,
    aws: AwsEmulator,
    names: ClusterNames,
    simulator: GroupSimulator,
    injector: FaultInjector,
    steps: StepWatcher,
    events: EventLog,
    stopped_jobs: list[dict[str, Any]],
    desired_watch: DesiredWatch,
) -> tuple[str, bool]:
    """Wait for the end; (why it ended, whether the time ran out). A job that ends ``stopped``
    is continued up to ``options.resume_stopped`` times (its record, with the step it stopped
    at, goes into ``stopped_jobs``). Every group's desired capacity is looked at each pass
    (``desired_watch``; a change is a ``group-desired`` event)."""
    deadline = time.monotonic() + options.timeout_s
    total = spec.job.total_steps or 0
    progress_every = max(1, total // 10) if total else 10
    reported_step = 0
    outcome: str | None = None
    quiet_since: float | None = None
    while True:
        time.sleep(_LOOP_S)
        step = steps.current_step()
        if step >= reported_step + progress_every:
            reported_step = step - step % progress_every
            events.add("progress", f"step {step}" + (f" of {total}" if total else ""))
        record = read_outcome(aws, names)
        if record is not None and record.get("outcome") != outcome:
            outcome = str(record.get("outcome"))
            events.add(
                "outcome",
                f"job record: {outcome} ({record.get('reason', '')}) by {record.get('by', '?')}",
            )
        desired = aws.desired_capacities(names)
        for asg, value, old in desired_watch.observe(events.elapsed(), desired):
            was = "" if old is None else f" (was {old})"
            events.add("group-desired", f"{asg} desired {value}{was}", asg=asg, desired=value)
        live = simulator.live_runs()
        launched = bool(simulator.runs())
        if launched and not live and not injector.busy() and all(v == 0 for v in desired.values()):
            if outcome == "stopped" and len(stopped_jobs) < options.resume_stopped:
                stopped_jobs.append({**(record or {}), "step": steps.current_step()})
                injector.release_capacity()  # capacity-gone holds until the job's end
                caps = options.resume_max_usd
                max_usd = caps[min(len(stopped_jobs), len(caps)) - 1] if caps else None
                start_next_job(options.spec_path, aws, events, max_usd=max_usd)
                outcome = None
                continue
            return "every group at 0 and every instance terminated", False
        # Every launcher gone: only a scheduled action (the budget's backstop) may change things.
        if (
            live
            and not any(r.launcher_running for r in live)
            and not injector.busy()
            and not aws.scheduled_actions(names)
        ):
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= options.settle_s:
                return (
                    f"every launcher exited and nothing changed for {options.settle_s:g}s, "
                    f"but {len(live)} instance(s) still run",
                    False,
                )
        else:
            quiet_since = None
        if time.monotonic() >= deadline:
            events.add("timeout", f"the rehearsal ran out of time ({options.timeout_s:.0f}s)")
            return f"timed out after {options.timeout_s:.0f}s", True


def start_next_job(
    spec_path: Path, aws: AwsEmulator, events: EventLog, *, max_usd: float | None = None
) -> None:
    """``hetero job start --resume`` as a user would run it, against the emulated AWS: the
    stopped job's record moves to ``job-history/``, a new job id goes into the pointer and every
    group goes back to its count; ``max_usd``: the new job's own budget (``--max-usd``).
    Priced as on AWS: Spot from ``DescribeSpotPriceHistory``, which the emulator answers with
    the spec's catalogue estimate (``AwsEmulator._answer_spot_prices``; the rehearsal specs'
    groups are all Spot, so the Price List API, which moto lacks, is not asked).
    ``RuntimeError`` when it refuses."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(FAKE_CREDENTIALS)
    env["AWS_ENDPOINT_URL"] = aws.endpoint_url
    env[call_log.ENV_PRINCIPAL] = "user"
    argv = [
        sys.executable, "-m", "training.cli", "job", "start",
        "--spec", str(spec_path), "--resume", "--region", aws.region,
        *(["--max-usd", f"{max_usd:g}"] if max_usd is not None else []),
    ]  # fmt: skip
    started = time.time()  # the event's own time is the command's end, after its launches
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"hetero job start --resume exited {proc.returncode}: {proc.stderr}")
    events.add(
        "job-start",
        "hetero job start --resume: " + "; ".join(proc.stdout.splitlines()),
        started=started,
    )


def _save_final_checkpoint(
    aws: AwsEmulator, names: ClusterNames, out: Path, final_step: int, events: EventLog
) -> dict[str, Any] | None:
    """Download the newest complete checkpoint from the emulated S3 into
    ``<out>/final-checkpoint/step-N/`` (moto goes away with the rehearsal)."""
    steps = complete_steps(aws, names)
    if not steps:
        events.add("checkpoint", "no complete checkpoint in S3")
        return None
    step = steps[-1]
    dest = out / FINAL_CHECKPOINT_DIR / step_name(step)
    files = aws.download_prefix(names.bucket, f"{names.checkpoint_prefix}step-{step}/", dest)
    events.add("checkpoint", f"downloaded step-{step} ({files} files) to {dest}")
    return {
        "step": step,
        "path": str(dest),
        "complete_steps_in_s3": steps,
        "matches_final_step": step == final_step,
    }


def _save_tensorboard(
    aws: AwsEmulator, names: ClusterNames, out: Path, events: EventLog
) -> str | None:
    """Download every job's TensorBoard event files from the emulated S3 into
    ``<out>/tensorboard/<job>/`` (``training.common.tensorboard_paths``); the folder, or None
    when there were none."""
    prefix = f"{CHECKPOINT_PREFIX}/{TB_FOLDER}/"
    dest = out / TB_FOLDER
    files = aws.download_prefix(names.bucket, prefix, dest)
    events.add("tensorboard", f"downloaded {files} event file(s) to {dest}")
    return str(dest) if files else None


def _rounded(t: float | None) -> float | None:
    return None if t is None else round(t, 3)


def _first_step_seconds(run: InstanceRun, records: list[Any], started_wall: float) -> float | None:
    """A trainer replacement's recovery: seconds from its launcher's start to the first step it
    took part in (the first step applied after its first trainer worker started)."""
    if not run.worker_starts:
        return None
    first_worker = min(run.worker_starts.values())
    after = [rec.time for rec in records if rec.time >= first_worker]
    return round(min(after) - (started_wall + run.launched_t), 2) if after else None


def _launch_fault_fate(run: InstanceRun, runs: list[InstanceRun]) -> dict[str, Any]:
    """What became of an instance hit by a launch fault: when it left service, and the instance
    its group launched next (its replacement), if any."""
    after = [
        r
        for r in runs
        if r.group == run.group
        and run.terminated_t is not None
        and r.index > run.index
        and r.launched_t >= run.terminated_t
    ]
    return {
        "instance": run.instance_id,
        "group": run.group,
        "index": run.index,
        "fault": run.launch_fault.value if run.launch_fault else None,
        "exit_code": run.exit_code,
        "shut_down_from_os": run.shut_down,
        "left_service_s": None
        if run.terminated_t is None
        else round(run.terminated_t - run.launched_t, 2),
        "replaced_by": min(after, key=lambda r: r.launched_t).instance_id if after else None,
    }


def _audit(
    spec: ClusterSpec,
    records: list[Any],
    injector: FaultInjector | None,
    simulator: GroupSimulator | None,
    started_wall: float,
) -> dict[str, Any]:
    job = spec.job
    train = build_split(job.dataset, Split.TRAIN)  # the order covers training only
    epochs = audit.audit_samples(
        records,
        num_samples=len(train),
        batch_size=job.batch_size,
        seed=job.seed,
        layout=audit.layout_for(spec),
        grad_accum_steps=job.grad_accum_steps,
        order=lambda epoch: order_for(train, job.seed, epoch),
    )
    runs: list[InstanceRun] = simulator.runs() if simulator is not None else []
    worker_starts = [s for r in runs for s in r.worker_starts.values()]
    fault_records: list[FaultRecord] = injector.records if injector is not None else []
    trainer_group = spec.trainer_group.name
    interruptions = []
    for rec in fault_records:
        if rec.fault.kind not in _INSTANCE_LOSS:
            continue
        recovery = None
        if rec.fired_wall is not None and rec.fault.group == trainer_group:
            recovery = audit.recovery_seconds(rec.fired_wall, worker_starts, records)
        interruptions.append(
            {
                "fault": rec.fault.describe(),
                "instance": rec.instance,
                "state": rec.state,
                "notice_t": rec.fired_t,
                "terminated_t": rec.terminated_t,
                "step_at_notice": rec.step_at_fire,
                "recovery_seconds": None if recovery is None else round(recovery, 2),
            }
        )
    # Launches past a group's size are replacements; an elastic group's size is its maximum
    # (the launches up to it may be the data-tier controller's, see ``data_tier``).
    counts = {g.name: g.max_size for g in spec.groups}
    resumes = audit.resumes(r.folder / LAUNCHER_LOG for r in runs)
    return {
        "faults": [r.to_json() for r in fault_records],
        "interruptions": interruptions,
        "recovery_seconds": [i["recovery_seconds"] for i in interruptions],
        "replacements": [
            {
                "instance": r.instance_id,
                "group": r.group,
                "index": r.index,
                "private_ip": r.private_ip,
                "launched_t": round(r.launched_t, 2),
                "first_step_seconds": _first_step_seconds(r, records, started_wall)
                if r.group == trainer_group
                else None,
            }
            for r in runs
            if r.index >= counts.get(r.group, 0)
        ],
        "instances": [
            {
                "instance": r.instance_id,
                "group": r.group,
                "role": r.role,
                "index": r.index,
                "private_ip": r.private_ip,
                "launched_t": round(r.launched_t, 2),
                "terminated_t": None if r.terminated_t is None else round(r.terminated_t, 2),
                "ec2_launched_t": _rounded(r.ec2_launched_t),
                "ec2_terminated_t": _rounded(r.ec2_terminated_t),
                "launcher_exit_code": r.exit_code,
                "launcher_killed": r.killed,
                "trainer_workers_started": len(r.worker_starts),
                "log": str(r.folder / LAUNCHER_LOG),
            }
            for r in runs
        ],
        "launch_faults": [_launch_fault_fate(r, runs) for r in runs if r.launch_fault],
        "resumes": resumes,
        "resumed_from_steps": [e["step"] for e in resumes],
        "sample_records": len(records),
        "steps_lost": audit.steps_redone(records),
        "steps_missing": audit.steps_missing(records),
        "samples": [e.to_json() for e in epochs],
        "samples_lost": {str(e.epoch): e.lost for e in epochs},
        "samples_repeated": {str(e.epoch): e.repeated for e in epochs},
    }


def _baseline_checkpoint(baseline_dir: Path, spec_path: Path) -> tuple[Path | None, str | None]:
    """The final checkpoint of an earlier rehearsal in ``baseline_dir``, or why there is none."""
    path = baseline_dir / REPORT_FILE
    try:
        facts = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return None, f"no readable {path}: {e}"
    if facts.get("spec", {}).get("training_sha256") != training_digest(load_spec(spec_path)):
        return None, f"{path} rehearsed another spec (or another version of it)"
    if facts.get("scenario", {}).get("faults"):
        return None, f"{path} is not an uninterrupted run (it has faults)"
    checkpoint = (facts.get("final_checkpoint") or {}).get("path")
    if not checkpoint or not Path(checkpoint).is_dir():
        return None, f"{path} names no final checkpoint on disk"
    return Path(checkpoint), None


def rehearse(
    options: RehearsalOptions,
    *,
    baseline_dir: Path | None = None,
    run_baseline: bool = True,
    render: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[dict[str, Any], int]:
    """The whole rehearsal: the baseline (unless reused or not wanted, and never for a
    scenario without faults), the run, the verdict; writes ``rehearsal.json``; (report, exit
    code: 0 when every invariant holds, else 1)."""
    spec = load_spec(options.spec_path)
    started = time.monotonic()
    out = options.out_dir.resolve()
    baseline_path: Path | None = None
    baseline_problem: str | None = None
    faults = options.scenario.faults
    if baseline_dir is not None:
        baseline_path, baseline_problem = _baseline_checkpoint(baseline_dir, options.spec_path)
    elif run_baseline and faults:
        echo = options.echo or (lambda line: print(line, flush=True))
        echo(f"baseline: an uninterrupted rehearsal of {options.spec_path} into {out / 'baseline'}")
        base_opts = replace(
            options,
            out_dir=out / BASELINE_DIR,
            scenario=Scenario(name="baseline"),
            timeout_s=options.timeout_s / 2,
            echo=lambda line: echo("baseline " + line),
        )
        shutil.rmtree(base_opts.out_dir, ignore_errors=True)
        base_facts = run_once(base_opts, spec)
        (base_opts.out_dir / REPORT_FILE).write_text(json.dumps(base_facts, indent=2))
        baseline_path, baseline_problem = _baseline_checkpoint(base_opts.out_dir, options.spec_path)
        if base_facts.get("outcome") != "finished":
            baseline_problem = f"the baseline ended {base_facts.get('outcome')}"
    remaining = options.timeout_s - (time.monotonic() - started)
    facts = run_once(replace(options, timeout_s=max(remaining, 1.0)), spec)
    comparison: params.ParamComparison | None = None
    final = facts.get("final_checkpoint")
    if baseline_path is not None and final:
        comparison = params.compare(Path(final["path"]), baseline_path)
    facts["baseline"] = {
        "checkpoint": str(baseline_path) if baseline_path else None,
        "problem": baseline_problem,
        "ran": baseline_dir is None and run_baseline and bool(faults),
    }
    facts["params_equal_uninterrupted"] = comparison.equal if comparison else None
    facts["params_comparison"] = comparison.to_json() if comparison else None
    invariants = report.invariants(facts, spec, options.scenario, baseline=baseline_path)
    facts["invariants"] = invariants
    facts["failed_invariants"] = [k for k, v in invariants.items() if not v["ok"]]
    facts["ok"] = not facts["failed_invariants"]
    (out / REPORT_FILE).write_text(json.dumps(facts, indent=2, default=str))
    if render is not None:
        with contextlib.suppress(Exception):
            render(facts)
    return facts, 0 if facts["ok"] else 1
