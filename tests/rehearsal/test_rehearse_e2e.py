"""``hetero rehearse`` end to end: the real launcher on four emulated instances (moto, IMDSv2
emulators, loopback addresses), the real trainer and data servers, no fault. The job must
finish, the groups end at 0, no process is left and every sample is applied exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "specs" / "rehearsal.toml"
TIMEOUT_S = 300


@pytest.mark.timeout(TIMEOUT_S + 120)
def test_no_fault_rehearsal_finishes_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "rehearsal"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "training.cli",
            "rehearse",
            "--spec",
            str(SPEC),
            "--out",
            str(out),
            "--no-baseline",
            "--timeout",
            str(TIMEOUT_S),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S + 90,
    )
    report = json.loads((out / "rehearsal.json").read_text())
    context = f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert report["failed_invariants"] == [], context
    assert proc.returncode == 0, context
    assert report["outcome"] == "finished"
    assert report["final_step"] == 24
    assert set(report["groups_desired_at_end"].values()) == {0}
    assert report["instances_running_at_end"] == []
    assert report["processes_left"] == []
    assert report["samples"] and all(
        e["lost"] == 0 and e["repeated"] == 0 for e in report["samples"]
    )
    assert report["steps_lost"] == 0
    assert report["replacements"] == []
    assert report["final_checkpoint"]["step"] == 24
    launched = [e for e in report["events"] if e["kind"] == "instance-launched"]
    assert sorted(e["data"]["group"] for e in launched) == [
        "dataprep",
        "dataprep",
        "trainer",
        "trainer",
    ]
    assert all(e["data"]["private_ip"].startswith("127.0.1.") for e in launched)
    assert "rehearsal passed" in proc.stdout
