"""Validation in ``hetero status``: the trainer's ``MetricsLogger`` writes its last validation
record to ``last_eval.json``; the EC2 launcher's heartbeat (``ec2_watches.last_metrics``) puts it
under ``"eval"`` beside the last interval record into the job record, and ``status.render``
shows the last top-1 (the EMA's too) and the accuracy targets reached in the host's row. Also the
data tier in ``hetero status``: an elastic group's desired count with its min-max, and the
controller's last decisions from the job record. And ``hetero status --tensorboard``: the
commands for the job given, or the one the job pointer names, or why the pointer was not read."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from botocore.stub import Stubber

from training.common.jobparam import JobPointer
from training.common.jobrecord import JobRecord
from training.common.names import job_parameter_name
from training.launcher.ec2_watches import last_metrics
from training.spec import load_spec
from training.trainer.metrics import EvalResult, EvalScores, Interval, MetricsLogger, RunFacts
from training.workstation.status import JobStatus, collect, decision_text, render, validation_text

REPO = Path(__file__).resolve().parents[2]
FACTS = RunFacts(
    global_batch=64, world_size=1, cluster_usd_per_hour=18.0, flops_per_sample=None,
    peak_flops_per_rank=None, total_steps=None, accuracy_targets=(0.5, 0.8, 0.95),
)  # fmt: skip


def test_the_heartbeat_reads_the_last_interval_and_the_last_evaluation(tmp_path: Path) -> None:
    assert last_metrics(tmp_path) is None  # nothing written yet
    logger = MetricsLogger(tmp_path, FACTS, rank=0, device=torch.device("cpu"))
    interval = Interval(started=time.perf_counter() - 1.0, steps=10)
    record = logger.log(10, interval, loss=1.5, lr=0.1, data_wait_share=0.1, epoch=0)
    assert last_metrics(tmp_path) == json.loads(json.dumps(record))
    ema = EvalScores(top1=0.8203125, top5=0.96875, loss=0.5)
    logger.log_eval(
        10, EvalResult(0.75, 0.9375, 0.625, 360, 1.0, ema=ema), samples_seen=640,
        train_wall_s=5.0,
    )  # fmt: skip
    # The validation record is the last line now; the interval stays what is reported, with
    # the evaluation beside it.
    seen = last_metrics(tmp_path)
    assert seen is not None
    assert {k: v for k, v in seen.items() if k != "eval"} == json.loads(json.dumps(record))
    assert seen["eval"] == {**logger.evals[0], "targets_reached": [0.5, 0.8]}  # the EMA's 0.82
    logger.finish({})


def test_a_cut_last_line_falls_back_to_the_line_before(tmp_path: Path) -> None:
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 3, "lo')
    assert last_metrics(tmp_path) == {"step": 2, "loss": 1.0}
    (tmp_path / "metrics.jsonl").write_text('{"kind": "eval", "step": 3, "top1": 0.5}\n')
    assert last_metrics(tmp_path) is None  # an evaluation alone, without its file


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


def test_status_names_the_unreadable_training_samples_from_the_heartbeat(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The trainer's interval record carries the unreadable samples' count and first names
    (``UnreadableSamples.record_fields``); the heartbeat passes the record on, and ``render``
    says how many were left out, names the first and where the rest are."""
    from training.data.batch import Batch, Unreadable
    from training.trainer.unreadable import UnreadableSamples

    unreadable = UnreadableSamples(0.5)
    names = [f"/data/train/c{i}/bad-{i}.jpg" for i in range(4)]
    unreadable.met(
        Batch(
            torch.zeros((0, 3, 8, 8), dtype=torch.uint8), torch.zeros(0, dtype=torch.int64),
            torch.zeros(0, dtype=torch.int64),
            skipped=tuple(Unreadable(i, n, "not a readable image: empty file")
                          for i, n in enumerate(names)),
        )
    )  # fmt: skip
    unreadable.share(world_size=1)
    logger = MetricsLogger(tmp_path, FACTS, rank=0, device=torch.device("cpu"))
    interval = Interval(started=time.perf_counter() - 1.0, steps=10)
    logger.log(
        10, interval, loss=1.5, lr=0.1, data_wait_share=0.1, epoch=0,
        extra=unreadable.record_fields(),
    )  # fmt: skip
    logger.finish({})
    metrics = last_metrics(tmp_path)
    assert metrics is not None
    status = JobStatus(cluster="vit-spot", hosts={"i-1": {"state": "running", "metrics": metrics}})
    render(status)
    out = capsys.readouterr().out
    assert (
        "unreadable training samples: 4, left out (/data/train/c0/bad-0.jpg, "
        "/data/train/c1/bad-1.jpg, /data/train/c2/bad-2.jpg, ...); the run's summary.json names "
        "every one"
    ) in out.replace("\n", " ")
    render(JobStatus(cluster="vit-spot", hosts={"i-1": {"metrics": {"unreadable_samples": 0}}}))
    assert "unreadable" not in capsys.readouterr().out


def test_status_shows_the_hosts_taken_out_and_the_hung_generations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``collect`` reads the job record's evictions (``silent_hosts``) and hangs
    (``hang_watch``); ``render`` names each host, its group, when, who took it out and why, and
    each hung generation with where its stacks are."""
    record = JobRecord(str(tmp_path))
    record.mark_evicted("i-9", group="trainer", reason="silent: no write for 250 s", by="i-1")
    hang = {"reason": "hung: no training progress for 912 s (limit 900 s)", "time": 1.8e9}
    record.mark_hung("i-4", 3, hang)
    spec = load_spec(REPO / "specs" / "rehearsal.toml")
    status = collect(spec, checkpoint_uri=str(tmp_path), ec2=_Failing(), autoscaling=_Failing())
    assert set(status.evicted) == {"i-9"} and status.evicted["i-9"]["by"] == "i-1"
    render(status)
    out = capsys.readouterr().out
    assert "taken out of their groups (1):" in out
    at = time.strftime("%H:%M:%S", time.gmtime(status.evicted["i-9"]["time"]))
    assert f"i-9 (trainer) at {at}Z by i-1: silent: no write for 250 s" in out
    assert set(status.hangs) == {"i-4-3"}
    assert "hung generations, ended after their stacks were taken (1):" in out
    at = time.strftime("%H:%M:%S", time.gmtime(1.8e9))
    assert f"i-4-3 at {at}Z: hung: no training progress for 912 s (limit 900 s)" in out
    assert f"each rank's stacks: {tmp_path}/job/hangs/<instance-id>-<generation>.json" in out


class _Failing:
    """An AWS client whose every call fails (status keeps going: the job record is read)."""

    def __getattr__(self, name: str) -> Any:
        def fail(**_: Any) -> Any:
            raise RuntimeError(f"{name}: unreachable")

        return fail


ELASTIC_TOML = """
name = "vit-grow"

[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge"]
count = 1

[[groups]]
name = "dataprep"
role = "dataprep"
instance_types = ["c6i.4xlarge"]
count = 2
min_count = 1
max_count = 4

[job]
steps = 10
"""


def _decision(
    step: int, from_count: int, to_count: int, reason: str, acted: bool
) -> dict[str, Any]:
    return {
        "time": 1_700_000_000.0 + step, "step": step, "from_count": from_count,
        "to_count": to_count, "reason": reason, "wait_share": 0.2, "busy_share": 0.9,
        "serving": from_count, "acted": acted,
    }  # fmt: skip


def test_status_shows_an_elastic_group_and_the_data_tiers_last_decisions(
    aws: object,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An elastic dataprep group (the emulated stack: MinSize 1, MaxSize 4, desired 2), and the
    controller's decisions from the job record: the newest five, oldest first."""
    from training.rehearsal.aws import AwsEmulator

    assert isinstance(aws, AwsEmulator)
    monkeypatch.setenv("COLUMNS", "300")  # one table row on one line
    path = tmp_path / "cluster.toml"
    path.write_text(ELASTIC_TOML)
    spec = load_spec(path)
    names = aws.provision(spec)
    s3 = aws.client("s3")
    record = JobRecord(names.checkpoint_uri, s3_client=s3)
    decisions = [_decision(10 * i, 2 + i, 3 + i, f"wait share {i}", acted=i != 4) for i in range(6)]
    for d in decisions:
        record.add_decision(d)
    status = collect(
        spec, checkpoint_uri=names.checkpoint_uri, ec2=aws.client("ec2"),
        autoscaling=aws.client("autoscaling"), s3=s3,
    )  # fmt: skip
    assert status.errors == []
    assert [
        (g["group"], g["desired"], g["min"], g["max"], g["elastic"]) for g in status.groups
    ] == [
        ("trainer", 1, 1, 1, False),
        ("dataprep", 2, 1, 4, True),
    ]
    assert status.decisions == decisions[-5:]
    render(status)
    out = capsys.readouterr().out.splitlines()
    [row] = [line for line in out if names.asg_names["dataprep"] in line]
    assert "2 (elastic 1-4)" in row
    [trainer] = [line for line in out if names.asg_names["trainer"] in line]
    assert "(elastic" not in trainer
    start = out.index("data tier, last 5 decision(s):")
    assert out[start + 1 : start + 6] == [
        "  step 10: 3 -> 4 (wait share 1), acted",
        "  step 20: 4 -> 5 (wait share 2), acted",
        "  step 30: 5 -> 6 (wait share 3), acted",
        "  step 40: 6 -> 7 (wait share 4), not acted",
        "  step 50: 7 -> 8 (wait share 5), acted",
    ]


def test_no_data_tier_section_without_an_elastic_group_or_decisions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    group = {"group": "dataprep", "asg": "c-dataprep", "desired": 2, "min": 0, "max": 2}
    render(JobStatus(cluster="c", groups=[{**group, "in_service": 2, "elastic": False}]))
    assert "data tier" not in capsys.readouterr().out
    render(JobStatus(cluster="c", groups=[{**group, "in_service": 2, "elastic": True}]))
    assert "data tier: no decision yet" in capsys.readouterr().out.splitlines()
    assert decision_text({"step": 7, "from_count": 2, "to_count": 1, "acted": True}) == (
        "step 7: 2 -> 1, acted"
    )


def test_status_tensorboard_prints_the_command_for_the_stack_and_the_job(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``hetero status --tensorboard --checkpoint-uri URI``: the two commands, nothing asked of
    AWS; a job without S3 checkpoints has no events there, and says so."""
    from training.cli import main

    spec = str(REPO / "specs" / "rehearsal.toml")
    uri = "s3://vit-ckpt/checkpoints/j-20261129T101500-ab12/"
    assert main(["status", "--spec", spec, "--tensorboard", "--checkpoint-uri", uri]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "every job of the stack: tensorboard --logdir s3://vit-ckpt/checkpoints/tensorboard/",
        "this job: tensorboard --logdir "
        "s3://vit-ckpt/checkpoints/tensorboard/j-20261129T101500-ab12/",
        "(TensorBoard reads S3 with your AWS credentials: AWS_REGION or AWS_DEFAULT_REGION set)",
    ]
    assert main(["status", "--spec", spec, "--tensorboard", "--checkpoint-uri", "/ckpt"]) == 0
    assert capsys.readouterr().out.startswith("no TensorBoard events in S3: the checkpoints are")


JOB_URI = "s3://vit-ckpt/checkpoints/j-20261129T101500-ab12/"


def test_status_tensorboard_names_the_job_the_job_pointer_names(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``--checkpoint-uri``: the job that the stack's SSM parameter names (moto), before
    ``$HETERO_CHECKPOINT_URI``, which is what a stack without the parameter falls back to."""
    from moto import mock_aws

    from training.cli import main

    for key in ("AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("HETERO_CHECKPOINT_URI", "s3://old-ckpt/checkpoints/d-0123456789ab/")
    args = ["status", "--spec", str(REPO / "specs" / "rehearsal.toml"), "--tensorboard"]
    with mock_aws():
        assert main(args) == 0
        without = capsys.readouterr().out.splitlines()
        boto3.client("ssm").put_parameter(
            Name=job_parameter_name("rehearsal"),
            Value=JobPointer("j-20261129T101500-ab12", JOB_URI).to_json(),
            Type="String",
        )
        assert main(args) == 0
    assert without[1] == (
        "this job: tensorboard --logdir s3://old-ckpt/checkpoints/tensorboard/d-0123456789ab/"
    )
    assert capsys.readouterr().out.splitlines()[:2] == [
        "every job of the stack: tensorboard --logdir s3://vit-ckpt/checkpoints/tensorboard/",
        "this job: tensorboard --logdir "
        "s3://vit-ckpt/checkpoints/tensorboard/j-20261129T101500-ab12/",
    ]


def test_status_tensorboard_says_so_when_the_job_pointer_is_denied(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller that may not read the parameter: the denial as ``hetero status`` reports a source
    it could not read, how to go without it, exit 1 and no command (not one for another job)."""
    from training.cli import main
    from training.workstation import status

    monkeypatch.setenv("HETERO_CHECKPOINT_URI", "s3://old-ckpt/checkpoints/d-0123456789ab/")
    ssm = boto3.client("ssm", region_name="us-east-1")
    denial = (
        "User: arn:aws:iam::123456789012:user/dev is not authorized to perform: ssm:GetParameter"
    )
    with Stubber(ssm) as stub:
        stub.add_client_error(
            "get_parameter", "AccessDeniedException", denial,
            expected_params={"Name": "/hetero/rehearsal/job"},
        )  # fmt: skip
        monkeypatch.setattr(status, "client", lambda service, **_: ssm)
        args = ["status", "--spec", str(REPO / "specs" / "rehearsal.toml"), "--tensorboard"]
        assert main(args) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "could not read job pointer /hetero/rehearsal/job: An error occurred "
        f"(AccessDeniedException) when calling the GetParameter operation: {denial}",
        "(name the job's checkpoints with --checkpoint-uri instead)",
    ]
