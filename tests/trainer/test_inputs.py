"""Inputs: deterministic synthetic batches, disjoint rank shares, resumable positions."""

from __future__ import annotations

import pytest
import torch

from training.trainer.inputs import SyntheticBatches
from training.trainer.stream import EndOfData, rank_positions


def make(rank: int = 0, world: int = 1, batch: int = 4, epochs: int | None = None):
    return SyntheticBatches(
        num_samples=64, num_classes=10, image_size=16, batch_size=batch, seed=3,
        rank=rank, world_size=world, epochs=epochs, pool_size=16,
    )  # fmt: skip


def test_batches_are_valid_and_deterministic() -> None:
    a, b = make(), make()
    for _ in range(3):
        x, y = a.next(), b.next()
        assert x.images.dtype == torch.uint8 and tuple(x.images.shape) == (4, 3, 16, 16)
        assert torch.equal(x.images, y.images) and torch.equal(x.sample_ids, y.sample_ids)
        assert torch.equal(x.labels, x.sample_ids % 10)


def test_ranks_split_the_global_batch_of_a_single_process() -> None:
    single = make(batch=8)
    ranks = [make(rank=r, world=2, batch=4) for r in range(2)]
    for _ in range(8):  # One whole epoch of 64 samples.
        whole = single.next()
        parts = [r.next() for r in ranks]
        assert set(whole.sample_ids.tolist()) == {i for p in parts for i in p.sample_ids.tolist()}
    assert set(parts[0].sample_ids.tolist()).isdisjoint(parts[1].sample_ids.tolist())


def test_epochs_end_and_reshuffle() -> None:
    s = make(batch=32, epochs=2)
    first = torch.cat([s.next().sample_ids for _ in range(2)])
    second = torch.cat([s.next().sample_ids for _ in range(2)])
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(64))
    assert not torch.equal(first, second)
    with pytest.raises(EndOfData):
        s.next()


def test_state_dict_resumes_at_the_same_batch() -> None:
    s = make()
    for _ in range(5):
        s.next()
    state = s.state_dict()
    expected = s.next()
    t = make()
    t.load_state_dict(state)
    assert torch.equal(t.next().sample_ids, expected.sample_ids)


def test_uneven_epochs_give_every_rank_the_same_batch_count() -> None:
    counts = {rank_positions(70, r, 3, 4)[0] for r in range(3)}
    assert counts == {5}
    with pytest.raises(ValueError, match=r"job\.dataset\.num_samples"):
        rank_positions(7, 0, 2, 4)
