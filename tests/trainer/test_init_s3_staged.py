"""``job.model.init = "s3://..."`` in the user's own bucket, as the trainer reads it: the copy that
``hetero job start`` / ``sagemaker submit`` stage in the checkpoint bucket
(``training.common.s3_init``), named by ``HETERO_INIT_URI``, gives the source's tensors and the
data config of the ``config.json`` copied beside a weights file; the instance reads only the
checkpoint bucket (its calls recorded for the IAM proof). moto's S3, weights written by timm's
own ``save_for_hf`` (``tests/hub_cache.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import aws_calls
import pytest
import torch
from hub_cache import write_hub_cache

from training.common.names import ENV_INIT_URI
from training.common.s3_init import stage_s3_init
from training.spec import load_spec
from training.trainer.config import TrainerConfig
from training.trainer.model import start_model

from .conftest import write_spec

FILES = ("config.json", "model.safetensors")


def started(path: Path, environ: dict[str, str]) -> Any:
    config = TrainerConfig.from_spec(
        load_spec(path), run_dir=path.parent, synthetic=True, environ=environ
    )
    return start_model(config.model, seed=0)


@pytest.mark.parametrize(
    ("init", "read"),
    [
        ("s3://user-weights/vit/model.safetensors", "model.safetensors"),
        ("s3://user-weights/vit/", ""),
    ],
)
def test_the_trainer_reads_the_staged_copy_with_the_sources_tensors_and_config(
    tmp_path: Path,
    mock_s3: Any,
    record_aws_calls: Callable[..., Path],
    init: str,
    read: str,
) -> None:
    hub = write_hub_cache(tmp_path / "hf")
    mock_s3.create_bucket(Bucket="user-weights")
    mock_s3.create_bucket(Bucket="ckpt")
    for name in FILES:
        mock_s3.upload_file(str(hub.snapshot / name), "user-weights", f"vit/{name}")
    staged = stage_s3_init(init, s3=mock_s3, checkpoint_base_uri="s3://ckpt/checkpoints/")
    assert staged is not None and staged.uri.startswith("s3://ckpt/checkpoints/init/")
    assert staged.uri == staged.staged + read
    record_aws_calls(
        aws_calls.Names(cluster="trainer-test", checkpoint_bucket="ckpt"), principal="instance"
    )
    spec = write_spec(tmp_path, model_keys=f'init = "{init}"')
    model = started(spec, {ENV_INIT_URI: staged.uri})
    assert model.weights is not None and model.weights.uri == init
    assert model.weights.file == f"{staged.staged}model.safetensors"  # the copy, not the source
    assert model.weights.data_from == "the weights' config.json"
    state = model.model.state_dict()
    body = [k for k in hub.state_dict if not k.startswith("head.")]
    assert body and all(torch.equal(state[k], hub.state_dict[k]) for k in body)


@pytest.mark.parametrize(
    ("init", "kept"),
    [
        ("s3://user-weights/vit/model.safetensors", FILES),
        ("s3://user-weights/vit/", ("config.json", "pytorch_model.bin")),
    ],
)
def test_the_job_a_deploy_starts_reads_the_source_where_it_is(
    tmp_path: Path,
    mock_s3: Any,
    record_aws_calls: Callable[..., Path],
    init: str,
    kept: tuple[str, ...],
) -> None:
    """No copy (the pointer a deploy writes has no ``init_uri``): the trainer reads the user's
    bucket itself, which the stack grants the instance role on the init's folder
    (infra/stacks.py). A folder of ``pytorch_model.bin`` only: model.safetensors is tried first
    and missing (404 here; 403 under the grant, which gives no listing: taken as missing too)."""
    hub = write_hub_cache(tmp_path / "hf")
    mock_s3.create_bucket(Bucket="user-weights")
    if "pytorch_model.bin" in kept:
        torch.save(hub.state_dict, tmp_path / "pytorch_model.bin")
        mock_s3.upload_file(
            str(tmp_path / "pytorch_model.bin"), "user-weights", "vit/pytorch_model.bin"
        )
    for name in ("config.json", "model.safetensors"):
        if name in kept:
            mock_s3.upload_file(str(hub.snapshot / name), "user-weights", f"vit/{name}")
    record_aws_calls(
        aws_calls.Names(
            cluster="trainer-test", checkpoint_bucket="ckpt", init_bucket="user-weights"
        ),
        principal="instance",
    )
    spec = write_spec(tmp_path, model_keys=f'init = "{init}"')
    model = started(spec, {})
    assert model.weights is not None and model.weights.uri == init
    weights = "model.safetensors" if "model.safetensors" in kept else "pytorch_model.bin"
    assert model.weights.file == f"s3://user-weights/vit/{weights}"
    assert model.weights.data_from == "the weights' config.json"
    state = model.model.state_dict()
    body = [k for k in hub.state_dict if not k.startswith("head.")]
    assert body and all(torch.equal(state[k], hub.state_dict[k]) for k in body)
