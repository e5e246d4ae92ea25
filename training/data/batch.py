"""The batch the trainer consumes, from the data plane or from a local DataLoader."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Unreadable:
    """A sample that could not be read or decoded, so its batch went without it."""

    sample: int
    """Its index in the split the batch came from (as ``Batch.sample_ids``)."""
    name: str
    """Where it is, as a person finds it: a file's path (bytes that are not UTF-8 shown
    escaped), an ``s3://`` URI, a prepared shard's ``<shard>[<n>]``, ``synthetic:<i>``."""
    reason: str
    """Why: the read's or the decoder's error."""


@dataclass(frozen=True)
class Batch:
    """Augmented images ready for the trainer's device.

    ``images`` is uint8 NCHW RGB, not normalised (normalisation happens on the device);
    ``labels`` and ``sample_ids`` (dataset indices) are int64 [N]. Tensors from the data plane
    share memory with the received message: treat them as read-only (``.to(device)``/``.float()``
    make new tensors).
    """

    images: torch.Tensor
    labels: torch.Tensor
    sample_ids: torch.Tensor
    skipped: tuple[Unreadable, ...] = ()
    """The samples of this batch's range that could not be read (not in ``sample_ids``)."""

    def __post_init__(self) -> None:
        n = self.images.shape[0]
        if self.images.dtype != torch.uint8 or self.images.dim() != 4 or self.images.shape[1] != 3:
            raise ValueError(
                f"Batch.images must be uint8 [N,3,H,W], got {self.images.dtype} "
                f"{tuple(self.images.shape)}"
            )
        for name, t in (("labels", self.labels), ("sample_ids", self.sample_ids)):
            if t.dtype != torch.int64 or tuple(t.shape) != (n,):
                raise ValueError(
                    f"Batch.{name} must be int64 [{n}], got {t.dtype} {tuple(t.shape)}"
                )

    def __len__(self) -> int:
        return int(self.images.shape[0])
