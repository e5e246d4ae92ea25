"""``hetero rehearse`` run as a user runs it (a child process of the CLI), with its AWS calls
recorded and checked against tests/aws_calls.json, and the invariants every scenario's report
shares: for the end-to-end rehearsal tests (tests/rehearsal/, tests/images/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aws_calls

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "specs" / "rehearsal.toml"
TIMEOUT_S = 420
STEPS = 24
"""specs/rehearsal.toml's ``job.steps``."""


def rehearse(
    out: Path,
    *args: str,
    spec: Path = SPEC,
    env: dict[str, str] | None = None,
    timeout_s: int = TIMEOUT_S,
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Rehearse ``spec`` into ``out`` (``hetero rehearse --timeout timeout_s``); the CLI's result
    and its report (rehearsal.json)."""
    proc = subprocess.run(
        [
            sys.executable, "-m", "training.cli", "rehearse", "--spec", str(spec),
            "--out", str(out), "--timeout", str(timeout_s), *args,
        ],
        cwd=REPO, capture_output=True, text=True, timeout=timeout_s + 120,
        env={**os.environ, **aws_calls.recording_env(out / "aws-calls"), **(env or {})},
    )  # fmt: skip
    report = json.loads((out / "rehearsal.json").read_text())
    aws_calls.check(out / "aws-calls", aws_calls.rehearsal_names(spec))
    return proc, report


def context(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"


def assert_clean_end(
    proc: subprocess.CompletedProcess[str], report: dict[str, Any], outcome: str = "finished"
) -> None:
    """The invariants every scenario shares."""
    assert report["failed_invariants"] == [], context(proc)
    assert proc.returncode == (0 if outcome == "finished" else 1) or outcome != "finished"
    assert report["outcome"] == outcome, context(proc)
    assert set(report["groups_desired_at_end"].values()) == {0}
    assert report["instances_running_at_end"] == []
    assert report["processes_left"] == []


def assert_exactly_once_and_equal(report: dict[str, Any]) -> None:
    assert report["final_step"] == STEPS
    assert report["samples"] and all(
        e["lost"] == 0 and e["repeated"] == 0 for e in report["samples"]
    ), report["samples"]
    assert report["params_equal_uninterrupted"] is True, report["params_comparison"]


def assert_tensorboard_once_per_step(out: Path) -> None:
    """The job's event files, as the rehearsal downloaded them from S3: every generation's rank 0
    uploaded its own, and TensorBoard's reader (``purge_step`` of each resumed writer) finds each
    step's loss once, from step 1 to the last: no gap, no repeat across the interruptions."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (job,) = [p for p in (out / "tensorboard").iterdir() if p.is_dir()]
    acc = EventAccumulator(str(job), size_guidance={"scalars": 0})
    acc.Reload()
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps == list(range(1, STEPS + 1)), steps
    # Evaluations at 8, 16 and 24, each once (one a stop at its step skipped is not redone).
    evals = [e.step for e in acc.Scalars("val/top1")]
    assert evals == sorted(set(evals)) and set(evals) <= {8, 16, 24} and 24 in evals, evals
