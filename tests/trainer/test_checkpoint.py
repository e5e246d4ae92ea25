"""Checkpoints: complete folders only, pruning, and resume of step, weights and data position."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from training.common.steps import MARKER
from training.spec import load_spec
from training.trainer.checkpoint import latest_complete, step_dirs
from training.trainer.config import TrainerConfig
from training.trainer.train import Trainer

from .conftest import train_to_end, write_spec


def make_step(root: Path, step: int, complete: bool) -> Path:
    path = root / f"step-{step}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"x")
    if complete:
        (path / MARKER).write_text("{}")
    return path


def test_a_folder_without_its_marker_is_ignored(tmp_path: Path, caplog) -> None:
    make_step(tmp_path, 2, complete=True)
    make_step(tmp_path, 10, complete=True)
    make_step(tmp_path, 12, complete=False)  # A save cut off half-way.
    (tmp_path / "step-14.partial").mkdir()  # Never renamed into place.
    with caplog.at_level(logging.WARNING):
        assert latest_complete(tmp_path) == (10, tmp_path / "step-10")
    assert "step-12" in caplog.text and MARKER in caplog.text
    assert [s for s, _ in step_dirs(tmp_path)] == [2, 10, 12]


def test_no_checkpoint_folder_means_a_fresh_start(tmp_path: Path) -> None:
    assert latest_complete(tmp_path / "missing") is None


def run_in_process(spec: Path, run_dir: Path, steps: int) -> Trainer:
    config = TrainerConfig.from_spec(load_spec(spec), run_dir=run_dir, steps=steps, synthetic=True)
    return train_to_end(config)


def test_resume_continues_from_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, interval=2, batch_size=4)
    first = run_in_process(spec, tmp_path / "run", steps=5)
    ckpts = tmp_path / "checkpoints"
    # keep = 3: step-2, step-4, and the final step-5.
    assert [s for s, _ in step_dirs(ckpts)] == [2, 4, 5]
    assert all((p / MARKER).is_file() for _, p in step_dirs(ckpts))
    assert first.stream.state_dict() == {"epoch": 0, "batch": 5}

    second = run_in_process(spec, tmp_path / "run", steps=7)
    assert second.restored is not None and second.restored.step == 5
    assert second.summary["start_step"] == 5 and second.summary["steps"] == 7
    # The data position came back too: two more batches after the five already used.
    assert second.stream.state_dict() == {"epoch": 0, "batch": 7}
    assert [s for s, _ in step_dirs(ckpts)] == [5, 6, 7]  # keep = 3


def test_model_and_optimizer_state_are_restored(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, interval=100, batch_size=4)
    trained = run_in_process(spec, tmp_path / "run", steps=3)
    config = TrainerConfig.from_spec(
        load_spec(spec), run_dir=tmp_path / "run2", steps=3, synthetic=True
    )
    fresh = Trainer(config)
    try:
        fresh.resume()
        for (name, a), b in zip(
            trained.model.state_dict().items(), fresh.model.state_dict().values(), strict=True
        ):
            assert torch.equal(a, b), name
        sa, sb = trained.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
        assert sa.keys() == sb.keys() and all(
            torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) for k in sa
        )
        assert fresh.step == 3
    finally:
        fresh.close()
