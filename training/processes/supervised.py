"""Run a role's commands under a supervisor, then read how they ended: the one way ``hetero
launch`` (``launch.py``), its generations on EC2 (``ec2_job.py``) and ``hetero local``
(``training.local.run``) run them; what differs (the supervisor, how to wait) is passed in."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from training.common.outcome import Outcome, RankOutcome, clear_outcomes, read_host_outcome
from training.common.progress import clear_progress
from training.processes.roles import RoleCommand
from training.processes.supervisor import Child, Supervisor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoleEnd:
    codes: list[int | None]
    """Each process's exit code, in start order (None: still running when the wait gave up)."""
    outcome: Outcome | None = None
    """A trainer's outcome from its ranks' files (torchrun turns every non-zero rank exit into
    1: the files tell a stop from a failure); None for data servers."""
    ranks: tuple[RankOutcome, ...] = ()


def run_role(
    sup: Supervisor,
    commands: Sequence[tuple[str, RoleCommand]],
    *,
    env: Mapping[str, str],
    outcome_dir: Path,
    trainer_ranks: int | None,
    wait: Callable[[list[Child]], Sequence[int | None]] | None = None,
    label: str = "",
) -> RoleEnd:
    """Start ``commands`` under ``sup`` (each with ``env`` and its own variables), wait for them
    (``wait``, by default ``Supervisor.run_until_done``) and log each exit, prefixed by
    ``label``. ``trainer_ranks``: the commands are a trainer's with this many ranks per host: the
    stop goes to its ranks (``Child.send_stop``), and their outcome files in ``outcome_dir`` are
    read after the end (their progress files: cleared before the start). Every role's outcome
    files are cleared before the start: a data server's ``server-<PORT>.stopped`` from an earlier
    generation must not hide this one's server from its health watch."""
    trainer = trainer_ranks is not None
    clear_outcomes(outcome_dir)
    if trainer:
        clear_progress(outcome_dir)
    children = [
        sup.start(name, cmd.argv, env={**env, **cmd.env}, stop_workers=trainer)
        for name, cmd in commands
    ]
    codes = list(sup.run_until_done() if wait is None else wait(children))
    for (name, _), code in zip(commands, codes, strict=True):
        log.info("%s%s exited with code %s", label, name, code)
    if trainer_ranks is None:
        return RoleEnd(codes)
    outcome, ranks = read_host_outcome(outcome_dir, trainer_ranks)
    return RoleEnd(codes, outcome, tuple(ranks))
