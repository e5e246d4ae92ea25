"""The SageMaker contract, in the trainer image (SageMaker runs one image on every instance group
of a job): `docker run IMAGE train` on each host, with SageMaker's files where SageMaker puts them
(`/opt/ml/input/config/resourceconfig.json`, the spec as the `spec` input channel under
`/opt/ml/input/data/spec/`) and the environment `hetero sagemaker submit` sets, runs a short job
on the digits in S3 (moto, on loopback: the containers share the host's network) to its end:
both hosts exit 0, the checkpoint and the model are in the job's checkpoint prefix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sagemaker_job import BUCKET, PREFIX, digits_in_moto, resourceconfig, write_spec

from training.common.names import ENV_CHECKPOINT_URI, ENV_SPEC, SAGEMAKER_RESOURCECONFIG
from training.common.s3 import list_keys
from training.workstation.sagemaker_submit import CONTAINER_INPUT_DIR, SAGEMAKER_SPEC_CHANNEL

from .conftest import TRAINER_IMAGE, Containers

pytestmark = pytest.mark.image
STEPS = 8


@pytest.mark.timeout(600)
def test_docker_run_image_train_runs_a_sagemaker_job_to_its_end(
    containers: Containers, tmp_path: Path
) -> None:
    with digits_in_moto(tmp_path) as (url, client):
        channel = tmp_path / "channel"
        channel.mkdir()
        spec = write_spec(channel / "cluster.toml", steps=STEPS)
        channel_dir = f"{CONTAINER_INPUT_DIR}/{SAGEMAKER_SPEC_CHANNEL}"
        env = {
            # What `hetero sagemaker submit` puts in the training job's Environment.
            ENV_SPEC: f"{channel_dir}/{spec.name}",
            ENV_CHECKPOINT_URI: f"s3://{BUCKET}/{PREFIX}",
            # The emulated AWS (the execution role's credentials on SageMaker).
            "AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
        }  # fmt: skip
        hosts = {}
        for group in ("dataprep", "trainer"):
            config = tmp_path / f"resourceconfig-{group}.json"
            config.write_text(json.dumps(resourceconfig(group)))
            flags = ["-v", f"{config}:{SAGEMAKER_RESOURCECONFIG}:ro"]
            flags += ["-v", f"{channel}:{channel_dir}:ro"]
            hosts[group] = containers.start(
                f"sm-{group}", TRAINER_IMAGE, ["train"], flags=flags, env=env
            )
        codes = {g: containers.wait(name, timeout_s=420) for g, name in hosts.items()}
        logs = {g: containers.logs(name)[-3000:] for g, name in hosts.items()}
        assert codes == {"dataprep": 0, "trainer": 0}, logs
        keys = set(list_keys(client, BUCKET, PREFIX))
    assert {f"{PREFIX}step-{STEPS}/COMPLETE", f"{PREFIX}model/model.safetensors"} <= keys, keys
