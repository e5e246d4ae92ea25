"""What each role runs: the trainer's torchrun command and the data server's ``hetero serve``.

Only command lines and environments are built here (pure functions, easy to check); running
them is the supervisor's job.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from training.spec import ClusterSpec

log = logging.getLogger(__name__)

RENDEZVOUS_PORT = 29500
"""Port of the static rendezvous (torch's MASTER_PORT) on the first trainer host."""
RENDEZVOUS_TIMEOUT_S = 60
"""How long trainer hosts wait for each other in torchrun's rendezvous."""


@dataclass(frozen=True)
class RoleCommand:
    """A command line and the environment variables it needs on top of the launcher's own."""

    argv: tuple[str, ...]
    env: Mapping[str, str]


def trainer_command(
    spec: ClusterSpec,
    *,
    spec_path: str | Path,
    run_dir: str | Path,
    trainer_hosts: Sequence[str],
    node_rank: int,
    data_servers: Sequence[str] = (),
    nproc_per_node: int | None = None,
    checkpoint_dir: str | Path | None = None,
    rendezvous_port: int = RENDEZVOUS_PORT,
    rendezvous_timeout_s: int | None = None,
    outcome_dir: str | Path | None = None,
    autoscale: str = "",
    env: Mapping[str, str] | None = None,
    python: str = sys.executable,
) -> RoleCommand:
    """torchrun for this trainer host: ``--nnodes`` = trainer hosts, ``--node-rank`` = this
    host's index among them, ``--nproc-per-node`` = the group's ranks per instance (unless
    given), static rendezvous on the first trainer host. A single host uses ``--standalone``
    (torchrun picks a free local port). ``checkpoint_dir`` overrides the spec's folder.
    ``rendezvous_timeout_s`` bounds how long hosts wait for each other to join (torchrun's
    static rendezvous waits 600 s by default); ``outcome_dir`` receives each rank's outcome
    file (``training.common.outcome``); ``autoscale`` is the data-tier controller's backend
    (``training.dataplane.autoscale.actuator_from_arg``; empty: none)."""
    nnodes = len(trainer_hosts)
    if nnodes == 0:
        raise ValueError("no trainer hosts: the trainer group has no instances")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node rank {node_rank} is outside 0..{nnodes - 1}")
    nproc = nproc_per_node if nproc_per_node is not None else spec.trainer_group.ranks_per_instance
    if nproc < 1:
        raise ValueError(f"--nproc-per-node must be at least 1, got {nproc}")
    argv = [python, "-m", "torch.distributed.run"]
    if nnodes == 1:
        argv += ["--standalone", "--nnodes", "1"]
    else:
        argv += [
            "--nnodes",
            str(nnodes),
            "--node-rank",
            str(node_rank),
            "--master-addr",
            trainer_hosts[0],
            "--master-port",
            str(rendezvous_port),
        ]
        if rendezvous_timeout_s is not None:
            argv += ["--rdzv-conf", f"timeout={int(rendezvous_timeout_s)}"]
    argv += ["--nproc-per-node", str(nproc)]
    argv += ["-m", "training.trainer", "--spec", str(spec_path), "--run-dir", str(run_dir)]
    if data_servers:
        argv += ["--data-servers", ",".join(data_servers)]
    if checkpoint_dir is not None:
        argv += ["--checkpoint-dir", str(checkpoint_dir)]
    if outcome_dir is not None:
        argv += ["--outcome-dir", str(outcome_dir)]
    if autoscale:
        argv += ["--autoscale", autoscale]
    return RoleCommand(tuple(argv), dict(env or {}))


def data_server_command(
    *,
    spec_path: str | Path,
    port: int,
    host: str = "0.0.0.0",
    outcome_dir: str | Path | None = None,
    python: str = sys.executable,
) -> RoleCommand:
    """``hetero serve`` on ``host:port`` (all interfaces by default: trainers connect remotely);
    ``outcome_dir`` receives its ``server-<PORT>.stopped`` (``training.common.outcome``)."""
    argv = [python, "-m", "training.cli", "serve", "--spec", str(spec_path)]
    argv += ["--port", str(port), "--host", host]
    if outcome_dir is not None:
        argv += ["--outcome-dir", str(outcome_dir)]
    return RoleCommand(tuple(argv), {})
