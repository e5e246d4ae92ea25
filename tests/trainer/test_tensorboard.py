"""The trainer's TensorBoard event files, read back with TensorBoard's own reader
(``EventAccumulator``): every scalar the run measures under its tag, once per logged step, also
across a rollback (a resumed run purges what an earlier one logged from its first step on), the
spec and the run as text, the first batch's inputs as images; and their upload to S3 (moto), at
most once per change."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from training.common.tensorboard_paths import every_job_uri, tensorboard_uri
from training.spec import load_spec
from training.trainer.config import TrainerConfig
from training.trainer.tensorboard_log import TensorBoardLog

from .conftest import train_to_end, write_spec

TRAIN = ("loss", "lr", "grad_norm", "grad_norm_max", "nonfinite_steps", "samples_per_s",
         "step_time_s", "data_wait_share")  # fmt: skip


def events(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


def steps(acc: EventAccumulator, tag: str) -> list[int]:
    return [e.step for e in acc.Scalars(tag)]


def run(spec: Path, run_dir: Path, total: int) -> Any:
    config = TrainerConfig.from_spec(load_spec(spec), run_dir=run_dir, steps=total, synthetic=True)
    return train_to_end(config)


def test_a_run_writes_every_scalar_each_step_with_the_spec_and_its_inputs(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, steps=3, batch_size=4)
    trainer = run(spec, tmp_path / "run", 3)
    acc = events(tmp_path / "run")
    tags = acc.Tags()
    for name in TRAIN:
        assert steps(acc, f"train/{name}") == [1, 2, 3], name
    loss = [e.value for e in acc.Scalars("train/loss")]
    assert loss == pytest.approx([r["loss"] for r in trainer.metrics.records])
    assert set(tags["tensors"]) >= {"spec/text_summary", "run/text_summary"}
    assert tags["images"] == ["inputs/augmented"]
    (image,) = acc.Images("inputs/augmented")
    # The first batch's four 32 px images, tiled in one row.
    assert image.step == 1 and (image.width, image.height) == (4 * 32, 32)


def test_a_resumed_run_continues_the_curves_with_no_gap_and_no_repeat(tmp_path: Path) -> None:
    """Five steps logged, the last durable checkpoint at step 4 (step 5's is lost): the resumed
    run logs 5 to 7 again, and each step has one value, the resumed run's."""
    spec = write_spec(tmp_path, interval=2, batch_size=4)
    run(spec, tmp_path / "run", 5)
    shutil.rmtree(tmp_path / "checkpoints" / "step-5")  # the generation's last save lost
    second = run(spec, tmp_path / "run", 7)
    assert second.summary["start_step"] == 4
    acc = events(tmp_path / "run")
    assert len(list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert steps(acc, "train/loss") == [1, 2, 3, 4, 5, 6, 7]
    resumed = {r["step"]: r["loss"] for r in second.metrics.records}
    logged = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert logged[5] == pytest.approx(resumed[5])


def test_the_job_folder_of_an_s3_checkpoint_uri() -> None:
    assert tensorboard_uri("s3://ckpt/checkpoints/j-1/") == "s3://ckpt/checkpoints/tensorboard/j-1/"
    assert every_job_uri("s3://ckpt/checkpoints/j-1/") == "s3://ckpt/checkpoints/tensorboard/"
    assert (
        tensorboard_uri("s3://ckpt/checkpoints/sagemaker/vit-1")
        == "s3://ckpt/checkpoints/sagemaker/tensorboard/vit-1/"
    )


def test_event_files_are_uploaded_when_they_change(tmp_path: Path, mock_s3: Any) -> None:
    """Uploaded by the thread as soon as a checkpoint is durable (not an hour later), again only
    once changed, and at close."""
    mock_s3.create_bucket(Bucket="ckpt")
    uri = "s3://ckpt/checkpoints/tensorboard/j-1/"
    tb = TensorBoardLog(tmp_path, upload_uri=uri, s3_client=lambda: mock_s3, every_s=3600)
    tb.start(0)
    tb.train({"step": 1, "loss": 2.0, "lr": 0.1})
    tb.checkpointed(1)
    deadline = time.monotonic() + 10
    while "Contents" not in mock_s3.list_objects_v2(Bucket="ckpt") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "Contents" in mock_s3.list_objects_v2(Bucket="ckpt")
    assert tb.upload() == 0  # unchanged: not sent again
    tb.train({"step": 2, "loss": 1.5, "lr": 0.1})
    tb.close()  # flushes, and uploads what changed
    listed = mock_s3.list_objects_v2(Bucket="ckpt", Prefix="checkpoints/tensorboard/j-1/")
    (key,) = [o["Key"] for o in listed["Contents"]]
    local = next((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert key == f"checkpoints/tensorboard/j-1/{local.name}"
    body = mock_s3.get_object(Bucket="ckpt", Key=key)["Body"].read()
    assert body == local.read_bytes()


def test_a_run_that_starts_over_replaces_the_curves_of_one_that_crashed_first(
    tmp_path: Path,
) -> None:
    """A generation crashed before its first checkpoint: the next starts from step 0, and its
    steps replace the earlier ones (purge from step 1)."""
    spec = write_spec(tmp_path, interval=100, batch_size=4)
    run(spec, tmp_path / "run", 2)
    shutil.rmtree(tmp_path / "checkpoints")  # nothing durable: the next run starts over
    second = run(spec, tmp_path / "run", 3)
    assert second.summary["start_step"] == 0
    acc = events(tmp_path / "run")
    assert steps(acc, "train/loss") == [1, 2, 3]
    logged = [e.value for e in acc.Scalars("train/loss")]
    assert logged == pytest.approx([r["loss"] for r in second.metrics.records])
