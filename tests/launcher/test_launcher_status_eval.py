"""Validation in ``hetero status``: the trainer's ``MetricsLogger`` writes its last validation
record to ``last_eval.json``; the EC2 launcher's heartbeat (``ec2_job._last_metrics``) puts it
under ``"eval"`` beside the last interval record into the job record, and ``status.render``
shows the last top-1 (the EMA's too) and the accuracy targets reached in the host's row."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from training.launcher import ec2_job
from training.launcher.status import JobStatus, render, validation_text
from training.trainer import metrics
from training.trainer.metrics import EvalResult, EvalScores, Interval, MetricsLogger, RunFacts

FACTS = RunFacts(
    global_batch=64, world_size=1, cluster_usd_per_hour=18.0, flops_per_sample=None,
    peak_flops_per_rank=None, total_steps=None, accuracy_targets=(0.5, 0.8, 0.95),
)  # fmt: skip


def test_the_file_names_agree() -> None:
    assert ec2_job.LAST_EVAL_FILE == metrics.LAST_EVAL_FILE


def test_the_heartbeat_reads_the_last_interval_and_the_last_evaluation(tmp_path: Path) -> None:
    assert ec2_job._last_metrics(tmp_path) is None  # nothing written yet
    logger = MetricsLogger(tmp_path, FACTS, rank=0, device=torch.device("cpu"))
    interval = Interval(started=time.perf_counter() - 1.0, steps=10)
    record = logger.log(10, interval, loss=1.5, lr=0.1, data_wait_share=0.1, epoch=0)
    assert ec2_job._last_metrics(tmp_path) == json.loads(json.dumps(record))
    ema = EvalScores(top1=0.8203125, top5=0.96875, loss=0.5)
    logger.log_eval(
        10, EvalResult(0.75, 0.9375, 0.625, 360, 1.0, ema=ema), samples_seen=640,
        train_wall_s=5.0,
    )  # fmt: skip
    # The validation record is the last line now; the interval stays what is reported, with
    # the evaluation beside it.
    seen = ec2_job._last_metrics(tmp_path)
    assert seen is not None
    assert {k: v for k, v in seen.items() if k != "eval"} == json.loads(json.dumps(record))
    assert seen["eval"] == {**logger.evals[0], "targets_reached": [0.5, 0.8]}  # the EMA's 0.82
    logger.finish({})


def test_a_cut_last_line_falls_back_to_the_line_before(tmp_path: Path) -> None:
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 3, "lo')
    assert ec2_job._last_metrics(tmp_path) == {"step": 2, "loss": 1.0}
    (tmp_path / "metrics.jsonl").write_text('{"kind": "eval", "step": 3, "top1": 0.5}\n')
    assert ec2_job._last_metrics(tmp_path) is None  # an evaluation alone, without its file


def test_validation_in_words() -> None:
    last = {"step": 120, "top1": 0.8125, "ema_top1": 0.8203125, "targets_reached": [0.5, 0.8]}
    assert validation_text(last) == (
        "val top-1 81.2 % (EMA 82.0 %) at step 120, targets reached 50 %, 80 %"
    )
    assert validation_text({"step": 7, "top1": 0.25, "targets_reached": []}) == (
        "val top-1 25.0 % at step 7"
    )
    assert validation_text(None) == "" and validation_text({"step": 7}) == ""


def test_status_shows_it_in_the_host_row(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # one table row on one line
    last = {"step": 120, "top1": 0.8125, "targets_reached": [0.8]}
    status = JobStatus(
        cluster="vit-spot",
        instances=[
            {
                "group": "trainer",
                "instance_id": "i-1",
                "type": "g5.xlarge",
                "market": "spot",
                "az": "us-east-1a",
                "address": "10.0.0.1",
            },
        ],
        hosts={"i-1": {"state": "running", "metrics": {"step": 130, "loss": 0.5, "eval": last}}},
    )
    render(status)
    [row] = [line for line in capsys.readouterr().out.splitlines() if "i-1" in line]
    assert "step 130, loss 0.5; val top-1 81.2 % at step 120, targets reached 80 %" in row
