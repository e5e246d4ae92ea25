"""Shared parts for the launcher tests: a real HTTP server speaking IMDSv2, and specs on disk."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from training.launcher.ec2_job import Ec2Job, JobAws, job_clock
from training.spec import ClusterSpec, load_spec

# Two trainer hosts with 4 GPUs each, two dataprep hosts: enough to check ordering and ranks.
CLUSTER_TOML = """
name = "vit-test"

[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.12xlarge"]
count = 2

[[groups]]
name = "dataprep"
role = "dataprep"
instance_types = ["c6i.4xlarge"]
count = 2

[job]
steps = 10

[job.dataplane]
port = 50051
"""


def one_of_each(name: str) -> str:
    """A spec of one trainer (g5.xlarge) and one dataprep (c6i.4xlarge) instance, 10 steps;
    text appended to it lands in ``[job]``."""
    return f"""
name = "{name}"
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
steps = 10
"""


def stubbed(service: str) -> Iterator[tuple[Any, Stubber]]:
    """A ``service`` client (fake credentials) under a Stubber whose answers must all be used."""
    client = boto3.client(
        service,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    with Stubber(client) as stub:
        yield client, stub
        stub.assert_no_pending_responses()


class FakeImds:
    """IMDSv2 on 127.0.0.1: ``PUT /latest/api/token`` (with the TTL header) returns a token;
    GETs without that token get 401; known paths answer 200, others 404."""

    TOKEN = "fake-imds-token"

    def __init__(self) -> None:
        self.paths: dict[str, str] = {}
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def _reply(self, code: int, body: str = "") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:
                with fake.lock:
                    fake.requests.append(("PUT", self.path))
                if self.path != "/latest/api/token":
                    self._reply(404)
                elif not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    self._reply(400, "missing TTL header")
                else:
                    self._reply(200, FakeImds.TOKEN)

            def do_GET(self) -> None:
                with fake.lock:
                    fake.requests.append(("GET", self.path))
                    body = fake.paths.get(self.path)
                if self.headers.get("X-aws-ec2-metadata-token") != FakeImds.TOKEN:
                    self._reply(401)
                elif body is None:
                    self._reply(404)
                else:
                    self._reply(200, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def set(self, path: str, body: str) -> None:
        with self.lock:
            self.paths[path] = body


HOST_INSTANCE = "i-0123456789abcdef0"
HOST_GROUPS = ["vit-trainer", "vit-dataprep"]
"""The instance and the Auto Scaling groups of ``as_deployed_host``."""


def as_deployed_host(
    monkeypatch: pytest.MonkeyPatch,
    imds: FakeImds,
    record_dir: Path,
    *,
    job_parameter: str | None = None,
) -> None:
    """This process as ``hetero launch`` runs on an instance the stack launched: IMDS gives
    ``HOST_INSTANCE`` in us-east-1, the user data's variables name the groups and the checkpoint
    folder (the job record), and the job parameter when given."""
    imds.paths.update(
        {
            "/latest/meta-data/instance-id": HOST_INSTANCE,
            "/latest/meta-data/local-ipv4": "10.0.0.5",
            "/latest/meta-data/placement/region": "us-east-1",
        }
    )
    env = {
        "HETERO_ASG_NAMES": ",".join(HOST_GROUPS),
        "HETERO_CHECKPOINT_URI": str(record_dir),
        "HETERO_CLUSTER": "vit",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    if job_parameter is not None:
        env["HETERO_JOB_PARAMETER"] = job_parameter
    for k, v in env.items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def fake_imds() -> Iterator[FakeImds]:
    imds = FakeImds()
    imds.thread.start()
    try:
        yield imds
    finally:
        imds.server.shutdown()
        imds.server.server_close()


@pytest.fixture
def spec_path(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(CLUSTER_TOML)
    return path


@pytest.fixture
def spec(spec_path: Path) -> ClusterSpec:
    return load_spec(spec_path)


def ec2_job(
    spec: ClusterSpec,
    *,
    ec2: Any,
    autoscaling: Any,
    record: Any,
    asg_names: list[str],
    job_watch: Any = None,
    **kwargs: Any,
) -> Ec2Job:
    """An ``Ec2Job`` wired as ``ec2_start`` wires it: these clients, record and groups, and the
    budget clock ``job_clock`` makes from them; ``kwargs``: the job's other arguments."""
    aws = JobAws(ec2=ec2, autoscaling=autoscaling, record=record, asg_names=asg_names)
    clock = job_clock(spec, kwargs["identity"], aws, job_watch)
    return Ec2Job(spec, aws=aws, clock=clock, job_watch=job_watch, **kwargs)
