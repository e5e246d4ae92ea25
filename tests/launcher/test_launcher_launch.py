"""``hetero launch``: the plan it makes on SageMaker, its exit codes, and a real data server role
that ends on the Shutdown RPC or on SIGTERM with nothing left behind."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
import grpc
import pytest
from moto import mock_aws

from training.cli import main
from training.dataplane.client import DataPlaneClient

from .conftest import FakeImds
from .processes import run_watched
from .test_launcher_group import RESOURCECONFIG, tag_imds
from .test_launcher_peers import launch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_group_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HETERO_GROUP", "HETERO_CHECKPOINT_URI"):
        monkeypatch.delenv(name, raising=False)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_sagemaker_trainer_plan(
    spec_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = dict(RESOURCECONFIG, current_host="algo-2", current_group_name="trainer")
    rc_path = tmp_path / "resourceconfig.json"
    rc_path.write_text(json.dumps(config))
    code = main(["launch", "--spec", str(spec_path), "--resourceconfig", str(rc_path), "--dry-run"])
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith("trainer: NCCL_SOCKET_IFNAME=eth0 ")
    assert "--nnodes 2 --node-rank 1 --master-addr algo-1 --master-port 29500" in out
    assert "--nproc-per-node 4" in out
    assert "--data-servers algo-3:50051,algo-4:50051" in out
    assert "--checkpoint-dir /opt/ml/checkpoints" in out


def test_sagemaker_trainer_keeps_checkpoints_in_the_jobs_s3_uri(
    spec_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # SageMaker syncs /opt/ml/checkpoints per host; with the job's checkpoint URI in the
    # environment, every host stages locally and the trainer's S3 store holds all shards.
    monkeypatch.setenv("HETERO_CHECKPOINT_URI", "s3://bucket/checkpoints/vit-test/")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    config = dict(RESOURCECONFIG, current_host="algo-2", current_group_name="trainer")
    rc_path = tmp_path / "resourceconfig.json"
    rc_path.write_text(json.dumps(config))
    code = main(["launch", "--spec", str(spec_path), "--resourceconfig", str(rc_path), "--dry-run"])
    assert code == 0
    out = capsys.readouterr().out
    assert (
        f"--checkpoint-dir {tmp_path}/tmp/hetero/checkpoints "
        "--outcome-dir /opt/ml/output/data/outcome "
        "--checkpoint-s3-uri s3://bucket/checkpoints/vit-test/"
    ) in out
    assert "/opt/ml/checkpoints" not in out


def test_sagemaker_dataprep_plan_serves_on_all_interfaces(
    spec_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc_path = tmp_path / "resourceconfig.json"
    rc_path.write_text(json.dumps(RESOURCECONFIG))
    assert (
        main(["launch", "--spec", str(spec_path), "--resourceconfig", str(rc_path), "--dry-run"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("data-server-0: ")
    assert "serve --spec" in out and "--port 50051 --host 0.0.0.0" in out


def test_no_group_anywhere_exits_2_with_the_list(
    spec_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    code = main(
        [
            "launch", "--spec", str(spec_path), "--resourceconfig", str(tmp_path / "none.json"),
            "--imds-url", f"http://127.0.0.1:{closed_port()}", "--imds-timeout", "0.5",
        ]
    )  # fmt: skip
    assert code == 2
    assert "Tried, in order" in caplog.text and "IMDSv2" in caplog.text


def write_server_spec(tmp_path: Path, port: int) -> Path:
    path = tmp_path / "serve.toml"
    path.write_text(
        f"""
name = "launch-test"
[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge"]
count = 1
[[groups]]
name = "dataprep"
role = "dataprep"
instance_types = ["c6i.4xlarge"]
count = 1
[job]
batch_size = 4
[job.dataset]
num_samples = 64
num_classes = 10
image_size = 32
[job.dataplane]
port = {port}
workers_per_server = 1
"""
    )
    return path


def launch_cmd(spec: Path) -> list[str]:
    return [
        sys.executable, "-m", "training.cli", "launch", "--spec", str(spec), "--group",
        "dataprep", "--backend", "local", "--grace", "10",
    ]  # fmt: skip


def shutdown_when_serving(address: str):  # type: ignore[no-untyped-def]
    def act(proc: subprocess.Popen[str], output: str) -> bool:
        client = DataPlaneClient([address], batch_size=4, rpc_timeout_s=2)
        try:
            client.server_info(address)
        except Exception:
            return False
        finally:
            client.close()
        client = DataPlaneClient([address], batch_size=4, rpc_timeout_s=5)
        try:
            assert client.shutdown_servers() == [address]
        finally:
            client.close()
        return True

    return act


@pytest.mark.timeout(180)
def test_dataprep_role_ends_with_shutdown_rpc_exit_0(tmp_path: Path) -> None:
    port = closed_port()
    spec = write_server_spec(tmp_path, port)
    address = f"127.0.0.1:{port}"
    result = run_watched(
        launch_cmd(spec), cwd=REPO, timeout_s=150, act=shutdown_when_serving(address)
    )
    assert result.returncode == 0, result.output
    assert "data-server-0 exited with code 0" in result.output
    assert result.descendants and result.survivors() == []


@pytest.mark.timeout(180)
def test_sigterm_stops_the_role_and_exits_143(tmp_path: Path) -> None:
    port = closed_port()
    spec = write_server_spec(tmp_path, port)

    def terminate_when_serving(proc: subprocess.Popen[str], output: str) -> bool:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=0.5)
            except grpc.FutureTimeoutError:
                return False
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        return True

    result = run_watched(launch_cmd(spec), cwd=REPO, timeout_s=150, act=terminate_when_serving)
    assert result.returncode == 128 + signal.SIGTERM, result.output
    assert "stopped: received SIGTERM" in result.output
    assert result.survivors() == []


@pytest.mark.timeout(180)
def test_exit_code_mirrors_a_failing_role(tmp_path: Path) -> None:
    # The data server cannot bind a port that is already taken: its failure is the launcher's.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        spec = write_server_spec(tmp_path, taken.getsockname()[1])
        result = run_watched(launch_cmd(spec), cwd=REPO, timeout_s=150)
    assert result.returncode != 0, result.output
    assert f"data-server-0 exited with code {result.returncode}" in result.output
    assert result.survivors() == []


def ec2_trainer_dry_run(spec_path: Path, tmp_path: Path, fake_imds: FakeImds) -> int:
    """``hetero launch --dry-run`` on the second of two trainer instances (10.0.0.40, .41) with
    two dataprep instances (.50, .51), all tagged in moto's EC2; its exit code (the plan is on
    stdout)."""
    with mock_aws():
        client = boto3.client("ec2", region_name="us-west-2")
        vpc = client.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
        subnet = client.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24")["Subnet"]["SubnetId"]
        ec2 = (client, subnet)
        launch(ec2, "10.0.0.40", "trainer")
        me = launch(ec2, "10.0.0.41", "trainer")
        launch(ec2, "10.0.0.50", "dataprep")
        launch(ec2, "10.0.0.51", "dataprep")
        tag_imds(fake_imds, "trainer")
        fake_imds.set("/latest/meta-data/instance-id", me)
        return main(
            [
                "launch", "--spec", str(spec_path), "--resourceconfig", str(tmp_path / "no"),
                "--imds-url", fake_imds.url, "--dry-run",
            ]
        )  # fmt: skip


def test_ec2_trainer_plan_from_imds_tags_and_describe_instances(
    spec_path: Path,
    tmp_path: Path,
    fake_imds: FakeImds,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HETERO_CHECKPOINT_URI", "s3://bucket/checkpoints/vit-test/")
    assert ec2_trainer_dry_run(spec_path, tmp_path, fake_imds) == 0
    out = capsys.readouterr().out
    assert "--nnodes 2 --node-rank 1 --master-addr 10.0.0.40 --master-port " in out
    # Hosts wait for each other a minute at most (torchrun's static rendezvous waits 600 s).
    assert "--rdzv-conf timeout=60 --nproc-per-node 4 " in out
    # The trainer finds data servers by the cluster's tags while it runs (replacements come
    # back at new addresses), in the instance's region.
    assert "--data-servers ec2:vit-test " in out
    assert out.startswith("trainer: AWS_DEFAULT_REGION=us-west-2 ")
    # Every trainer host stages its shards locally and the trainer itself uploads them to S3.
    assert (
        "--checkpoint-dir /tmp/hetero/checkpoints --outcome-dir runs/vit-test/outcome "
        "--checkpoint-s3-uri s3://bucket/checkpoints/vit-test/"
    ) in out


def _elastic(spec_path: Path) -> Path:
    """The same spec with its dataprep group elastic (1 to 4, starting at 2)."""
    text = spec_path.read_text().replace(
        'instance_types = ["c6i.4xlarge"]\ncount = 2\n',
        'instance_types = ["c6i.4xlarge"]\ncount = 2\nmin_count = 1\nmax_count = 4\n',
    )
    assert "max_count = 4" in text
    spec_path.write_text(text)
    return spec_path


def test_sagemaker_trainer_of_an_elastic_group_only_reports(
    spec_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A SageMaker job's instance groups are fixed: the controller runs in report mode."""
    config = dict(RESOURCECONFIG, current_host="algo-1", current_group_name="trainer")
    rc_path = tmp_path / "resourceconfig.json"
    rc_path.write_text(json.dumps(config))
    args = ["launch", "--spec", str(_elastic(spec_path)), "--resourceconfig", str(rc_path)]
    assert main([*args, "--dry-run"]) == 0
    assert "--autoscale report" in capsys.readouterr().out


def test_ec2_trainer_of_an_elastic_group_scales_its_auto_scaling_group(
    spec_path: Path,
    tmp_path: Path,
    fake_imds: FakeImds,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HETERO_CHECKPOINT_URI", "s3://bucket/checkpoints/vit-test/")
    assert ec2_trainer_dry_run(_elastic(spec_path), tmp_path, fake_imds) == 0
    out = capsys.readouterr().out
    assert "--autoscale asg:vit-test-dataprep" in out
