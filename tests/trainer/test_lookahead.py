"""The next step's first batch is taken while the GPU still runs the step in flight
(``training.trainer.lookahead``): the host's read of the step's loss and gradient norm waits for
the GPU, so a batch taken after that read would leave the GPU idle while the host makes it.
Holding the batch must change nothing a checkpoint or the loop sees."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from training.data.batch import Batch
from training.spec import load_spec
from training.trainer import nonfinite
from training.trainer.config import TrainerConfig
from training.trainer.inputs import SyntheticBatches
from training.trainer.lookahead import Lookahead
from training.trainer.stream import DataInterrupted, EndOfData
from training.trainer.train import Trainer

from .conftest import write_spec


class Counted:
    """A ``BatchStream`` of ``per_epoch`` one-sample batches per epoch for ``epochs`` epochs, whose
    sample id is its running number; ``interrupt_at`` raises ``DataInterrupted`` once at that
    number instead of handing it out."""

    def __init__(self, per_epoch: int, epochs: int, interrupt_at: int | None = None) -> None:
        self.per_epoch, self.epochs, self.interrupt_at = per_epoch, epochs, interrupt_at
        self.epoch, self.batch = 0, 0

    def next(self) -> Batch:
        if self.batch == self.per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
        if self.epoch >= self.epochs:
            raise EndOfData
        number = self.epoch * self.per_epoch + self.batch
        if number == self.interrupt_at:
            self.interrupt_at = None
            raise DataInterrupted("stop requested")
        self.batch += 1
        ids = torch.tensor([number])
        return Batch(
            images=torch.zeros((1, 3, 4, 4), dtype=torch.uint8), labels=ids, sample_ids=ids
        )

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.batch = state["epoch"], state["batch"]

    def close(self, *, job_done: bool) -> None:
        pass


def test_a_held_batch_is_handed_out_next_and_invisible_to_the_position_and_epoch() -> None:
    stream = Counted(per_epoch=2, epochs=2)
    inputs = Lookahead(stream)
    assert inputs.next().sample_ids.tolist() == [0]
    assert inputs.next().sample_ids.tolist() == [1]
    before = inputs.state_dict()
    assert before == {"epoch": 0, "batch": 2} and inputs.epoch == 0
    inputs.take_ahead()  # the first batch of epoch 1
    assert stream.epoch == 1 and stream.state_dict() == {"epoch": 1, "batch": 1}
    assert inputs.state_dict() == before and inputs.epoch == 0
    inputs.take_ahead()  # holds one at most: takes nothing more
    assert stream.state_dict() == {"epoch": 1, "batch": 1}
    assert inputs.next().sample_ids.tolist() == [2]
    assert inputs.epoch == 1 and inputs.state_dict() == {"epoch": 1, "batch": 1}
    assert inputs.next().sample_ids.tolist() == [3]
    # The end met while taking ahead is raised by the next() it belongs to, not before.
    inputs.take_ahead()
    assert inputs.state_dict() == {"epoch": 1, "batch": 2}
    with pytest.raises(EndOfData):
        inputs.next()


def test_an_interruption_met_while_taking_ahead_is_raised_by_the_next_call() -> None:
    stream = Counted(per_epoch=4, epochs=1, interrupt_at=1)
    inputs = Lookahead(stream)
    assert inputs.next().sample_ids.tolist() == [0]
    inputs.take_ahead()
    assert inputs.state_dict() == {"epoch": 0, "batch": 1}
    with pytest.raises(DataInterrupted):
        inputs.next()
    # Nothing was consumed by the interrupted wait: the batch comes on the next call.
    assert inputs.next().sample_ids.tolist() == [1]


def test_the_trainer_takes_the_next_batch_before_it_reads_the_step_on_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The order of the loop on a GPU, as the stream and the host read see it: step k+1's batch
    is taken before step k's loss and gradient norm are read (not after), except after the last
    step, where no batch is taken at all."""
    spec = load_spec(write_spec(tmp_path, steps=3, batch_size=4))
    config = TrainerConfig.from_spec(spec, run_dir=tmp_path / "run", synthetic=True, environ={})
    events: list[str] = []
    stream = SyntheticBatches(
        num_samples=64, num_classes=10, image_size=32, batch_size=4, rank=0, world_size=1, seed=0
    )
    taken = stream.next

    def next_batch() -> Batch:
        events.append("batch")
        return taken()

    monkeypatch.setattr(stream, "next", next_batch)
    read = nonfinite.StepNumbers.read

    def read_step(loss: torch.Tensor, grad_norm: torch.Tensor) -> nonfinite.StepNumbers:
        events.append("read")
        return read(loss, grad_norm)

    monkeypatch.setattr(nonfinite.StepNumbers, "read", staticmethod(read_step))
    trainer = Trainer(config, stream=stream)
    assert trainer.take_ahead is False  # on the CPU: the read waits for nothing
    trainer.take_ahead = True  # as on a GPU
    try:
        assert trainer.train() == 0
    finally:
        trainer.close()
    assert events == ["batch", "batch", "read", "batch", "read", "read"]
