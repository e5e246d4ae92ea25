"""A SageMaker heterogeneous job run for real: one process per host, each with the
``resourceconfig.json`` SageMaker gives it (the hosts named by loopback addresses, 127.0.0.1 for
the trainer and 127.0.0.2 for the data server, which every process here can reach), the
checkpoint URI ``hetero sagemaker submit`` sets, and an image dataset, all in moto's S3. The
first run is stopped as SageMaker stops a job at its ``MaxRuntimeInSeconds`` (the spec's
budget): SIGTERM to every host's container; the trainer saves a checkpoint before it exits, well
inside the 120 s SageMaker waits. Run again (``hetero sagemaker submit --resume``, or SageMaker
restarting a Spot job: the same checkpoint URI), the job resumes from that checkpoint and
finishes with its checkpoints (the older pruned) and model under the job's prefix. Every AWS
call of both runs (the execution role's) is in the record that tests/infra proves allowed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aws_calls
import pytest
from sagemaker_job import BUCKET, DATASET, PREFIX, digits_in_moto, resourceconfig, write_spec

from training.common.names import ENV_CHECKPOINT_URI
from training.common.s3 import list_keys

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240
STOP_WINDOW_S = 120
"""What SageMaker waits between SIGTERM and the job's end (API_StoppingCondition.html)."""


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """A moto server with the checkpoint bucket and 360 digits as images (``<class>/<n>.png``)."""
    with digits_in_moto(tmp_path) as served:
        yield served


def run_job(spec: Path, url: str, tmp_path: Path, *, stop_at: str | None = None) -> float:
    """Both hosts of the job, to the end: exit 0 each; with ``stop_at``, SIGTERM to both once
    the trainer's log has that text, as SageMaker stops a job at its limit: exit 143 each.
    Fails naming each host's log tail. Returns the seconds from the SIGTERM to the last exit."""
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
        ENV_CHECKPOINT_URI: f"s3://{BUCKET}/{PREFIX}",
        "PYTHONUNBUFFERED": "1",  # the log shows each step as it ends
    }  # fmt: skip
    tmp_path.mkdir()
    procs = {}
    for group in ("dataprep", "trainer"):
        config = tmp_path / f"resourceconfig-{group}.json"
        config.write_text(json.dumps(resourceconfig(group)))
        argv = [sys.executable, "-m", "training.cli", "launch", "--spec", str(spec),
                "--resourceconfig", str(config)]  # fmt: skip
        log = open(tmp_path / f"{group}.log", "wb")  # noqa: SIM115 - closed below
        procs[group] = (subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=log), log)
    codes = {}
    stopped = time.monotonic()
    try:
        if stop_at is not None:
            deadline = time.monotonic() + TIMEOUT_S
            # Bytes: the log may end mid-character while it is written.
            while stop_at.encode() not in (tmp_path / "trainer.log").read_bytes():
                assert time.monotonic() < deadline, f"no {stop_at!r} in the trainer's log"
                assert procs["trainer"][0].poll() is None, "the trainer ended before the stop"
                time.sleep(0.1)
            stopped = time.monotonic()
            for proc, _ in procs.values():
                proc.send_signal(signal.SIGTERM)
        for group, (proc, _) in procs.items():
            codes[group] = proc.wait(timeout=TIMEOUT_S)
    finally:
        for proc, log in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    logs = {g: (tmp_path / f"{g}.log").read_text()[-3000:] for g in procs}
    code = 0 if stop_at is None else 128 + signal.SIGTERM
    assert codes == {"dataprep": code, "trainer": code}, logs
    return time.monotonic() - stopped


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_a_sagemaker_job_stopped_at_its_limit_checkpoints_then_resumes_with_the_execution_role(
    s3: tuple[str, object], tmp_path: Path, record_aws_calls: Callable[..., Path]
) -> None:
    url, client = s3
    record_aws_calls(
        aws_calls.Names(cluster="rehearsal", checkpoint_bucket=BUCKET, dataset=DATASET),
        "sagemaker",
    )
    # MaxRuntimeInSeconds reached mid-run: SIGTERM after step 2 of many, no interval checkpoint
    # due, so the only checkpoint is the one the stop saves.
    spec = write_spec(tmp_path / "sm.toml", steps=1000, interval=1000)
    took = run_job(spec, url, tmp_path / "first", stop_at="step 2/1000 ")
    assert took < STOP_WINDOW_S  # SageMaker ends the job 120 s after the SIGTERM
    log = (tmp_path / "first" / "trainer.log").read_text()
    saved = re.findall(r"checkpoint step (\d+) complete \(sync, final\)", log)
    assert len(saved) == 1, log[-3000:]
    step = int(saved[0])
    assert step >= 2
    keys = set(list_keys(client, BUCKET, PREFIX))
    assert f"{PREFIX}step-{step}/COMPLETE" in keys
    assert f"{PREFIX}model/model.safetensors" not in keys  # stopped, not finished
    # Submitted again on the same checkpoints: it resumes from that step and finishes.
    run_job(write_spec(tmp_path / "sm.toml", steps=step + 4), url, tmp_path / "second")
    keys = set(list_keys(client, BUCKET, PREFIX))
    assert {f"{PREFIX}step-{step + 4}/COMPLETE", f"{PREFIX}model/model.safetensors"} <= keys
    assert not any(k.startswith(f"{PREFIX}step-{step}/") for k in keys)  # keep = 1
    assert f"(step {step})" in (tmp_path / "second" / "trainer.log").read_text()  # resumed
