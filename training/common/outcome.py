"""How a trainer run ended, told apart by exit code and by a small file per rank.

Three outcomes matter to whoever runs the trainer (the launcher, ``hetero local``, SageMaker):

- ``finished``: the job reached its step count or epochs. Only this ends the job.
- ``stopped``: a graceful stop (Spot interruption notice, Auto Scaling termination, SIGTERM,
  ``--max-seconds``) after a durable checkpoint; the job goes on elsewhere and resumes from it.
- ``failed``: anything else (a crash, a lost peer, a storage error at the end).

The rank process exits with ``EXIT_FINISHED``, ``EXIT_STOPPED`` or ``EXIT_FAILED``, or, for a
failure no restart can fix, a code of ``NOT_RETRIED`` (``EXIT_DATA``). torchrun collapses every
non-zero worker exit into its own exit code 1, so each rank also writes ``rank-<RANK>.json``
into the folder given by ``--outcome-dir`` (with its exit code when it says more than the
outcome); ``read_host_outcome`` combines a host's files into one outcome (a rank without a file,
e.g. one killed by SIGKILL, counts as failed), and ``not_retried`` finds a rank whose failure a
restart would meet again.

A data server (``hetero serve --outcome-dir``) writes ``server-<PORT>.stopped`` there once it has
stopped serving on request (the job's Shutdown RPC, SIGTERM, SIGINT), before its process exits:
from then on its port refuses connections on purpose, and its launcher's health watch
(``training.launcher.server_watch``) no longer takes the silence for a server that stopped
working, however long the process takes to exit.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

from training.common.files import write_atomically

EXIT_FINISHED = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_STOPPED = 75
"""``EX_TEMPFAIL`` from sysexits.h: a temporary failure, the caller is invited to retry."""
EXIT_DATA = 65
"""``EX_DATAERR`` from sysexits.h: more of the training samples are unreadable than
``job.dataset.max_unreadable`` allows (``UnreadableDataError``). A restart would meet the same
files (their list is in the checkpoint), so the EC2 launcher ends the job ``failed`` at once,
spending no restart."""
NOT_RETRIED = frozenset({EXIT_DATA})
"""Rank exit codes of a failure that no restart can fix."""

ROLE_STOP_GRACE_S = 90
"""After SIGTERM, how long a role's processes (the trainer, the data servers) get to checkpoint
and exit before the launcher kills them (``hetero launch --grace``)."""
LAUNCHER_STOP_S = 40
"""What the launcher itself needs once its role has stopped: its last job-record write, one AWS
call, which the project's client bounds at 3 attempts x (3 s to connect + 10 s to read) = 39 s
(``training.common.aws``; a test keeps the two in step)."""
CONTAINER_STOP_TIMEOUT_S = ROLE_STOP_GRACE_S + LAUNCHER_STOP_S
"""``docker run --stop-timeout`` of the launcher's container: Docker sends SIGKILL this long
after SIGTERM, so it must outlast the role's grace and the launcher's own stop. Without it the
daemon's default applies, 10 s on Linux
(https://docs.docker.com/reference/cli/docker/container/stop/), and a stop with no earlier notice
(``docker stop``, a shutdown at the end of a termination hook) would cut a checkpoint short."""


class Outcome(StrEnum):
    FINISHED = "finished"
    STOPPED = "stopped"
    FAILED = "failed"

    @property
    def exit_code(self) -> int:
        return {
            Outcome.FINISHED: EXIT_FINISHED,
            Outcome.STOPPED: EXIT_STOPPED,
            Outcome.FAILED: EXIT_FAILED,
        }[self]


@dataclass(frozen=True)
class RankOutcome:
    """What one rank wrote when it ended."""

    rank: int
    outcome: Outcome
    step: int
    """The last optimizer step applied."""
    checkpoint_step: int | None
    """The newest step this run saved durably (None: it saved none)."""
    reason: str
    """``steps``, ``epochs``, a signal name, ``max-seconds``, ``peer`` or an error message."""
    time: float = 0.0
    exit_code: int | None = None
    """The rank's exit code where it says more than ``outcome`` (one of ``NOT_RETRIED``); None:
    the outcome's own."""


def write_rank_outcome(folder: Path, outcome: RankOutcome) -> Path:
    """Write ``rank-<RANK>.json`` atomically (a reader never sees half a file)."""
    path = folder / f"rank-{outcome.rank}.json"
    body = {**asdict(outcome), "outcome": outcome.outcome.value, "time": time.time()}
    write_atomically(path, json.dumps(body))
    return path


def clear_outcomes(folder: Path) -> None:
    """Remove the files of a previous run (call before starting the role again)."""
    if folder.is_dir():
        for pattern in ("rank-*.json", "server-*.stopped"):
            for p in folder.glob(pattern):
                p.unlink(missing_ok=True)


def server_stopped_path(folder: Path, port: int) -> Path:
    return folder / f"server-{port}.stopped"


def mark_server_stopped(folder: Path, port: int) -> None:
    """The data server on ``port`` stopped serving on request (see the module docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_atomically(server_stopped_path(folder, port), json.dumps({"time": time.time()}))


def server_stopped(folder: Path, address: str) -> bool:
    """Whether the data server at ``address`` (``host:port``) said it stopped on request."""
    port = address.rsplit(":", 1)[-1]
    return port.isdigit() and server_stopped_path(folder, int(port)).exists()


def read_rank_outcomes(folder: Path) -> list[RankOutcome]:
    out = []
    for p in sorted(folder.glob("rank-*.json")) if folder.is_dir() else []:
        try:
            d = json.loads(p.read_text())
            out.append(
                RankOutcome(
                    rank=int(d["rank"]),
                    outcome=Outcome(d["outcome"]),
                    step=int(d["step"]),
                    checkpoint_step=d.get("checkpoint_step"),
                    reason=str(d.get("reason", "")),
                    time=float(d.get("time", 0.0)),
                    exit_code=None if d.get("exit_code") is None else int(d["exit_code"]),
                )
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue  # A torn or foreign file: the rank counts as having written none.
    return out


def combine(outcomes: Iterable[RankOutcome], expected_ranks: int) -> Outcome:
    """One outcome for a host: finished only if every expected rank finished; stopped if every
    rank wrote one and none failed; failed otherwise (a missing file is a failure)."""
    got = list(outcomes)
    if len(got) < expected_ranks or any(o.outcome is Outcome.FAILED for o in got):
        return Outcome.FAILED
    if all(o.outcome is Outcome.FINISHED for o in got):
        return Outcome.FINISHED
    return Outcome.STOPPED


def read_host_outcome(folder: Path, expected_ranks: int) -> tuple[Outcome, list[RankOutcome]]:
    ranks = read_rank_outcomes(folder)
    return combine(ranks, expected_ranks), ranks


def not_retried(ranks: Iterable[RankOutcome]) -> RankOutcome | None:
    """The lowest rank that failed in a way no restart can fix (its exit code is one of
    ``NOT_RETRIED``), if any."""
    final = [r for r in ranks if r.outcome is Outcome.FAILED and r.exit_code in NOT_RETRIED]
    return min(final, key=lambda r: r.rank, default=None)
