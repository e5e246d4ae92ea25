"""``hetero rehearse`` of a job that reaches ``job.max_usd``: the real launcher, trainer and data
servers on emulated instances; the trainer stops with a durable checkpoint, the job record says
``stopped`` with a ``budget: ...`` reason, every group ends at 0 and nothing is left running.

The rehearsal runs one job; ``hetero job start --resume`` after the stop (a new job on the same
checkpoints, with its own clock) is tested at the launcher level with moto in
``tests/launcher/test_launcher_budget.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "specs" / "rehearsal.toml"
TIMEOUT_S = 420
STEPS = 24
# specs/rehearsal.toml prices the cluster at 1.18 USD/h: 0.001 USD is about 3 s from the job's
# start, which the trainers' start-up (torch, the model) outlasts: each trainer is then given a
# millisecond and stops after its first step, with a checkpoint, whatever the machine's speed.
MAX_USD = 0.001


@pytest.mark.timeout(TIMEOUT_S + 200)
def test_a_job_that_reaches_max_usd_checkpoints_ends_stopped_with_groups_at_zero(
    tmp_path: Path,
) -> None:
    text = SPEC.read_text()
    assert "\nseed = 0\n" in text
    spec = tmp_path / "rehearsal-capped.toml"
    spec.write_text(text.replace("\nseed = 0\n", f"\nseed = 0\nmax_usd = {MAX_USD}\n", 1))
    scenario = tmp_path / "budget.toml"
    scenario.write_text('name = "budget"\n[expect]\noutcome = "stopped"\n')
    out = tmp_path / "rehearsal"
    proc = subprocess.run(
        [
            sys.executable, "-m", "training.cli", "rehearse", "--spec", str(spec),
            "--out", str(out), "--timeout", str(TIMEOUT_S), "--no-baseline",
            "--scenario", str(scenario),
        ],
        cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S + 120,
    )  # fmt: skip
    context = f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    report = json.loads((out / "rehearsal.json").read_text())
    assert proc.returncode == 0, context
    assert report["failed_invariants"] == [], context
    assert report["outcome"] == "stopped", context
    record = report["job_record"]
    assert record["reason"].startswith(f"budget: max_usd {MAX_USD:g} reached ("), record
    assert record["reason"].endswith("continue with hetero job start --resume")
    # Stopped before the end, with the stop's checkpoint durable in S3 and complete.
    assert 0 < report["final_step"] < STEPS, context
    final = report["final_checkpoint"]
    assert final["step"] == report["final_step"] and final["matches_final_step"] is True
    assert report["final_step"] in final["complete_steps_in_s3"]
    # Every sample up to the stop was used at most once.
    assert all(e["repeated"] == 0 for e in report["samples"]), report["samples"]
    assert set(report["groups_desired_at_end"].values()) == {0}
    assert report["instances_running_at_end"] == []
    assert report["processes_left"] == []
