"""S3 checkpoint sync (moto): complete folders go up marker last, the newest comes back down,
cut-off saves are never shipped, pruned folders leave S3."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws

from training.launcher.checkpoint_sync import (
    CheckpointUploader,
    download_latest,
    parse_s3_uri,
    upload_complete,
)

URI = "s3://ckpt-bucket/checkpoints/vit-test/"


@pytest.fixture
def s3() -> Iterator[Any]:
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket="ckpt-bucket")
        yield client


def save(local: Path, step: int, complete: bool = True) -> None:
    folder = local / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(bytes([step]) * 100)
    (folder / ".metadata").write_text(f"step {step}")
    if complete:
        (folder / "COMPLETE").write_text("")


def keys(s3: Any) -> list[str]:
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket="ckpt-bucket").get("Contents", []))


def test_parse_s3_uri() -> None:
    assert parse_s3_uri(URI) == ("ckpt-bucket", "checkpoints/vit-test/")
    assert parse_s3_uri("s3://b") == ("b", "")
    with pytest.raises(ValueError, match="not an s3"):
        parse_s3_uri("/opt/ml/checkpoints")


def test_round_trip_and_pruning(s3: Any, tmp_path: Path) -> None:
    trainer_dir = tmp_path / "trainer"
    save(trainer_dir, 100)
    save(trainer_dir, 200, complete=False)  # cut off by the Spot reclaim: never uploaded
    assert upload_complete(s3, trainer_dir, URI) == [100]
    assert upload_complete(s3, trainer_dir, URI) == []  # already there
    assert keys(s3) == [
        "checkpoints/vit-test/step-100/.metadata",
        "checkpoints/vit-test/step-100/COMPLETE",
        "checkpoints/vit-test/step-100/__0_0.distcp",
    ]
    # The trainer finishes step 200's save and prunes step 100.
    (trainer_dir / "step-200" / "COMPLETE").write_text("")
    for p in (trainer_dir / "step-100").iterdir():
        p.unlink()
    (trainer_dir / "step-100").rmdir()
    assert upload_complete(s3, trainer_dir, URI) == [200]
    assert all("step-200" in k for k in keys(s3))

    replacement = tmp_path / "replacement"
    restored = download_latest(s3, URI, replacement)
    assert restored == replacement / "step-200"
    assert (restored / "COMPLETE").is_file()
    assert (restored / "__0_0.distcp").read_bytes() == bytes([200]) * 100


def test_fresh_start_downloads_nothing(s3: Any, tmp_path: Path) -> None:
    assert download_latest(s3, URI, tmp_path / "x") is None


def test_uploader_makes_a_last_upload_on_stop(s3: Any, tmp_path: Path) -> None:
    uploader = CheckpointUploader(s3, tmp_path, URI, interval_s=60)
    uploader.start()
    save(tmp_path, 7)  # the save made on SIGTERM, after the last periodic round
    uploader.stop()
    assert "checkpoints/vit-test/step-7/COMPLETE" in keys(s3)
