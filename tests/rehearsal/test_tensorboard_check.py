"""The rehearsal's TensorBoard check (``cli_run.assert_tensorboard_once_per_step``) on event files
written here as two trainer generations write them (``TensorBoardLog``, the second resumed from
the checkpoint of step 8 after the first logged up to step 10), one folder per job as the
rehearsal downloads it from S3: it passes them, and fails a repeated step in any scalar, a step
missing from a scalar of every step, and a tag that specs/rehearsal.toml makes but is absent."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import pytest
from torch.utils.tensorboard import SummaryWriter

from training.trainer.tensorboard_log import TensorBoardLog

from .cli_run import STEPS, assert_tensorboard_once_per_step

EVALUATIONS = (8, 16, 24)
"""specs/rehearsal.toml's ``job.eval.every_steps`` = 8 over its 24 steps."""


def interval(step: int, left_out: Collection[str]) -> dict[str, Any]:
    """An interval record as a CPU rank 0 of specs/rehearsal.toml logs it, without
    ``left_out``."""
    record = {
        "step": step, "loss": 2.0 / step, "lr": 1e-3, "grad_norm": 1.5, "grad_norm_max": 2.0,
        "nonfinite_steps": 0, "samples_per_s": 100.0, "step_time_s": 0.3,
        "data_wait_share": 0.1, "samples_per_usd": 3e5, "unreadable_samples": 0,
        "checkpoint_age_s": 2.0 if step > 4 else None, "mfu": None, "gpu_util_pct": None,
    }  # fmt: skip
    return {k: v for k, v in record.items() if k not in left_out}


def evaluation(step: int, left_out: Collection[str]) -> dict[str, Any]:
    record = {
        "step": step, "top1": 0.5, "top5": 0.9, "val_loss": 1.5, "usd": 0.01 * step,
        "ema_top1": 0.4, "ema_top5": 0.8, "ema_val_loss": 1.7,
    }  # fmt: skip
    return {k: v for k, v in record.items() if k not in left_out}


def generation(
    job: Path, index: int, resumed_at: int, last: int, left_out: Collection[str] = ()
) -> None:
    """One generation's rank 0 logs from ``resumed_at`` + 1 to ``last``; its event file lands in
    ``job`` named after ``index`` (later hosts' files sort after earlier ones, as in S3)."""
    run_dir = job.parents[1] / "hosts" / str(index)
    tb = TensorBoardLog(run_dir)
    tb.start(resumed_at)
    for step in range(resumed_at + 1, last + 1):
        tb.train(interval(step, left_out))
        if step in EVALUATIONS:
            tb.validation(evaluation(step, left_out), targets_reached=[])
    tb.close()
    (written,) = (run_dir / "tensorboard").glob("events.out.tfevents.*")
    written.rename(job / f"events.out.tfevents.{1_800_000_000 + index}.host-{index}")


def downloaded(out: Path, left_out: Collection[str] = ()) -> Path:
    """``out`` as the rehearsal leaves it: its job's event files, two generations'."""
    job = out / "tensorboard" / "j-20261129T101500-ab12"
    job.mkdir(parents=True)
    generation(job, 1, resumed_at=0, last=10)
    generation(job, 2, resumed_at=8, last=STEPS, left_out=left_out)
    return job


def test_two_generations_each_scalar_once_per_step_pass(tmp_path: Path) -> None:
    downloaded(tmp_path)
    assert_tensorboard_once_per_step(tmp_path)


@pytest.mark.parametrize(
    ("tag", "step"),
    [("train/grad_norm", 12), ("train/checkpoint_age_s", 20), ("val/ema_top1", 16)],
)
def test_a_step_written_twice_to_any_scalar_fails(tmp_path: Path, tag: str, step: int) -> None:
    """A writer that did not purge (no ``purge_step``) logged ``step`` of ``tag`` again."""
    job = downloaded(tmp_path)
    again = SummaryWriter(str(tmp_path / "hosts" / "3"))
    again.add_scalar(tag, 1.0, step)
    again.close()
    (written,) = (tmp_path / "hosts" / "3").glob("events.out.tfevents.*")
    written.rename(job / "events.out.tfevents.1800000003.host-3")
    with pytest.raises(AssertionError, match=tag):
        assert_tensorboard_once_per_step(tmp_path)


def test_a_step_missing_from_a_scalar_of_every_step_fails(tmp_path: Path) -> None:
    """The second generation never logs ``samples_per_usd``: the first's steps 1 to 8 only."""
    downloaded(tmp_path, left_out={"samples_per_usd"})
    with pytest.raises(AssertionError, match=r"train/samples_per_usd.*\[1, 2, 3, 4, 5, 6, 7, 8\]"):
        assert_tensorboard_once_per_step(tmp_path)


@pytest.mark.parametrize("left_out", ["unreadable_samples", "ema_val_loss", "checkpoint_age_s"])
def test_a_tag_the_spec_makes_that_is_missing_fails(tmp_path: Path, left_out: str) -> None:
    job = tmp_path / "tensorboard" / "j-1"
    job.mkdir(parents=True)
    generation(job, 1, resumed_at=0, last=STEPS, left_out={left_out})
    with pytest.raises(AssertionError, match=rf"no \['(train|val)/{left_out}'\]"):
        assert_tensorboard_once_per_step(tmp_path)
