"""Validation: top-1, top-5 and cross-entropy over the whole validation set, each sample once.

Every rank evaluates its own block of the validation set (``eval_data.eval_shard``) and the
sums are all-reduced, so the figures are over the whole set whatever the rank count. Under
FSDP the forward pass gathers parameters collectively, so every rank runs the same number of
forward passes (ranks out of samples run a blank image that counts for nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from training.data.batch import Batch
from training.trainer.stream import to_device


@dataclass(frozen=True)
class Scores:
    """What one pass over the validation set measured."""

    top1: float
    top5: float
    loss: float
    """Mean cross-entropy (no label smoothing)."""
    samples: int
    """Validation samples scored (unreadable ones are skipped by the data path)."""


class EvaluationInterrupted(Exception):
    """A rank was asked to stop while it waited for validation data: no rank reports the pass
    (every rank still took part in the reduction, so none is left waiting in it)."""


def _padded(batches: Iterable[Batch], passes: int, blank: Batch) -> Iterator[Batch]:
    it = iter(batches)
    for _ in range(passes):
        yield next(it, blank)
    leftover = next(it, None)
    if leftover is not None:
        raise RuntimeError("validation gave this rank more batches than its share")


def _until_interrupted(
    batches: Iterable[Batch], kinds: tuple[type[BaseException], ...], sums: torch.Tensor
) -> Iterator[Batch]:
    try:
        yield from batches
    except kinds:
        sums[4] += 1


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[Batch],
    *,
    passes: int,
    normalise: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
    autocast: bool,
    image_size: int,
    group: dist.ProcessGroup | None = None,
    interrupted_by: tuple[type[BaseException], ...] = (),
) -> Scores:
    """Score ``model`` (in eval mode, restored to its mode after) on this rank's ``batches``;
    ``passes`` is the most batches any rank has (FSDP needs the same count everywhere). Runs on
    every rank; the result is the same on all. Leaves the global random generators as they
    were (a resumed run that skips an evaluation makes the same random draws). An exception of
    ``interrupted_by`` from ``batches`` (a stop request ended a wait for data) ends this rank's
    pass; every rank then raises ``EvaluationInterrupted`` after the reduction."""
    lockstep = isinstance(model, FSDPModule)
    blank = Batch(
        images=torch.zeros((1, 3, image_size, image_size), dtype=torch.uint8),
        labels=torch.zeros(1, dtype=torch.int64),
        sample_ids=torch.full((1,), -1, dtype=torch.int64),
    )
    # top1, top5, loss, count, ranks interrupted
    sums = torch.zeros(5, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            # An interrupted rank stops reading; under FSDP it still runs its blank passes.
            source: Iterable[Batch] = _until_interrupted(batches, interrupted_by, sums)
            if lockstep:
                source = _padded(source, passes, blank)
            for batch in source:
                if batch is blank or len(batch) == 0:
                    if lockstep:
                        model(normalise(blank.images))
                    continue
                images = normalise(batch.images)
                labels = to_device(batch.labels, device)
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    logits = model(images)
                logits = logits.float()
                k = min(5, logits.shape[1])
                top = logits.topk(k, dim=1).indices
                hits = top.eq(labels.view(-1, 1))
                sums[0] += hits[:, 0].sum()
                sums[1] += hits.any(dim=1).sum()
                sums[2] += F.cross_entropy(logits, labels, reduction="sum").double()
                sums[3] += len(labels)
    finally:
        model.train(was_training)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
    top1, top5, loss, count, interrupted = sums.tolist()
    if interrupted:
        raise EvaluationInterrupted(f"{int(interrupted)} rank(s) stopped during validation")
    if count == 0:
        return Scores(top1=0.0, top5=0.0, loss=float("nan"), samples=0)
    return Scores(top1=top1 / count, top5=top5 / count, loss=loss / count, samples=int(count))
