"""``hetero local`` end to end: real data servers, real torchrun and trainer, real signals.

Each run ends with every process it started gone, whether training finished or was
interrupted with Ctrl-C (SIGINT).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import aws_calls
import boto3
import pytest
from moto.server import ThreadedMotoServer
from realdata import write_digits

from training.common.outcome import EXIT_STOPPED

from .processes import run_watched

REPO = Path(__file__).resolve().parents[2]

# A ViT small enough that a few steps take seconds on a shared 2-core CPU.
TINY_JOB = """
[job]
batch_size = 8
steps = {steps}
precision = "fp32"
log_every_steps = 2

[job.model]
name = "vit_tiny_patch16_224"

[job.model.overrides]
img_size = 32
patch_size = 8
depth = 2
embed_dim = 48
num_heads = 2
num_classes = 10

[job.dataset]
source = "synthetic"
num_samples = 512
num_classes = 10
image_size = 32

[job.checkpoint]
interval_steps = 1000
dir = "{checkpoints}"

[job.dataplane]
port = {port}
workers_per_server = 1
"""

S3_DATASET = """[job.dataset]
source = "s3"
path = "s3://data/digits/"
image_size = 32
num_classes = 10"""

TRAINER_GROUP = """
name = "local-test"
[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge"]
count = 1
"""

DATAPREP_GROUP = """
[[groups]]
name = "dataprep"
role = "dataprep"
instance_types = ["c6i.4xlarge"]
count = 2
"""


def write_spec(tmp_path: Path, *, steps: int, dataprep: bool, port: int = 50261) -> Path:
    text = TRAINER_GROUP + (DATAPREP_GROUP if dataprep else "")
    text += TINY_JOB.format(steps=steps, checkpoints=tmp_path / "checkpoints", port=port)
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return path


def hetero_local(spec: Path, run_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "training.cli", "local", "--spec", str(spec), "--run-dir",
        str(run_dir), "--grace", "20",
    ]  # fmt: skip


@pytest.mark.timeout(300)
def test_trainer_alone_runs_to_the_end_and_leaves_nothing(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, steps=4, dataprep=False)
    run_dir = tmp_path / "run"
    result = run_watched(hetero_local(spec, run_dir), cwd=REPO, timeout_s=240)
    assert result.returncode == 0, result.output
    assert result.descendants, "the local run started no process"
    assert result.survivors() == []
    summary = json.loads((run_dir / "local-run.json").read_text())
    assert summary["trainer_exit_code"] == 0 and summary["data_servers"] == {}
    trainer_summary = json.loads((run_dir / "summary.json").read_text())
    assert trainer_summary["steps"] == 4
    assert "local run finished" in result.output and "metrics.png" in result.output


@pytest.mark.timeout(300)
def test_heterogeneous_run_reads_an_s3_dataset_shuts_servers_down_and_leaves_nothing(
    tmp_path: Path, record_aws_calls: Callable[..., Path]
) -> None:
    """``source = "s3"``: the data servers list the prefix and read each image from (moto's) S3.
    Their calls are recorded as the instance role's: on EC2 these processes run on the
    cluster's instances and read the dataset with its grant."""
    record_aws_calls(aws_calls.Names(cluster="local-test", dataset="s3://data/digits/"), "instance")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {
            **os.environ,
            "AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
        }  # fmt: skip
        s3 = boto3.client(
            "s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )  # fmt: skip
        s3.create_bucket(Bucket="data")
        digits = write_digits(tmp_path / "digits", size=32)
        for path in sorted(digits.val_dir.rglob("*.png")):
            key = f"digits/{path.relative_to(digits.val_dir).as_posix()}"
            s3.put_object(Bucket="data", Key=key, Body=path.read_bytes())
        spec = write_spec(tmp_path, steps=4, dataprep=True)
        text = spec.read_text()
        synthetic = text[text.index("[job.dataset]") :].split("\n\n")[0]
        spec.write_text(text.replace(synthetic, S3_DATASET))
        run_dir = tmp_path / "run"
        result = run_watched(hetero_local(spec, run_dir), cwd=REPO, timeout_s=240, env=env)
    finally:
        server.stop()
    assert result.returncode == 0, result.output
    assert result.survivors() == []
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4
    assert "s3://data/digits/" in result.output
    summary = json.loads((run_dir / "local-run.json").read_text())
    assert summary["trainer_exit_code"] == 0
    assert len(summary["data_servers"]) == 2
    # Both servers exited 0 on their own: the trainer's Shutdown RPC reached them.
    assert set(summary["data_servers"].values()) == {0}
    assert summary["servers_stopped_by_trainer"] is True
    # The run's TensorBoard events, as TensorBoard reads them, and the command to watch them.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/data_wait_share")] == [2, 4]  # every 2 steps
    assert events.Tags()["images"] == ["inputs/augmented"]
    assert f"TensorBoard: tensorboard --logdir {(run_dir / 'tensorboard').resolve()}" in (
        result.output
    )


@pytest.mark.timeout(300)
def test_ctrl_c_mid_run_stops_everything(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, steps=100_000, dataprep=True, port=50271)
    run_dir = tmp_path / "run"

    def interrupt_once_training(proc: subprocess.Popen[str], output: str) -> bool:
        if "step 2/" not in output:
            return False
        proc.send_signal(signal.SIGINT)
        return True

    result = run_watched(
        hetero_local(spec, run_dir), cwd=REPO, timeout_s=240, act=interrupt_once_training
    )
    assert "step 2/" in result.output, result.output
    assert result.returncode == 128 + signal.SIGINT, result.output
    assert result.survivors() == []
    summary = json.loads((run_dir / "local-run.json").read_text())
    assert summary["stopped_by"] == "received SIGINT"
    # The trainer got SIGTERM, checkpointed and stopped (resumable) within the grace period.
    assert summary["trainer_exit_code"] == EXIT_STOPPED
    assert list((tmp_path / "checkpoints").glob("step-*"))


def test_free_port_skips_ports_in_use_and_taken() -> None:
    import socket

    from training.local.run import free_port

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        chosen = free_port(port, taken={port + 1})
    assert chosen not in (port, port + 1) and chosen > port


def test_server_count_and_trainer_ranks_follow_the_spec(tmp_path: Path) -> None:
    from training.local.run import data_server_count, default_nproc
    from training.spec import load_spec

    spec = load_spec(write_spec(tmp_path, steps=1, dataprep=True))
    assert data_server_count(spec) == 2
    assert default_nproc(spec, gpus=0) == 1  # one g5.xlarge: one rank
    assert default_nproc(spec, gpus=8) == 1


def test_gpus_are_counted_from_the_driver_and_cuda_visible_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from training.local.run import visible_gpus

    assert visible_gpus(tmp_path / "no-driver") == 0
    for bus in ("0000:10:1c.0", "0000:10:1d.0", "0000:20:1c.0"):
        (tmp_path / bus).mkdir()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus(tmp_path) == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert visible_gpus(tmp_path) == 1
