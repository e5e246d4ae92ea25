"""What the tests of an ``s3://`` ``job.model.init`` in the user's own bucket share (moto): the
source objects, the copy's folder recomputed from the source's ETags, the objects under a
prefix, and a user whose credentials may do everything but read the source bucket (moto checking
IAM)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any, TypeVar

import boto3
from moto.core import set_initial_no_auth_action_count

SOURCE = "user-weights"
"""The user's bucket: not the checkpoint bucket, which the cluster's roles cannot read."""
FILE_INIT = f"s3://{SOURCE}/vit/model.safetensors"
FOLDER_INIT = f"s3://{SOURCE}/vit-hub/"
WEIGHTS = bytes(range(256)) * (6 << 12)
"""6 MiB of weights (the bytes do not matter to the copy): above ``PART``, so copied in parts."""
PART = 5 << 20
"""The tests' ``s3_init.MULTIPART_COPY_BYTES`` (S3's, and moto's, least part size)."""
CONFIG = b'{"architecture": "vit_tiny_patch16_224"}'
FILE_OBJECTS = {"vit/model.safetensors": WEIGHTS, "vit/config.json": CONFIG}
"""A weights file and the config.json beside it (the trainer reads that one too)."""
FOLDER_OBJECTS = {
    "vit-hub/model.safetensors": WEIGHTS,
    "vit-hub/config.json": CONFIG,
    "vit-hub/README.md": b"# vit\n",
    "vit-hub/extra/notes.txt": b"kept\n",
}
UNRELATED = {"vit-hub-old/model.safetensors": b"old", "other/config.json": b"{}"}
"""Objects beside the inits, which no copy takes."""

T = TypeVar("T")


def put_source(s3: Any) -> None:
    s3.create_bucket(Bucket=SOURCE)
    for key, body in {**FILE_OBJECTS, **FOLDER_OBJECTS, **UNRELATED}.items():
        s3.put_object(Bucket=SOURCE, Key=key, Body=body)


def staged_folder(s3: Any, init: str, keys: list[str], base: str = "checkpoints/") -> str:
    """``<base>init/<sha256>/``: the digest of the init's URI and each source object's name
    (relative to the init's folder), size and ETag, read here from S3, in name order."""
    folder = init.removeprefix(f"s3://{SOURCE}/").rpartition("/")[0] + "/"
    digest = hashlib.sha256(f"{init}\0".encode())
    for key in sorted(keys):
        head = s3.head_object(Bucket=SOURCE, Key=key)
        name, size, etag = key[len(folder) :], head["ContentLength"], head["ETag"].strip('"')
        digest.update(f"{name}\0{size}\0{etag}\0".encode())
    return f"{base}init/{digest.hexdigest()}/"


def objects(s3: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    found = [o["Key"] for page in pages for o in page.get("Contents", [])]
    return {k: s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in found}


def as_user_denied_source(run: Callable[[dict[str, str]], T]) -> T:
    """``run(credentials)`` with moto checking IAM from now on, for a user whose one policy
    allows everything but S3 on ``SOURCE`` (explicitly denied)."""
    denied = [f"arn:aws:s3:::{SOURCE}", f"arn:aws:s3:::{SOURCE}/*"]
    policy = {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Action": "*", "Resource": "*"},
            {"Effect": "Deny", "Action": "s3:*", "Resource": denied},
        ],
    }

    @set_initial_no_auth_action_count(3)  # the three IAM calls below
    def as_user() -> T:
        iam = boto3.client("iam", region_name="us-east-1")
        iam.create_user(UserName="engineer")
        iam.put_user_policy(
            UserName="engineer", PolicyName="no-user-weights", PolicyDocument=json.dumps(policy)
        )
        key = iam.create_access_key(UserName="engineer")["AccessKey"]
        return run(
            {
                "aws_access_key_id": key["AccessKeyId"],
                "aws_secret_access_key": key["SecretAccessKey"],
            }
        )

    return as_user()
