"""``hetero job start`` with ``job.model.init = "s3://..."`` in the user's own bucket, against moto
(SSM, S3, Auto Scaling): the file (with its config.json) or every object of the folder is copied
once, server-side, to ``<checkpoint prefix>/init/<sha256 of the URI and ETags>/`` (a second start
copies nothing), the pointer names the copy, and the launcher hands it to the trainer; a source
that is missing, unreadable (moto checking IAM) or too big stops the start before anything
changes; an init under the checkpoint prefix is read where it is."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aws_calls
import boto3
import pytest

from training.cli import main
from training.common import s3_init
from training.common.jobparam import read_job_pointer
from training.launcher.ec2_start import staged_init
from training.spec import load_spec
from training.workstation.jobstart import JobStartError, start_job

from .conftest import CLUSTER_TOML
from .s3_init_support import (
    CONFIG,
    FILE_INIT,
    FILE_OBJECTS,
    FOLDER_INIT,
    FOLDER_OBJECTS,
    PART,
    SOURCE,
    WEIGHTS,
    as_user_denied_source,
    objects,
    put_source,
    staged_folder,
)
from .test_launcher_jobstart import NAME, NOW, REGION, aws, sizes, start  # noqa: F401 (aws)

NAMES = aws_calls.Names(cluster="vit-test", checkpoint_bucket="ckpt", init_bucket=SOURCE)
WRITES = {"CopyObject", "CreateMultipartUpload", "UploadPartCopy", "CompleteMultipartUpload"}
"""What a copy into the checkpoint bucket asks S3 for."""


def spec_with(tmp_path: Path, init: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(CLUSTER_TOML + f'\n[job.model]\nname = "vit-cpu-tiny"\ninit = "{init}"\n')
    return path


@pytest.fixture
def source(aws: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:  # noqa: F811
    """The user's bucket beside the cluster's, and copies in parts above 5 MiB."""
    monkeypatch.setattr(s3_init, "MULTIPART_COPY_BYTES", PART)
    put_source(aws["s3"])
    return aws["s3"]


def copies(folder: Path) -> Counter[tuple[str, str, str]]:
    """(operation, target key, source key) of every write the recorded calls made."""
    return Counter(
        (c["operation"], c["params"]["Key"], (c["params"].get("CopySource") or {}).get("Key", ""))
        for c in aws_calls.read_log(folder)
        if c["operation"] in WRITES | {"PutObject"}
    )


def test_a_file_in_the_users_bucket_is_copied_once_and_the_pointer_names_the_copy(
    aws: dict[str, Any],  # noqa: F811
    source: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    record_aws_calls: Callable[..., Path],
) -> None:
    log = record_aws_calls(NAMES)
    path = spec_with(tmp_path, FILE_INIT)
    args = ["job", "start", "--spec", str(path), "--offline-prices", "--region", REGION]
    assert main([*args, "--fresh"]) == 0
    pointer = read_job_pointer(aws["ssm"], NAME)
    folder = staged_folder(source, FILE_INIT, list(FILE_OBJECTS))
    uri = f"s3://ckpt/{folder}model.safetensors"
    assert (pointer.init, pointer.init_uri) == (FILE_INIT, uri)
    assert objects(aws["s3"], "ckpt", "checkpoints/init/") == {
        f"{folder}model.safetensors": WEIGHTS,
        f"{folder}config.json": CONFIG,
    }
    size = (len(WEIGHTS) + len(CONFIG)) / 1e6
    line = f"job.model.init: {FILE_INIT} -> {uri} ("
    assert f"{line}copied now ({size:.1f} MB, 2 object(s)))" in capsys.readouterr().out
    # The groups run now: --force. The copy is there: nothing is copied again.
    assert main([*args, "--force"]) == 0
    assert f"{line}already there ({size:.1f} MB, 2 object(s)))" in capsys.readouterr().out
    assert read_job_pointer(aws["ssm"], NAME).init_uri == uri
    weights, config = f"{folder}model.safetensors", f"{folder}config.json"
    assert copies(log) == {  # Over both starts: one copy, in parts above 5 MiB, no upload.
        ("CreateMultipartUpload", weights, ""): 1,
        ("UploadPartCopy", weights, "vit/model.safetensors"): 2,
        ("CompleteMultipartUpload", weights, ""): 1,
        ("CopyObject", config, "vit/config.json"): 1,
    }
    assert {
        c["params"]["CopySource"]["Bucket"]
        for c in aws_calls.read_log(log)
        if "CopySource" in c["params"]
    } == {SOURCE}
    # The launcher hands the copy, in the checkpoint bucket, to the trainer (HETERO_INIT_URI).
    assert staged_init(read_job_pointer(aws["ssm"], NAME), load_spec(path)) == uri


def test_a_folder_prefix_is_copied_object_by_object_once(
    aws: dict[str, Any],  # noqa: F811
    source: Any,
    tmp_path: Path,
    record_aws_calls: Callable[..., Path],
) -> None:
    record_aws_calls(NAMES)
    path = spec_with(tmp_path, FOLDER_INIT)
    assert main(["job", "start", "--spec", str(path), "--fresh", "--offline-prices"]) == 0
    pointer = read_job_pointer(aws["ssm"], NAME)
    folder = staged_folder(source, FOLDER_INIT, list(FOLDER_OBJECTS))
    assert (pointer.init, pointer.init_uri) == (FOLDER_INIT, f"s3://ckpt/{folder}")
    assert objects(aws["s3"], "ckpt", "checkpoints/init/") == {
        folder + key.removeprefix("vit-hub/"): body for key, body in FOLDER_OBJECTS.items()
    }  # Not vit-hub-old/, beside it.
    operations: list[str] = []
    aws["s3"].meta.events.register(
        "before-call.s3.*", lambda model, **_: operations.append(model.name)
    )
    again = start(aws, load_spec(path), force=True)
    assert again.init is not None and again.init.copied == ()
    assert again.pointer.init_uri == pointer.init_uri
    assert operations.count("HeadObject") == len(FOLDER_OBJECTS)  # each found, with its size
    assert WRITES.isdisjoint(operations) and "PutObject" not in operations
    assert staged_init(again.pointer, load_spec(path)) == f"s3://ckpt/{folder}"


def test_a_changed_source_is_copied_to_a_new_folder(
    aws: dict[str, Any],  # noqa: F811
    source: Any,
    tmp_path: Path,
) -> None:
    spec = load_spec(spec_with(tmp_path, FILE_INIT))
    first = start(aws, spec).pointer.init_uri
    source.put_object(Bucket=SOURCE, Key="vit/model.safetensors", Body=b"retrained")
    second = start(aws, spec, force=True).pointer.init_uri
    folder = staged_folder(source, FILE_INIT, list(FILE_OBJECTS))
    assert second == f"s3://ckpt/{folder}model.safetensors" != first
    assert objects(aws["s3"], "ckpt", folder)[f"{folder}model.safetensors"] == b"retrained"


def test_a_source_the_user_cannot_read_stops_the_start_before_anything_changes(
    aws: dict[str, Any],  # noqa: F811
    source: Any,
    tmp_path: Path,
) -> None:
    spec = load_spec(spec_with(tmp_path, FILE_INIT))
    before = (read_job_pointer(aws["ssm"], NAME), sizes(aws["asg"]))

    def start_as(credentials: dict[str, str]) -> None:
        clients = {
            s: boto3.client(s, region_name=REGION, **credentials)  # type: ignore[call-overload]
            for s in ("ssm", "autoscaling", "s3")
        }
        with pytest.raises(JobStartError) as refused:
            start_job(
                spec, ssm=clients["ssm"], autoscaling=clients["autoscaling"], s3=clients["s3"],
                now=NOW, token="ab12",
            )  # fmt: skip
        assert str(refused.value) == (
            f"job.model.init: your credentials cannot read {FILE_INIT} (An error occurred "
            "(AccessDenied) when calling the HeadObject operation: Access Denied); the job is "
            "started with a copy in the checkpoint bucket, made with them: allow them "
            "s3:GetObject on its objects and s3:ListBucket on its bucket (S3 also answers 403 for "
            "a missing object to credentials that may not list the bucket), or check the URI"
        )

    as_user_denied_source(start_as)
    assert (read_job_pointer(aws["ssm"], NAME), sizes(aws["asg"])) == before
    assert objects(aws["s3"], "ckpt", "checkpoints/init/") == {}


@pytest.mark.parametrize(
    ("init", "message"),
    [
        (
            f"s3://{SOURCE}/vit/missing.safetensors",
            f"job.model.init: no object at s3://{SOURCE}/vit/missing.safetensors; check the "
            f"bucket and key (aws s3 ls s3://{SOURCE}/vit/) and fix job.model.init",
        ),
        (
            f"s3://{SOURCE}/nothing-here/",
            f"job.model.init: no object under s3://{SOURCE}/nothing-here/; check the folder "
            f"(aws s3 ls s3://{SOURCE}/nothing-here/) and fix job.model.init",
        ),
        (
            f"s3://{SOURCE}/other/",
            f"job.model.init: s3://{SOURCE}/other/ has neither model.safetensors nor "
            "pytorch_model.bin at its top, so it is no hub-form folder; point job.model.init at "
            "the folder that holds them, or at the weights file itself",
        ),
        (
            "s3://no-such-bucket/weights/",
            "job.model.init: no bucket for s3://no-such-bucket/weights/ (An error occurred "
            "(NoSuchBucket) when calling the ListObjectsV2 operation: The specified bucket does "
            "not exist); fix job.model.init",
        ),
    ],
)
def test_a_missing_source_stops_the_start_before_anything_changes(
    aws: dict[str, Any],  # noqa: F811
    source: Any,
    tmp_path: Path,
    init: str,
    message: str,
) -> None:
    before = (read_job_pointer(aws["ssm"], NAME), sizes(aws["asg"]))
    with pytest.raises(JobStartError) as refused:
        start(aws, load_spec(spec_with(tmp_path, init)))
    assert str(refused.value) == message
    assert (read_job_pointer(aws["ssm"], NAME), sizes(aws["asg"])) == before
    assert objects(aws["s3"], "ckpt", "checkpoints/init/") == {}


def test_a_folder_beyond_the_bounds_is_refused(
    aws: dict[str, Any],  # noqa: F811
    source: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(s3_init, "MAX_OBJECTS", 3)
    with pytest.raises(JobStartError) as refused:
        start(aws, load_spec(spec_with(tmp_path, FOLDER_INIT)))
    assert str(refused.value) == (
        f"job.model.init: {FOLDER_INIT} holds 4 object(s), 6.3 MB: more than a model's folder "
        "(at most 3 objects and 100.0 GB are copied into the checkpoint bucket); point "
        "job.model.init at the hub-form folder (config.json + model.safetensors) or at the "
        "weights file itself"
    )
    assert objects(aws["s3"], "ckpt", "checkpoints/init/") == {}


def test_an_init_under_the_checkpoint_prefix_is_read_where_it_is(
    aws: dict[str, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    init = "s3://ckpt/checkpoints/weights/model.safetensors"
    aws["s3"].put_object(Bucket="ckpt", Key="checkpoints/weights/model.safetensors", Body=b"w")
    started = start(aws, load_spec(spec_with(tmp_path, init)))
    assert started.init is None
    assert (started.pointer.init, started.pointer.init_uri) == (None, None)
    assert objects(aws["s3"], "ckpt", "checkpoints/init/") == {}


def test_spec_check_says_the_init_will_be_copied_when_the_job_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """spec check asks AWS nothing: it says what the commands that start a job will do."""
    assert main(["spec", "check", "--spec", str(spec_with(tmp_path, FILE_INIT))]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert (
        f"job.model.init {FILE_INIT} will be copied to <checkpoint prefix>/init/<sha256>/ when "
        "the job starts (hetero job start, hetero sagemaker submit: read with HeadObject, or "
        "ListObjectsV2 for a folder, then copied server-side with your credentials, once per "
        "version of it; an init under the checkpoint prefix is read where it is), and the job "
        "reads that copy; the job cdk deploy starts reads it where it is (the stack grants the "
        "instance role s3:GetObject on its folder)"
    ) in out
