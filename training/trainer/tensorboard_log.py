"""The run's TensorBoard event files, written by rank 0 with torch's ``SummaryWriter``.

What: every interval record's numbers under ``train/`` (loss, learning rate, gradient norm and
its max, non-finite steps, samples/s, step time, data-wait share, samples per USD, MFU on a GPU,
the data servers serving and the data-tier controller's target, checkpoint age), each param
group's learning rate under ``lr/`` with layer decay, every validation record's under ``val/``
(top-1, top-5 and loss, the EMA's, the USD spent on training so far, the accuracy targets
reached), the spec and the run's layout as text, and a few augmented inputs once (the images as
the data servers sent them, before Mixup).

Where: ``<run dir>/tensorboard/``. With ``upload_uri`` (a job with its checkpoints in S3, on
EC2 and SageMaker: ``training.common.tensorboard_paths.tensorboard_uri``,
``<checkpoint prefix>/tensorboard/<job id>/``), a thread of its own uploads each
event file whole (``PutObject``) when it changed: every ``every_s`` seconds, and when a new
checkpoint is durable, but never twice within ``every_s`` seconds (the cost stays bounded
however often the run checkpoints; a checkpoint inside that window is uploaded when it ends),
and always once more at ``close``. Never inside a step: a failing or slow S3 costs the thread
its upload, which is logged and tried again next time, never a step.
``tensorboard --logdir s3://BUCKET/checkpoints/tensorboard/`` then shows the live run and every
earlier job of the stack side by side (TensorBoard reads S3 through boto3).

Every run starts its writer with ``purge_step`` = the first step it will log (1 from the start):
TensorBoard drops what an earlier generation logged from that step on (steps redone after a
rollback, or after a crash before the first checkpoint), so each scalar has one value per step
across interruptions, with no gap. A host lost without notice (no ``close``) leaves S3's copy
without what it logged after its last upload: the steps after the checkpoint the next
generation resumes from come back when it logs them again; those from that upload up to the
checkpoint stay missing (there are some only when the checkpoint was durable less than
``every_s`` after that upload, or that upload failed).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from training.common.s3 import is_s3_uri, parse_s3_uri
from training.common.tensorboard_paths import FOLDER

log = logging.getLogger(__name__)

UPLOAD_EVERY_S = 60.0
"""The upload period, and the least time between two uploads but the one at ``close``."""
IMAGES_SHOWN = 16
TRAIN_TAGS = (
    "loss", "lr", "grad_norm", "grad_norm_max", "nonfinite_steps", "samples_per_s",
    "step_time_s", "data_wait_share", "samples_per_usd", "mfu", "gpu_util_pct",
    "data_servers", "data_servers_target", "checkpoint_age_s", "unreadable_samples",
)  # fmt: skip
"""The interval record's fields written under ``train/``."""
VAL_TAGS = ("top1", "top5", "val_loss", "ema_top1", "ema_top5", "ema_val_loss", "usd")
"""The validation record's fields written under ``val/``."""


class TensorBoardLog:
    """Rank 0's writer (see the module docstring); ``start(step)`` opens it after the resume."""

    def __init__(
        self,
        run_dir: Path,
        *,
        upload_uri: str | None = None,
        s3_client: Callable[[], Any] | None = None,
        every_s: float = UPLOAD_EVERY_S,
    ) -> None:
        self.folder = run_dir / FOLDER
        self.upload_uri = upload_uri if upload_uri and is_s3_uri(upload_uri) else None
        self._s3_client = s3_client
        self.every_s = every_s
        self._writer: Any = None
        self._uploaded: dict[str, int] = {}
        self._last_upload: float | None = None
        """When (``time.monotonic``) an upload last sent a file; None: never."""
        self._uploading = threading.Lock()
        self._done = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._durable: int | None = None
        self.images_shown = False

    def start(self, step: int) -> None:
        """Open the writer; ``step``: the step the run resumed at (0: from the start, which also
        drops what an earlier generation logged before crashing without a checkpoint)."""
        from torch.utils.tensorboard import SummaryWriter

        self.folder.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(self.folder), purge_step=step + 1, flush_secs=30)
        if self.upload_uri is not None:
            self._thread = threading.Thread(target=self._uploads, name="tensorboard", daemon=True)
            self._thread.start()

    # -- what is written ---------------------------------------------------------------------

    def train(self, record: Mapping[str, Any], lrs: Sequence[float] = ()) -> None:
        """An interval record; ``lrs``: each param group's rate where they run at scales of
        their own (layer decay), each then its own curve."""
        step = int(record["step"])
        self._scalars("train", record, TRAIN_TAGS, step)
        if len(lrs) > 1:
            for i, lr in enumerate(lrs):
                self._scalar(f"lr/group_{i}", lr, step)

    def validation(self, record: Mapping[str, Any], targets_reached: Sequence[float]) -> None:
        step = int(record["step"])
        self._scalars("val", record, VAL_TAGS, step)
        self._scalar("val/targets_reached", float(len(targets_reached)), step)

    def text(self, tag: str, text: str) -> None:
        if self._writer is not None:
            self._writer.add_text(tag, text, 0)

    def inputs(self, images: torch.Tensor, step: int) -> None:
        """A few of the batch's images (uint8 NCHW, as the data servers sent them), once."""
        if self._writer is None or self.images_shown or images.dim() != 4:
            return
        self.images_shown = True
        shown = images[:IMAGES_SHOWN].detach().to("cpu")
        self._writer.add_images("inputs/augmented", shown, step, dataformats="NCHW")

    def _scalars(
        self, prefix: str, record: Mapping[str, Any], tags: Sequence[str], step: int
    ) -> None:
        for tag in tags:
            value = record.get(tag)
            if isinstance(value, int | float) and not isinstance(value, bool):
                self._scalar(f"{prefix}/{tag}", float(value), step)

    def _scalar(self, tag: str, value: float, step: int) -> None:
        if self._writer is not None and math.isfinite(value):
            self._writer.add_scalar(tag, value, step)

    # -- the files ---------------------------------------------------------------------------

    def close(self) -> None:
        """Flush and close the writer, then upload what changed, however recent the last upload
        (bounded by the client's timeouts: a failure is logged, the run's outcome does not
        depend on it)."""
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        self._done.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.upload()

    def checkpointed(self, step: int | None) -> None:
        """The newest durable checkpoint is now ``step``: upload as soon as the last upload is
        ``every_s`` old, so that what was logged up to it is in S3 before a crash could lose it
        (a resume relogs only what follows). Returns at once."""
        if step is not None and step != self._durable:
            self._durable = step
            self._wake.set()

    def _uploads(self) -> None:
        while not self._done.is_set():
            self._wake.wait(self.every_s)  # the period, or a new durable checkpoint
            if self._done.wait(self._too_soon_s()):
                return  # close() uploads the last events
            self._wake.clear()  # the checkpoints that came meanwhile go with this upload
            with contextlib.suppress(Exception):  # a closed writer: close() uploads
                if self._writer is not None:
                    self._writer.flush()
            self.upload()

    def _too_soon_s(self) -> float:
        """Seconds until the last upload is ``every_s`` old (0 without one)."""
        if self._last_upload is None:
            return 0.0
        return max(0.0, self._last_upload + self.every_s - time.monotonic())

    def upload(self) -> int:
        """Upload every event file whose size changed since its last upload, now; how many."""
        if self.upload_uri is None:
            return 0
        bucket, prefix = parse_s3_uri(self.upload_uri)
        sent = 0
        with self._uploading:  # the thread's and close()'s, one at a time
            for path in sorted(self.folder.glob("events.out.tfevents.*")):
                size = path.stat().st_size
                if self._uploaded.get(path.name) == size:
                    continue
                self._last_upload = time.monotonic()
                try:
                    client = self._s3_client() if self._s3_client else _default_client()
                    body = path.read_bytes()
                    client.put_object(Bucket=bucket, Key=prefix + path.name, Body=body)
                except Exception as e:  # S3 unreachable: next time
                    log.warning("TensorBoard events not uploaded to %s: %s", self.upload_uri, e)
                    return sent
                self._uploaded[path.name] = size
                sent += 1
        return sent


def _default_client() -> Any:
    from training.common import aws

    return aws.client("s3")


def run_text(layout: Mapping[str, Any]) -> str:
    """The run's layout as a fenced JSON block (TensorBoard renders text as Markdown)."""
    return "```\n" + json.dumps(layout, indent=2, default=str) + "\n```"
