"""``hetero local``: the whole heterogeneous topology as processes on this machine.

One data server per dataprep instance of the spec (on free loopback ports from the spec's port
upward), health-checked, then torchrun with the trainer, which streams batches from them and,
when done, shuts them down with the Shutdown RPC. Ctrl-C or SIGTERM stops everything; no process
is left behind either way. A spec without dataprep groups runs the trainer alone with its local
DataLoader. With an elastic dataprep group, servers come and go while the trainer runs
(``training.local.tier``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from training.common.hosts import LOOPBACK
from training.common.tensorboard_paths import FOLDER as TB_FOLDER
from training.common.tensorboard_paths import logdir_command
from training.dataplane import autoscale, discovery
from training.local.tier import LocalDataTier, reports_serving
from training.processes import roles
from training.processes.supervised import run_role
from training.processes.supervisor import Child, Supervisor, exit_code_for_signal
from training.spec import ClusterSpec, load_spec

log = logging.getLogger(__name__)

SUMMARY_FILE = "local-run.json"
_PORT_ATTEMPTS = 3


class LocalRunError(RuntimeError):
    """The local topology could not be brought up (a data server failed to start)."""


@dataclass
class LocalRunSummary:
    """What happened, written to ``<run dir>/local-run.json`` at the end of every run."""

    exit_code: int
    trainer_exit_code: int | None = None
    data_servers: dict[str, int | None] = field(default_factory=dict)
    """``host:port`` -> exit code (0 after a Shutdown RPC; 128+N if it had to be stopped)."""
    servers_stopped_by_trainer: bool = False
    """True when every data server exited by itself after the trainer finished."""
    stopped_by: str | None = None
    """Why the run was stopped early (a signal), if it was."""
    data_servers_stopped_before_serving: list[str] = field(default_factory=list)
    """Elastic group: servers stopped while they were starting (a scale-in, the job's end)."""
    wall_s: float = 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", default="specs/local-cpu.toml", help="cluster spec (TOML)")
    parser.add_argument("--run-dir", default="runs/local", help="output folder of the run")
    parser.add_argument(
        "--nproc",
        type=int,
        help="trainer processes (default: the trainer group's ranks, capped to this machine)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds processes get to exit after a stop before they are killed",
    )
    parser.add_argument(
        "--server-start-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for the data servers to report healthy",
    )


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    if args.nproc is not None and args.nproc < 1:
        print(f"--nproc must be at least 1, got {args.nproc}", file=sys.stderr)
        return 2
    return run_local(
        spec,
        spec_path=args.spec,
        run_dir=Path(args.run_dir),
        nproc=args.nproc,
        grace_s=args.grace,
        server_start_timeout_s=args.server_start_timeout,
    ).exit_code


def visible_gpus(proc_gpus: Path = Path("/proc/driver/nvidia/gpus")) -> int:
    """NVIDIA GPUs this process may use, without importing torch (seconds saved per run):
    the driver's GPU list, narrowed by ``CUDA_VISIBLE_DEVICES`` when it is set."""
    try:
        present = sum(1 for _ in proc_gpus.iterdir())
    except OSError:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    return min(present, len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"]))


def default_nproc(spec: ClusterSpec, gpus: int | None = None) -> int:
    """The trainer group's total ranks, capped by this machine: its GPUs if any, else a quarter
    of the cores (CPU ranks compete with the data servers for the same cores)."""
    g = spec.trainer_group
    wanted = g.count * g.ranks_per_instance
    gpus = visible_gpus() if gpus is None else gpus
    cap = gpus if gpus > 0 else max(1, (os.cpu_count() or 1) // 4)
    if wanted > cap:
        log.warning("the spec's trainer has %d ranks; running %d on this machine", wanted, cap)
    return min(wanted, cap)


def data_server_count(spec: ClusterSpec) -> int:
    """Data servers the spec describes: one per dataprep instance and rank."""
    return sum(g.count * g.ranks_per_instance for g in spec.dataprep_groups)


def free_port(start: int, taken: set[int], host: str = LOOPBACK) -> int:
    """The first port from ``start`` upward that is not in ``taken`` and can be bound now."""
    for port in range(start, 65536):
        if port in taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    raise LocalRunError(f"no free TCP port from {start} upward on {host}")


def wait_healthy(address: str, child: Child, timeout_s: float, sup: Supervisor) -> bool:
    """True once the server at ``address`` reports SERVING over the standard health service;
    False if its process exits first or a stop is requested. Raises ``LocalRunError`` on
    timeout."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        while time.monotonic() < deadline:
            if child.returncode is not None or sup.stop_signal is not None:
                return False
            if reports_serving(channel, timeout_s=1.0):
                return True
            time.sleep(0.2)
    raise LocalRunError(f"data server {address} did not report healthy within {timeout_s:.0f}s")


def run_local(
    spec: ClusterSpec,
    *,
    spec_path: str | Path,
    run_dir: Path,
    nproc: int | None = None,
    grace_s: float = 30.0,
    server_start_timeout_s: float = 120.0,
    server_exit_timeout_s: float = 30.0,
) -> LocalRunSummary:
    """Run the spec's topology locally to the end (or to a stop signal) and return its summary.

    Promises: on return no process started here is alive; the summary is also written to
    ``run_dir/local-run.json``. The exit code is the trainer's, 128+N after signal N, and 1 if
    the trainer succeeded but a data server failed.
    """
    started = time.monotonic()
    run_dir.mkdir(parents=True, exist_ok=True)
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    summary = LocalRunSummary(exit_code=1)
    servers: list[tuple[str, Child]] = []
    with Supervisor(grace_s=grace_s, subreaper=True) as sup:
        sup.install_signal_handlers()
        starter = ServerStarter(spec, spec_path, logs, sup)
        tier: LocalDataTier | None = None
        try:
            servers = _start_data_servers(spec, server_start_timeout_s, starter)
        except LocalRunError as e:
            log.error("%s", e)
            _print_server_logs(logs)
        else:
            policy = autoscale.policy_for(spec)
            if policy is not None and sup.stop_signal is None:
                tier = _elastic_tier(spec, run_dir, servers, starter, policy.group)
            if sup.stop_signal is None:
                summary.trainer_exit_code = _run_trainer(
                    spec, spec_path, run_dir, servers, nproc, sup, tier
                )
            if tier is not None:
                tier.finish()
                servers = tier.started
                summary.data_servers_stopped_before_serving = sorted(tier.stopped)
            early = set(summary.data_servers_stopped_before_serving)
            if summary.trainer_exit_code is not None and sup.stop_signal is None:
                # The trainer's rank 0 sends Shutdown to every server; they should exit now.
                summary.servers_stopped_by_trainer = sup.wait_all(server_exit_timeout_s) and all(
                    c.returncode == 0 for a, c in servers if a not in early
                )
                if servers and not summary.servers_stopped_by_trainer:
                    log.warning("data servers did not all stop after training; stopping them")
        sup.shutdown(grace_s)
        summary.data_servers = {addr: c.returncode for addr, c in servers}
        if sup.stop_signal is not None:
            summary.stopped_by = sup.stop_reason
            summary.exit_code = exit_code_for_signal(sup.stop_signal)
        elif summary.trainer_exit_code is not None:
            summary.exit_code = summary.trainer_exit_code
            failed = {
                a: c
                for a, c in summary.data_servers.items()
                if c not in (0, None) and a not in early
            }
            if summary.exit_code == 0 and failed and not summary.servers_stopped_by_trainer:
                log.error("data servers failed: %s (logs in %s)", failed, logs)
                summary.exit_code = 1
    summary.wall_s = round(time.monotonic() - started, 2)
    (run_dir / SUMMARY_FILE).write_text(json.dumps(asdict(summary), indent=2) + "\n")
    _print_summary(summary, run_dir)
    return summary


class ServerStarter:
    """Starts data server ``i`` on the next free loopback port from the spec's, logging to
    ``logs/data-server-<i>.log``; returns ``(address, child)``."""

    def __init__(
        self, spec: ClusterSpec, spec_path: str | Path, logs: Path, sup: Supervisor
    ) -> None:
        self.spec_path, self.logs, self.sup = spec_path, logs, sup
        self.taken: set[int] = set()
        self.next_port = spec.job.dataplane.port

    def __call__(self, i: int) -> tuple[str, Child]:
        port = free_port(self.next_port, self.taken)
        self.taken.add(port)
        self.next_port = port + 1
        cmd = roles.data_server_command(spec_path=self.spec_path, port=port, host=LOOPBACK)
        with (self.logs / f"data-server-{i}.log").open("ab") as out:
            # The child gets its own copy of the descriptor.
            child = self.sup.start(f"data-server-{i}", cmd.argv, stdout=out, stderr=out)
        return f"{LOOPBACK}:{port}", child


def _start_data_servers(
    spec: ClusterSpec, timeout_s: float, start: ServerStarter
) -> list[tuple[str, Child]]:
    """Start every data server at once (start-up is mostly imports: overlapping them saves
    that time per server), then wait for each to be healthy; a server that exits before it
    is healthy (its port was taken after our probe) is restarted on another port."""
    count = data_server_count(spec)
    if count == 0:
        log.info("no dataprep groups: the trainer uses its local DataLoader")
        return []
    pending = [start(i) for i in range(count)]
    servers: list[tuple[str, Child]] = []
    for i, (address, child) in enumerate(pending):
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            if wait_healthy(address, child, timeout_s, start.sup):
                log.info("data server %d of %d healthy at %s", i + 1, count, address)
                servers.append((address, child))
                break
            if start.sup.stop_signal is not None:
                return servers
            log.warning(
                "data server %d exited with code %s at %s (attempt %d of %d)",
                i,
                child.returncode,
                address,
                attempt,
                _PORT_ATTEMPTS,
            )
            if attempt < _PORT_ATTEMPTS:
                address, child = start(i)
        else:
            raise LocalRunError(
                f"data server {i} failed to start {_PORT_ATTEMPTS} times; see "
                f"{start.logs / f'data-server-{i}.log'}"
            )
    return servers


def _elastic_tier(
    spec: ClusterSpec,
    run_dir: Path,
    servers: list[tuple[str, Child]],
    starter: ServerStarter,
    group: str,
) -> LocalDataTier:
    """The elastic group's servers: the last ``count x ranks_per_instance`` of those started
    (every server runs the same spec, so which ones is a matter of counting)."""
    elastic = next(g for g in spec.dataprep_groups if g.name == group)
    n = elastic.count * elastic.ranks_per_instance
    return LocalDataTier(
        run_dir,
        fixed=servers[: len(servers) - n],
        elastic=servers[len(servers) - n :],
        start=starter,
        per_instance=elastic.ranks_per_instance,
        refresh_s=spec.job.dataplane.refresh_s,
    )


def _run_trainer(
    spec: ClusterSpec,
    spec_path: str | Path,
    run_dir: Path,
    servers: Sequence[tuple[str, Child]],
    nproc: int | None,
    sup: Supervisor,
    tier: LocalDataTier | None = None,
) -> int | None:
    n = nproc if nproc is not None else default_nproc(spec)
    # torchrun reports any non-zero rank exit as 1; the ranks' outcome files tell a graceful
    # stop (75: checkpointed, resumable) from a failure.
    outcome_dir = run_dir / "outcome"
    cmd = roles.trainer_command(
        spec,
        spec_path=spec_path,
        run_dir=run_dir,
        trainer_hosts=(LOOPBACK,),
        node_rank=0,
        data_servers=(
            [discovery.file_arg(tier.servers_file.resolve())]
            if tier
            else [addr for addr, _ in servers]
        ),
        nproc_per_node=n,
        outcome_dir=outcome_dir,
        autoscale=autoscale.file_arg(tier.desired_file.resolve()) if tier else "",
    )
    log.info("trainer: %d process(es), %d data server(s); output in %s", n, len(servers), run_dir)
    log.info("watch it live: %s", logdir_command((run_dir / TB_FOLDER).resolve()))
    env = dict(os.environ)
    if visible_gpus() == 0 and "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks share the cores with the data servers; torchrun with one rank does not limit
        # threads, and oversubscribed ranks ran 4-5x slower per step on a 2-core machine.
        cores = os.cpu_count() or 1
        env["OMP_NUM_THREADS"] = str(max(1, cores // (n + len(servers))))

    def wait(children: list[Child]) -> list[int | None]:
        (trainer,) = children
        # On Ctrl-C the trainer gets SIGTERM (checkpoint, exit) and the grace period to do it.
        while tier is not None and sup.stop_signal is None and sup.wait(trainer, 0.5) is None:
            tier.reconcile()
        return [sup.wait(trainer)]

    # The trainer writes to this console directly: its progress is the run's progress.
    ended = run_role(
        sup, [("trainer", cmd)], env=env, outcome_dir=outcome_dir, trainer_ranks=n, wait=wait
    )
    code = ended.codes[0]
    return code if not code or ended.outcome is None else ended.outcome.exit_code


def _print_server_logs(logs: Path, lines: int = 20) -> None:
    for path in sorted(logs.glob("data-server-*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        if tail:
            print(f"--- last lines of {path} ---", file=sys.stderr)
            print("\n".join(tail), file=sys.stderr)


def _print_summary(summary: LocalRunSummary, run_dir: Path) -> None:
    print(f"\nlocal run finished in {summary.wall_s:.1f}s with exit code {summary.exit_code}")
    if summary.stopped_by:
        print(f"  stopped early: {summary.stopped_by}")
    print(f"  trainer exit code: {summary.trainer_exit_code}")
    for addr, code in summary.data_servers.items():
        print(f"  data server {addr}: exit code {code}")
    outputs = sorted(
        p
        for p in run_dir.iterdir()
        if p.is_file() and p.suffix in {".json", ".jsonl", ".csv", ".png", ".svg"}
    )
    print(f"  run folder: {run_dir.resolve()}")
    for p in outputs:
        print(f"    {p.name}")
    if (run_dir / TB_FOLDER).is_dir():
        print(f"  TensorBoard: {logdir_command((run_dir / TB_FOLDER).resolve())}")
