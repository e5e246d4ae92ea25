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

from training.spec import ClusterSpec, load_spec

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


EVERY_STEP = (
    "loss", "lr", "grad_norm", "grad_norm_max", "nonfinite_steps", "samples_per_s",
    "step_time_s", "data_wait_share", "unreadable_samples",
)  # fmt: skip
"""What every interval record of a run on the CPU has under ``train/`` (training.trainer.metrics'
``log`` and the unreadable samples' count; the gradient norms: every step is applied)."""


def tensorboard_tags(spec: ClusterSpec) -> tuple[set[str], set[str]]:
    """The scalar tags a CPU run of ``spec`` that logs every step writes: those at every step,
    and those at some (the checkpoint age once a checkpoint is durable, each validation's);
    without the ones only a GPU (MFU, utilisation), layer decay or an elastic data tier adds."""
    job = spec.job
    assert job.log_every_steps == 1 and job.steps, "a spec of steps, each logged"
    priced = spec.usd_per_hour() > 0
    every = {f"train/{name}" for name in (*EVERY_STEP, *(["samples_per_usd"] if priced else []))}
    some = {"train/checkpoint_age_s"} if job.checkpoint.interval_steps < job.steps else set()
    if job.eval.every_steps:
        val = ["top1", "top5", "val_loss", "targets_reached", *(["usd"] if priced else [])]
        val += ["ema_top1", "ema_top5", "ema_val_loss"] if job.ema.enabled else []
        some |= {f"val/{name}" for name in val}
    return every, some


def assert_tensorboard_once_per_step(out: Path, spec: Path = SPEC, steps: int = STEPS) -> None:
    """The job's event files, as the rehearsal downloaded them from S3: every generation's rank 0
    uploaded its own, and TensorBoard's reader (``purge_step`` of each resumed writer) finds
    every tag ``spec`` makes (``tensorboard_tags``), each scalar's steps strictly increasing (no
    repeat across the interruptions), those of every step from 1 to ``steps`` (no gap), and
    each evaluation's at its steps, the last among them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (job,) = [p for p in (out / "tensorboard").iterdir() if p.is_dir()]
    acc = EventAccumulator(str(job), size_guidance={"scalars": 0})
    acc.Reload()
    found = {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    cluster = load_spec(spec)
    every, some = tensorboard_tags(cluster)
    missing = sorted((every | some) - set(found))
    assert not missing, f"no {missing} among {sorted(found)}"
    # A stop at an evaluation's step skips it, and a resume does not redo it: some may miss.
    at = cluster.job.eval.every_steps
    evaluations = set(range(at, steps + 1, at)) | {steps} if at else set()
    for tag, logged in found.items():
        assert logged == sorted(set(logged)), (tag, logged)
        if tag in every:
            assert logged == list(range(1, steps + 1)), (tag, logged)
        if tag.startswith("val/"):
            assert set(logged) <= evaluations and steps in logged, (tag, logged)
