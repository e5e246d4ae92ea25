"""The contract of the trainer's inputs (``training.trainer.inputs``, ``training.trainer.remote``)
and how their batches reach the device.

Each input is a ``BatchStream``: ``next()`` returns this rank's next ``Batch``, crossing epoch
boundaries, and raises ``EndOfData`` after the last epoch; ``state_dict()`` is the position
saved in checkpoints. Every rank of a step sees the same number of batches per epoch (the
epoch is cut to what divides evenly), so no rank waits in a collective the others skipped.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from training.data.batch import Batch


class EndOfData(Exception):
    """The configured number of epochs is done."""


class DataInterrupted(Exception):
    """A stop was requested while this rank waited for its next batch (none was consumed)."""


class BatchStream(Protocol):
    epoch: int

    def next(self) -> Batch: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self, *, job_done: bool) -> None: ...


def rank_positions(
    epoch_len: int, rank: int, world_size: int, batch_size: int
) -> tuple[int, range]:
    """Batches per epoch for every rank, and ``rank``'s epoch positions (``rank, rank+world,
    ...``: the layout ``training.data.local_loader`` uses), cut so all ranks get the same
    number of full batches."""
    per_rank = (epoch_len // world_size) // batch_size
    if per_rank < 1:
        raise ValueError(
            f"an epoch of {epoch_len} samples gives no full batch of {batch_size} to each of "
            f"{world_size} ranks; raise job.dataset.num_samples or lower job.batch_size"
        )
    stop = rank + world_size * per_rank * batch_size
    return per_rank, range(rank, stop, world_size)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``. To a GPU the copy goes through page-locked memory, so it is queued
    behind the step in flight and the host goes on: a copy from pageable memory may first wait
    for the GPU to finish its queued work (CUDA's "API synchronization behavior"), which leaves
    the GPU idle while the host then launches the next step. The staging buffer comes from
    torch's caching host allocator, which reuses it only after the copy has completed."""
    if device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
