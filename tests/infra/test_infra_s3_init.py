"""An ``s3://`` ``job.model.init`` in the cluster stack: the job ``cdk deploy`` starts reads it
where it is (``hetero job start`` and ``sagemaker submit`` copy it into the checkpoint bucket
instead, ``training.common.s3_init``), so the instance role, and no other, may read the objects
of exactly its folder; a spec without one grants nothing of the kind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from infra_support import SPOT_SPEC, build, statements_by_role

from infra.cluster import init_read_uri

PARTITION = {"Ref": "AWS::Partition"}


def _spec(init: str) -> str:
    text = SPOT_SPEC.replace(
        "[job]\nsteps = 100\n", f'[job]\nsteps = 100\n\n[job.model]\ninit = "{init}"\n'
    )
    assert text != SPOT_SPEC
    return text


def _init_statements(template: Any) -> dict[str, list[dict[str, Any]]]:
    return statements_by_role(template, lambda s: s.get("Sid", "").startswith("InitWeights"))


@pytest.mark.parametrize(
    ("init", "folder"),
    [
        ("s3://user-weights/vit/model.safetensors", "vit/"),
        ("s3://user-weights/runs/7/checkpoint-12.pth.tar", "runs/7/"),
        ("s3://user-weights/vit-hub", "vit-hub/"),
        ("s3://user-weights/vit-hub/", "vit-hub/"),
        ("s3://user-weights/zips/vit.zip", "zips/"),
    ],
)
def test_the_instance_role_alone_reads_the_inits_folder(
    tmp_path: Path, init: str, folder: str
) -> None:
    """A file's folder (the config.json beside it is read too), a folder itself: GetObject on
    its objects and nothing else in that bucket (no listing: a reader that tries several names
    takes S3's 403 for a missing one as missing, training/trainer/init_weights.py)."""
    assert init_read_uri(init) == f"s3://user-weights/{folder}"
    built = build(tmp_path, _spec(init))
    stack = built.stacks.cluster
    found = _init_statements(built.cluster)
    role = stack.get_logical_id(stack.instance_role.role.node.default_child)  # type: ignore[arg-type]
    assert found == {
        role: [
            {
                "Sid": "InitWeightsObjects",
                "Effect": "Allow",
                "Action": "s3:GetObject",
                "Resource": {
                    "Fn::Join": ["", ["arn:", PARTITION, f":s3:::user-weights/{folder}*"]]
                },
            }
        ]
    }


def test_no_s3_init_no_grant(tmp_path: Path) -> None:
    assert init_read_uri(None) is None and init_read_uri("timm:vit_tiny_patch16_224") is None
    built = build(tmp_path, SPOT_SPEC)
    assert _init_statements(built.cluster) == {}
