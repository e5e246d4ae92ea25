"""A SageMaker heterogeneous job's parts that the tests running one share (the process run in
tests/launcher/test_sagemaker_run.py, the container run in tests/images/): each host's
``resourceconfig.json``, the rehearsal's spec on one host per group with the digits in S3, and a
moto server holding them and the checkpoint bucket."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
from moto.server import ThreadedMotoServer
from realdata import write_digits

REPO = Path(__file__).resolve().parents[1]
BUCKET = "sm-checkpoints"
DATASET = "s3://data/digits/"
PREFIX = "checkpoints/sagemaker/sm-20261127-120000/"
HOSTS = {"trainer": "127.0.0.1", "dataprep": "127.0.0.2"}


def resourceconfig(group: str) -> dict[str, object]:
    """SageMaker's ``resourceconfig.json`` on the host of ``group`` (one host per group)."""
    return {
        "current_host": HOSTS[group],
        "current_instance_type": "ml.g5.xlarge" if group == "trainer" else "ml.c5.xlarge",
        "current_group_name": group,
        "hosts": sorted(HOSTS.values()),
        "instance_groups": [
            {"instance_group_name": g, "instance_type": "ml.x", "hosts": [h]}
            for g, h in HOSTS.items()
        ],
        "network_interface_name": "lo",
    }


@contextlib.contextmanager
def digits_in_moto(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """A moto server with the checkpoint bucket and 360 digits as images (``<class>/<n>.png``)."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    client = boto3.client(
        "s3", endpoint_url=url, region_name="us-east-1",
        aws_access_key_id="testing", aws_secret_access_key="testing",
    )  # fmt: skip
    client.create_bucket(Bucket=BUCKET)
    client.create_bucket(Bucket="data")
    digits = write_digits(tmp_path / "digits", size=32)
    for path in sorted(digits.val_dir.rglob("*.png")):
        key = f"digits/{path.relative_to(digits.val_dir).as_posix()}"
        client.put_object(Bucket="data", Key=key, Body=path.read_bytes())
    try:
        yield url, client
    finally:
        server.stop()


def write_spec(path: Path, steps: int, interval: int = 4) -> Path:
    """The rehearsal's spec on one host per group, the digits in S3, one checkpoint kept, one
    every ``interval`` steps."""
    text = (REPO / "specs" / "rehearsal.toml").read_text()
    dataset = text[text.index("[job.dataset]") : text.index("[job.checkpoint]")]
    images = f'source = "s3"\npath = "{DATASET}"\nimage_size = 32\nnum_classes = 10\n'
    text = text.replace(dataset, f"[job.dataset]\n{images}val_fraction = 0.1\n\n")
    text = text.replace("\ncount = 2\n", "\ncount = 1\n").replace("\nkeep = 2\n", "\nkeep = 1\n")
    text = text.replace("\ninterval_steps = 4\n", f"\ninterval_steps = {interval}\n")
    path.write_text(text.replace("\nsteps = 24 ", f"\nsteps = {steps} "))
    return path
