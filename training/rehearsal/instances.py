"""The group simulator: every running moto instance backed by exactly one process tree.

For each instance moto reports ``running`` the simulator creates ``<out>/instances/<id>/`` (the
instance's working folder, with its ``launcher.log``), starts an IMDSv2 emulator for it and
starts the real container entry point, ``python -m training.cli launch``, in a session of its
own. Instances are EC2's, not the simulator's: when a launcher exits by itself the instance keeps
running (its exit code is an event); when moto shows an instance terminated (a fault, or the
launcher scaling the groups to zero) its whole process tree is SIGKILLed, as termination would.

Every process an instance starts carries ``HETERO_REHEARSAL_RUN`` and
``HETERO_REHEARSAL_INSTANCE`` in its environment, so a tree is found whole even after a parent
died and its children were re-parented.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from training.common import call_log
from training.common.names import (
    ENV_ASG_NAMES,
    ENV_CHECKPOINT_URI,
    ENV_CLUSTER,
    ENV_GROUP,
    ENV_INSTANCE_ID,
    ENV_JOB_PARAMETER,
    ENV_REGION,
    ENV_SAMPLE_LOG_DIR,
    TAG_CLUSTER,
    TAG_GROUP,
    TAG_ROLE,
)
from training.rehearsal.aws import FAKE_CREDENTIALS, AwsEmulator, ClusterNames, EmulatedInstance
from training.rehearsal.containers import ContainerLauncher, remove_labelled
from training.rehearsal.events import EventLog
from training.rehearsal.faults import FaultKind
from training.rehearsal.imds import ImdsEmulator

log = logging.getLogger(__name__)

RUN_ENV = "HETERO_REHEARSAL_RUN"
INSTANCE_ENV = "HETERO_REHEARSAL_INSTANCE"
LIFECYCLE_HOOK_ENV = "HETERO_LIFECYCLE_HOOK"
COLLECTIVE_TIMEOUT_ENV = "HETERO_COLLECTIVE_TIMEOUT_S"
COLLECTIVE_TIMEOUT_S = 20
SPOT_POLL_S = 0.5
RESTART_BACKOFF_S = 2.0
BACKSTOP_LEAD_S = 5.0
HANG_FLOOR_S = 30.0
"""``hetero launch --hang-floor`` of every emulated instance: longer than a generation's start
to its first step on a busy machine and than the rehearsal's collective timeout
(``COLLECTIVE_TIMEOUT_S``: a peer stuck in a collective fails on its own first)."""
"""``hetero launch --backstop-lead`` of every emulated instance."""
BACKSTOP_AFTER_S = 60.0
"""``hetero launch --backstop-after`` of every emulated instance (``hetero rehearse
--backstop-after`` sets another): the budget's scheduled action runs this long after its
deadline. A launcher that is there ends the job within a heartbeat of the deadline (2 s), but a
trainer that starts just past it still makes its step and saves, and on a loaded machine its
start alone took up to 40 s. (The rehearsal's scale-in terminates at once: no lifecycle wait.)"""
LAUNCHER_LOG = "launcher.log"
# Variables of the rehearsal's own environment an instance must not inherit: an instance learns
# its group from its tags, and real credentials must never reach moto's clients.
_DROPPED_ENV = (
    ENV_GROUP,
    ENV_JOB_PARAMETER,
    ENV_INSTANCE_ID,
    "AWS_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_REGION",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_ENDPOINT_URL_EC2",
    "AWS_ENDPOINT_URL_AUTO_SCALING",
    "AWS_ENDPOINT_URL_S3",
    "AWS_EC2_METADATA_DISABLED",
)


BOOT_GIVE_UP_S = 1.0
"""A failed boot's stand-in: how long before it gives up (the real one tries each network step
``infra.instance_group.BOOT_ATTEMPTS`` times)."""


def failed_boot_argv() -> list[str]:
    """A ``boot-fail`` instance's stand-in for its user data: it says what the real one says
    when a step never succeeds, and exits non-zero without starting the launcher. The simulator
    then does what the user data's EXIT trap and EC2 would do (``AwsEmulator.shut_down_from_os``).
    """
    message = (
        'hetero boot: giving up on "docker pull"; the launcher was not started\n'
        "hetero boot: the boot failed (exit 1); shutting down: this instance terminates and its "
        "group replaces it"
    )
    code = f"import sys, time; time.sleep({BOOT_GIVE_UP_S}); print({message!r}); sys.exit(1)"
    return [sys.executable, "-c", code]


def launcher_argv(spec_path: Path, imds_url: str, extra: Sequence[str] = ()) -> list[str]:
    """The instance's entry point, as the image runs it (one place to add flags). The IMDS
    endpoint is not a flag: the launcher finds it in ``AWS_EC2_METADATA_SERVICE_ENDPOINT``, as
    boto3 does (``launcher_env``)."""
    launch = [sys.executable, "-m", "training.cli", "launch", "--spec", str(spec_path)]
    return [*launch, *launcher_flags(extra)]


def launcher_flags(extra: Sequence[str] = ()) -> list[str]:
    """The flags every emulated instance's launcher gets after ``--spec`` (time scaled down)."""
    return [
        "--spot-poll",
        str(SPOT_POLL_S),
        # Time scaled down like the two-minute notice: the first retry after a failure waits
        # 2 s, not 10 (then 4, 8...), and the group is listed every second.
        "--restart-backoff",
        str(RESTART_BACKOFF_S),
        "--poll",
        "1",
        # A running host's record writes and watches (failed boots, live trainers): every 2 s,
        # not 30.
        "--heartbeat",
        "2",
        # The budget's scheduled action is still put 5 s before its start, not 60 (time scaled
        # down like the notice), and runs BACKSTOP_AFTER_S after the deadline.
        "--backstop-lead",
        str(BACKSTOP_LEAD_S),
        "--backstop-after",
        str(BACKSTOP_AFTER_S),
        # Thirty seconds without progress is a hang, not fifteen minutes.
        "--hang-floor",
        str(HANG_FLOOR_S),
        *extra,
    ]


@dataclass(frozen=True)
class InstanceContext:
    """What every emulated instance is told, besides its own IMDS endpoint."""

    names: ClusterNames
    moto_url: str
    """EC2 and Auto Scaling (and anything else) go straight to moto."""
    s3_url: str
    """S3 goes through the switchable proxy (the S3 outage)."""
    sample_dir: Path
    run_id: str


def launcher_env(
    base: Mapping[str, str], ctx: InstanceContext, *, imds_url: str, instance_id: str
) -> dict[str, str]:
    """The environment the stack's user data would give the container, pointed at the
    emulators (``HETERO_GROUP`` is not set: the launcher finds its group through IMDS tags)."""
    env = {k: v for k, v in base.items() if k not in _DROPPED_ENV}
    env.update(FAKE_CREDENTIALS)
    env.update(
        {
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": imds_url,
            "AWS_ENDPOINT_URL": ctx.moto_url,
            "AWS_ENDPOINT_URL_S3": ctx.s3_url,
            ENV_REGION: ctx.names.region,
            ENV_CLUSTER: ctx.names.cluster,
            ENV_CHECKPOINT_URI: ctx.names.checkpoint_uri,
            ENV_ASG_NAMES: ",".join(ctx.names.asg_names.values()),
            LIFECYCLE_HOOK_ENV: ctx.names.lifecycle_hook,
            **({ENV_JOB_PARAMETER: ctx.names.job_parameter} if ctx.names.job_parameter else {}),
            ENV_SAMPLE_LOG_DIR: str(ctx.sample_dir),
            COLLECTIVE_TIMEOUT_ENV: str(COLLECTIVE_TIMEOUT_S),
            ENV_INSTANCE_ID: instance_id,  # the boot reads it from IMDS and passes it on
            RUN_ENV: ctx.run_id,
            INSTANCE_ENV: instance_id,
            "PYTHONUNBUFFERED": "1",
            # The instance role: when the rehearsal records AWS calls, these are the role's.
            call_log.ENV_PRINCIPAL: "instance",
        }
    )
    return env


def instance_tmpdir(instance_id: str) -> Path:
    """A fresh temporary folder for the instance (its ``TMPDIR``: an EC2 instance's /tmp is its
    own). Short, under the system's temporary folder: Unix socket paths made in it (e.g.
    multiprocessing's forkserver) must stay within ~100 characters."""
    return Path(tempfile.mkdtemp(prefix=f"hr-{instance_id[-8:]}-"))


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def is_trainer_worker(proc: psutil.Process) -> bool:
    """A trainer rank: ``python -m training.trainer`` started by torchrun (not torchrun itself,
    not a process forked by the rank)."""
    cmd = _cmdline(proc)
    if "training.trainer" not in cmd or "torch.distributed.run" in cmd:
        return False
    try:
        parent = proc.parent()
    except psutil.Error:
        return False
    return parent is not None and "torch.distributed.run" in _cmdline(parent)


def is_data_server(proc: psutil.Process) -> bool:
    """``hetero serve`` (``python -m training.cli serve``)."""
    cmd = _cmdline(proc).split()
    return "training.cli" in cmd and "serve" in cmd


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def marked_processes(run_id: str, instance_id: str | None = None) -> list[psutil.Process]:
    """Live processes whose environment carries this rehearsal's marker (and instance)."""
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        mine = env.get(RUN_ENV) == run_id and instance_id in (None, env.get(INSTANCE_ENV))
        if mine and proc.pid != os.getpid() and alive(proc):
            found.append(proc)
    return found


def describe_process(proc: psutil.Process) -> dict[str, Any]:
    try:
        env_instance = proc.environ().get(INSTANCE_ENV)
    except psutil.Error:
        env_instance = None
    cmd = _cmdline(proc)
    return {
        "pid": proc.pid,
        "instance": env_instance,
        "cmdline": cmd[:300] + ("..." if len(cmd) > 300 else ""),
    }


def kill_processes(procs: Sequence[psutil.Process], timeout_s: float = 5.0) -> None:
    """SIGKILL each and wait (bounded) until they are gone; children of this process are reaped."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(list(procs), timeout=timeout_s)


@dataclass
class InstanceRun:
    """One emulated instance and the process tree that is its workload."""

    instance_id: str
    group: str
    role: str
    private_ip: str
    index: int
    """Position in its group's launch order (0 .. count-1: the original instances)."""
    folder: Path
    imds: ImdsEmulator
    popen: subprocess.Popen[bytes]
    log_file: IO[bytes]
    launched_t: float
    tmpdir: Path | None = None
    """The instance's ``TMPDIR`` (removed with the instance)."""
    exit_code: int | None = None
    """The launcher's exit code once it exited by itself."""
    killed: bool = False
    """The rehearsal SIGKILLed the launcher (a fault, or the instance's termination)."""
    terminated: bool = False
    terminated_t: float | None = None
    """When a look found it terminated (seconds since the start, like ``launched_t``)."""
    ec2_launched_t: float | None = None
    """When moto created it, seconds since the start (``EmulatedInstance.launched_at``): the
    start of its instance-seconds, where ``launched_t`` is the look that found it running."""
    ec2_terminated_t: float | None = None
    """When moto terminated it, seconds since the start (``EmulatedInstance.terminated_at``)."""
    procs: dict[int, psutil.Process] = field(default_factory=dict)
    """Every descendant seen while the instance ran."""
    worker_starts: dict[int, float] = field(default_factory=dict)
    """Trainer worker pid -> its start (wall time)."""
    launch_fault: FaultKind | None = None
    """``boot-fail``: the tree is the boot's stand-in, no launcher; ``early-exit``: the
    instance's metadata has no tags."""
    shut_down: bool = False
    """A failed boot shut the instance down (``AwsEmulator.shut_down_from_os``)."""
    container_marker: str | None = None
    """The rehearsal's run id when the launcher runs in a container (``--image``): its
    processes are not the client's children and are found by their marker."""

    @property
    def launcher_running(self) -> bool:
        return self.popen.poll() is None

    def live_processes(self) -> list[psutil.Process]:
        """The launcher and every descendant now (tracked ones included, even re-parented; in a
        container, every process that carries the instance's marker)."""
        procs = dict(self.procs)
        if self.container_marker is not None:
            for p in marked_processes(self.container_marker, self.instance_id):
                procs.setdefault(p.pid, p)
        try:
            root = psutil.Process(self.popen.pid)
            procs[root.pid] = root
            for p in root.children(recursive=True):
                procs.setdefault(p.pid, p)
        except psutil.Error:
            pass
        return [p for p in procs.values() if alive(p)]


class GroupSimulator(threading.Thread):
    """Keeps the process trees in step with moto's instances (see the module docstring)."""

    def __init__(
        self,
        *,
        aws: AwsEmulator,
        ctx: InstanceContext,
        spec_path: Path,
        out_dir: Path,
        events: EventLog,
        poll_s: float = 0.5,
        launcher_args: Sequence[str] = (),
        base_env: Mapping[str, str] | None = None,
        command: Callable[[Path, str, Sequence[str]], list[str]] = launcher_argv,
        containers: ContainerLauncher | None = None,
    ) -> None:
        """``command(spec_path, imds_url, launcher_args)`` is each instance's argv (tests swap
        in a stand-in for the launcher); with ``containers``, each launcher runs in a container
        of its role's image instead (``hetero rehearse --image``)."""
        super().__init__(name="group-simulator", daemon=True)
        self.aws = aws
        self.ctx = ctx
        self.spec_path = spec_path.resolve()
        self.out_dir = out_dir
        self.events = events
        self.poll_s = poll_s
        self.launcher_args = tuple(launcher_args)
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.command = command
        self.containers = containers
        self._lock = threading.RLock()
        self._runs: dict[str, InstanceRun] = {}
        self._order: dict[str, list[str]] = {}
        self._stopped = threading.Event()
        self._actions_seen: set[tuple[str, str, float]] = set()
        self.errors = 0
        self.on_worker_started: Callable[[InstanceRun, int], None] | None = None
        self.launch_fault: Callable[[str, int, str], FaultKind | None] | None = None
        """(group, index, instance id) -> the launch fault to apply to that instance, if any."""

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        while not self._stopped.is_set():
            try:
                self.reconcile()
            except Exception as e:  # moto hiccup: say so, keep the processes in step next time
                self.errors += 1
                if self.errors <= 5:
                    self.events.add("simulator-error", f"{type(e).__name__}: {e}")
            self._stopped.wait(self.poll_s)

    def stop(self) -> None:
        self._stopped.set()
        if self.is_alive():
            self.join(timeout=30)

    def reconcile(self) -> None:
        """One pass: start trees for new running instances, kill those of terminated ones,
        notice launchers that exited and trainer workers that started."""
        instances = self.aws.instances(self.ctx.names.cluster)
        # What this look saw happened by now: the launches and terminations it finds count from
        # here, not from when starting or killing each tree is done.
        looked_t = self.events.elapsed()
        seen = {i.instance_id for i in instances}
        with self._lock:
            for inst in instances:
                run = self._runs.get(inst.instance_id)
                if run is None and inst.state == "running":
                    self._launch(inst, looked_t)
                elif run is not None and not run.terminated and inst.state != "running":
                    self._terminate(
                        run, f"moto shows it {inst.state}", looked_t, inst.terminated_at
                    )
            for run in list(self._runs.values()):
                if not run.terminated and run.instance_id not in seen:
                    self._terminate(run, "moto no longer lists it", looked_t)
                if not run.terminated:
                    self._track(run)
            self._scheduled_actions()
            # Auto Scaling's answer to SetInstanceHealth Unhealthy: terminate and replace.
            for instance_id in self.aws.replace_unhealthy(self.ctx.names):
                run = self._runs.get(instance_id)
                who = f"{run.group}:{run.index}" if run else instance_id
                self.events.add(
                    "unhealthy-replaced",
                    f"{who} marked Unhealthy: Auto Scaling terminates it and launches a "
                    "replacement",
                    instance=instance_id,
                )

    def _scheduled_actions(self) -> None:
        """Each scheduled action once when first seen, then run as Auto Scaling does when its
        time comes (``AwsEmulator.run_scheduled_actions``)."""
        actions = self.aws.scheduled_actions(self.ctx.names)
        for a in actions:
            key = (a["group"], a["name"], a["start"])
            if key not in self._actions_seen:
                self._actions_seen.add(key)
                self.events.add("scheduled-action", f"{a['group']}: {a['name']}", **a)
        for a in self.aws.run_scheduled_actions(actions):
            self.events.add("scheduled-action-run", f"{a['group']}: {a['name']} ran", **a)

    # -- instances ---------------------------------------------------------------------------

    def _launch(self, inst: EmulatedInstance, looked_t: float) -> None:
        order = self._order.setdefault(inst.group, [])
        index = len(order)
        order.append(inst.instance_id)
        folder = self.out_dir / "instances" / inst.instance_id
        folder.mkdir(parents=True, exist_ok=True)
        fault = (
            self.launch_fault(inst.group, index, inst.instance_id) if self.launch_fault else None
        )
        tags = {TAG_CLUSTER: self.ctx.names.cluster, TAG_GROUP: inst.group, TAG_ROLE: inst.role}
        imds = ImdsEmulator(
            instance_id=inst.instance_id,
            local_ipv4=inst.private_ip,
            region=self.ctx.names.region,
            tags={} if fault is FaultKind.EARLY_EXIT else tags,
        ).start()
        log_file = open(folder / LAUNCHER_LOG, "ab")  # noqa: SIM115 - closed at termination
        env = launcher_env(self.base_env, self.ctx, imds_url=imds.url, instance_id=inst.instance_id)
        tmp = instance_tmpdir(inst.instance_id)
        env["TMPDIR"] = str(tmp)
        in_container = self.containers is not None and fault is not FaultKind.BOOT_FAIL
        if fault is FaultKind.BOOT_FAIL:
            argv = failed_boot_argv()
        elif self.containers is not None:
            argv = self.containers.argv(
                instance_id=inst.instance_id,
                group=inst.group,
                role=inst.role,
                folder=folder,
                rehearsal_env=launcher_env(
                    {}, self.ctx, imds_url=imds.url, instance_id=inst.instance_id
                ),
                launcher_args=launcher_flags(self.launcher_args),
            )
        else:
            argv = self.command(self.spec_path, imds.url, self.launcher_args)
        try:
            popen = subprocess.Popen(
                argv,
                cwd=folder,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError:
            imds.stop()
            log_file.close()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        run = InstanceRun(
            instance_id=inst.instance_id,
            group=inst.group,
            role=inst.role,
            private_ip=inst.private_ip,
            index=index,
            folder=folder,
            imds=imds,
            popen=popen,
            log_file=log_file,
            launched_t=looked_t,
            ec2_launched_t=None
            if inst.launched_at is None
            else inst.launched_at - self.events.started_wall,
            tmpdir=tmp,
            launch_fault=fault,
            container_marker=self.ctx.run_id if in_container else None,
        )
        self._runs[inst.instance_id] = run
        self.events.add(
            "instance-launched",
            f"{inst.group}:{index} at {inst.private_ip} (launcher pid {popen.pid}, "
            f"IMDS {imds.url})",
            instance=inst.instance_id,
            group=inst.group,
            index=index,
            private_ip=inst.private_ip,
        )

    def _track(self, run: InstanceRun) -> None:
        for proc in run.live_processes():
            if proc.pid not in run.procs and proc.pid != run.popen.pid:
                run.procs[proc.pid] = proc
                if is_trainer_worker(proc):
                    try:
                        started = proc.create_time()
                    except psutil.Error:
                        continue
                    run.worker_starts[proc.pid] = started
                    self.events.add(
                        "trainer-started",
                        f"trainer worker pid {proc.pid}",
                        instance=run.instance_id,
                        pid=proc.pid,
                        started_wall=started,
                    )
                    if self.on_worker_started is not None:
                        self.on_worker_started(run, proc.pid)
        code = run.popen.poll()
        if code is not None and run.exit_code is None and not run.killed:
            run.exit_code = code
            if run.launch_fault is FaultKind.BOOT_FAIL:
                self._shut_down(run, code)
                return
            self.events.add(
                "launcher-exited",
                f"{run.group}:{run.index} launcher exited with code {code} "
                "(the instance keeps running)",
                instance=run.instance_id,
                code=code,
            )

    def _shut_down(self, run: InstanceRun, code: int) -> None:
        """A failed boot's end: its EXIT trap runs ``shutdown -h now`` and EC2 terminates the
        instance (InstanceInitiatedShutdownBehavior ``terminate``); its group replaces it."""
        self.events.add(
            "boot-gave-up",
            f"{run.group}:{run.index} boot exited {code} without starting the launcher: "
            "shutdown -h now, EC2 terminates the instance",
            instance=run.instance_id,
        )
        self.aws.shut_down_from_os(run.instance_id)
        run.shut_down = True

    def _terminate(
        self, run: InstanceRun, why: str, looked_t: float, ended_at: float | None = None
    ) -> None:
        """The instance is gone (a look at ``looked_t`` found it so; moto ended it at
        ``ended_at``, epoch seconds, when known): its whole tree is SIGKILLed, its IMDS
        stops."""
        self._track(run)  # an exit code that came just before the termination
        was_running = run.launcher_running
        self.kill_tree(run)
        run.imds.stop()
        if run.tmpdir is not None:
            shutil.rmtree(run.tmpdir, ignore_errors=True)
        with contextlib.suppress(OSError):
            run.log_file.close()
        run.terminated_t = looked_t
        if ended_at is not None:
            run.ec2_terminated_t = ended_at - self.events.started_wall
        run.terminated = True
        self.events.add(
            "instance-terminated",
            f"{run.group}:{run.index} terminated ({why})"
            + ("; its launcher was still running and is killed" if was_running else ""),
            instance=run.instance_id,
            launcher_was_running=was_running,
        )

    # -- what the fault injector and the end use --------------------------------------------

    def freeze_tree(self, run: InstanceRun) -> None:
        """SIGSTOP the instance's process group and every process of its tree at once: what
        ``kill_tree`` does first (finding every marked process) takes long enough for a short
        write to finish; a frozen tree does nothing more before the SIGKILL."""
        with self._lock:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(run.popen.pid, signal.SIGSTOP)
            for proc in run.live_processes():
                with contextlib.suppress(psutil.Error):
                    proc.suspend()

    def kill_tree(self, run: InstanceRun) -> list[int]:
        """SIGKILL the launcher and every descendant (found by tree and by marker)."""
        with self._lock:
            procs = {p.pid: p for p in run.live_processes()}
            for p in marked_processes(self.ctx.run_id, run.instance_id):
                procs.setdefault(p.pid, p)
            if run.launcher_running:
                run.killed = True
            if run.container_marker is not None and self.containers is not None:
                self.containers.remove(run.instance_id)  # every process in it, at once
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(run.popen.pid, signal.SIGKILL)
            # The launcher is reaped by its Popen only: reaped elsewhere, Popen would report 0.
            with contextlib.suppress(OSError):
                run.popen.kill()
            kill_processes([p for pid, p in procs.items() if pid != run.popen.pid])
            with contextlib.suppress(subprocess.TimeoutExpired):
                run.popen.wait(timeout=5)
            return sorted(procs)

    def kill_matching(
        self, run: InstanceRun, predicate: Callable[[psutil.Process], bool]
    ) -> list[int]:
        """SIGKILL the processes of ``run`` for which ``predicate`` holds, with their trees."""
        with self._lock:
            targets: dict[int, psutil.Process] = {}
            for proc in run.live_processes():
                if predicate(proc):
                    targets[proc.pid] = proc
                    with contextlib.suppress(psutil.Error):
                        for child in proc.children(recursive=True):
                            targets.setdefault(child.pid, child)
            kill_processes(list(targets.values()))
            return sorted(targets)

    def freeze_matching(
        self, run: InstanceRun, predicate: Callable[[psutil.Process], bool]
    ) -> list[int]:
        """SIGSTOP the processes of ``run`` for which ``predicate`` holds (not their trees: a
        rank's data loader workers go on, as they would while the rank is stuck)."""
        with self._lock:
            frozen = []
            for proc in run.live_processes():
                if predicate(proc):
                    with contextlib.suppress(psutil.Error):
                        proc.suspend()
                        frozen.append(proc.pid)
            return sorted(frozen)

    def instance(self, group: str, index: int) -> InstanceRun | None:
        """The ``index``-th instance the group launched (None: not launched yet)."""
        with self._lock:
            order = self._order.get(group, [])
            return self._runs[order[index]] if index < len(order) else None

    def runs(self) -> list[InstanceRun]:
        with self._lock:
            return list(self._runs.values())

    def live_runs(self) -> list[InstanceRun]:
        return [r for r in self.runs() if not r.terminated]

    def processes_left(self) -> list[dict[str, Any]]:
        """Every process this rehearsal started, or a descendant of one, still alive now."""
        procs = {p.pid: p for run in self.runs() for p in run.live_processes()}
        for p in marked_processes(self.ctx.run_id):
            procs.setdefault(p.pid, p)
        return [describe_process(p) for p in sorted(procs.values(), key=lambda p: p.pid)]

    def shutdown(self) -> None:
        """Stop the loop, then kill every tree still running and stop every IMDS (the end)."""
        self.stop()
        with self._lock:
            for run in self._runs.values():
                self.kill_tree(run)
                if run.tmpdir is not None:
                    shutil.rmtree(run.tmpdir, ignore_errors=True)
                if not run.terminated:
                    run.imds.stop()
                    with contextlib.suppress(OSError):
                        run.log_file.close()
            if self.containers is not None:
                remove_labelled(self.containers.docker, self.ctx.run_id)
            leftovers = marked_processes(self.ctx.run_id)
            kill_processes(leftovers)
        # Give re-parented zombies a moment to be reaped by whoever adopted them.
        deadline = time.monotonic() + 2.0
        while marked_processes(self.ctx.run_id) and time.monotonic() < deadline:
            time.sleep(0.1)
