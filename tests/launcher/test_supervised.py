"""A role's generation starts from a clean outcome folder: a data server's
``server-<PORT>.stopped`` from an earlier generation (a budget stop's SIGTERM, the job's
Shutdown) would otherwise hide this generation's server from its launcher's health watch."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from training.common.outcome import mark_server_stopped, server_stopped
from training.processes.roles import RoleCommand
from training.processes.supervised import run_role
from training.processes.supervisor import Supervisor


def test_a_data_server_generation_clears_an_earlier_stopped_file(tmp_path: Path) -> None:
    outcome = tmp_path / "outcome"
    mark_server_stopped(outcome, 50071)
    assert server_stopped(outcome, "127.0.0.1:50071")
    seen = tmp_path / "seen"
    # The stand-in server notes whether the file was there when it started.
    code = (
        "import pathlib, sys; "
        f"pathlib.Path({str(seen)!r}).write_text(str(pathlib.Path({str(outcome)!r}, "
        "'server-50071.stopped').exists()))"
    )
    with Supervisor(grace_s=5) as sup:
        end = run_role(
            sup,
            [("data-server-0", RoleCommand((sys.executable, "-c", code), {}))],
            env=dict(os.environ),
            outcome_dir=outcome,
            trainer_ranks=None,
        )
    assert end.codes == [0]
    assert seen.read_text() == "False"
    assert not server_stopped(outcome, "127.0.0.1:50071")
