"""Where a run's TensorBoard event files are: ``tensorboard/`` in the run folder, and for a job
with its checkpoints in S3, ``<checkpoint prefix>/tensorboard/<job id>/`` beside the jobs'
checkpoint folders (``training.trainer.tensorboard_log`` writes and uploads them), so that one
``tensorboard --logdir`` holds every job of a stack and no checkpoint shard."""

from __future__ import annotations

from pathlib import Path

FOLDER = "tensorboard"


def tensorboard_uri(checkpoint_s3_uri: str) -> str:
    """A job's checkpoint folder ``s3://B/P/<job>/`` -> ``s3://B/P/tensorboard/<job>/``."""
    parent, _, job = checkpoint_s3_uri.rstrip("/").rpartition("/")
    return f"{parent}/{FOLDER}/{job}/"


def every_job_uri(checkpoint_s3_uri: str) -> str:
    """``s3://B/P/<job>/`` -> ``s3://B/P/tensorboard/``: every job's event files."""
    return tensorboard_uri(checkpoint_s3_uri).rstrip("/").rpartition("/")[0] + "/"


def logdir_command(where: str | Path) -> str:
    """The command that shows ``where`` (a run folder's ``tensorboard/``, or an S3 prefix)."""
    return f"tensorboard --logdir {where}"
