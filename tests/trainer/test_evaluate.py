"""Validation scoring: top-1, top-5 and loss worked by hand, the global random state left as it
was, and an interrupted pass reported by no rank."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from training.data.batch import Batch
from training.dataplane.client import DataWaitInterrupted
from training.trainer.evaluate import EvaluationInterrupted, evaluate

SIZE = 16


class FixedLogits(nn.Module):
    """Logits looked up by the image's first pixel value (the sample id), and a dropout that
    would draw from the global generator if it ran in training mode."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.table[x[:, 0, 0, 0].round().long()])


def batch(ids: list[int], labels: list[int]) -> Batch:
    images = torch.zeros((len(ids), 3, SIZE, SIZE), dtype=torch.uint8)
    images[:, 0, 0, 0] = torch.tensor(ids, dtype=torch.uint8)
    as_int64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return Batch(images=images, labels=as_int64(labels), sample_ids=as_int64(ids))


def test_scores_are_the_hand_computed_ones_and_the_rng_is_untouched() -> None:
    torch.manual_seed(0)
    table = torch.randn(7, 6)
    labels = [int(table[i].argsort(descending=True)[i % 6]) for i in range(7)]
    # Sample i's label is its logits' (i % 6)-th choice: top-1 for i in {0, 6}, top-5 but
    # not top-1 for i in 1..4, outside the top 5 for i = 5.
    model = FixedLogits(table)
    model.train()
    batches = [batch([0, 1, 2], labels[:3]), batch([], []), batch([3, 4, 5, 6], labels[3:])]
    state = torch.get_rng_state()
    scores = evaluate(
        model, batches, passes=3, normalise=lambda x: x.float(), device=torch.device("cpu"),
        autocast=False, image_size=SIZE,
    )  # fmt: skip
    assert torch.equal(torch.get_rng_state(), state) and model.training
    want_loss = F.cross_entropy(table, torch.tensor(labels)).item()
    assert (scores.top1, scores.top5, scores.samples) == (2 / 7, 6 / 7, 7)
    assert scores.loss == pytest.approx(want_loss, rel=1e-6)


def test_a_stop_during_validation_reports_nothing() -> None:
    def stopped() -> Iterator[Batch]:
        yield batch([0], [0])
        raise DataWaitInterrupted("a stop was requested while waiting for data")

    with pytest.raises(EvaluationInterrupted, match="1 rank"):
        evaluate(
            FixedLogits(torch.randn(2, 3)), stopped(), passes=2, normalise=lambda x: x.float(),
            device=torch.device("cpu"), autocast=False, image_size=SIZE,
            interrupted_by=(DataWaitInterrupted,),
        )  # fmt: skip
