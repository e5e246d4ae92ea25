"""The sample-log audit on hand-made logs: exact lost/repeated counts, a redone step counted
once, the last epoch planned only as far as it went, recovery time, steps missing."""

from __future__ import annotations

import json
from pathlib import Path

from training.data.order import epoch_order
from training.rehearsal.audit import (
    Layout,
    audit_samples,
    final_step,
    planned_positions,
    recovery_seconds,
    steps_missing,
    steps_redone,
)
from training.rehearsal.samples import StepWatcher, current_step, read_sample_logs

N, BATCH, WORLD, SEED = 16, 2, 2, 7
PER_RANK = (N // WORLD) // BATCH  # 4 batches per rank per epoch: 4 steps per epoch


def ids_for(step: int, rank: int) -> list[int]:
    """What rank ``rank`` applies at ``step`` with the data plane's block layout."""
    epoch, b = divmod(step - 1, PER_RANK)
    order = epoch_order(SEED, epoch, N)
    start = rank * PER_RANK * BATCH + b * BATCH
    return [int(i) for i in order[start : start + BATCH]]


def record(step: int, rank: int, ids: list[int] | None = None, t: float = 0.0) -> dict:
    return {
        "step": step,
        "rank": rank,
        "world_size": WORLD,
        "epoch": (step - 1) // PER_RANK,
        "sample_ids": ids if ids is not None else ids_for(step, rank),
        "time": t or 1000.0 + step,
    }


def write_logs(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for row in rows:
        with open(folder / f"rank-{row['rank']}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    return folder


def audit(folder: Path):  # type: ignore[no-untyped-def]
    return audit_samples(
        read_sample_logs(folder), num_samples=N, batch_size=BATCH, seed=SEED, layout=Layout.BLOCK
    )


def test_a_clean_run_is_exactly_once(tmp_path: Path) -> None:
    rows = [record(s, r) for s in range(1, 9) for r in range(WORLD)]
    epochs = audit(write_logs(tmp_path, rows))
    assert [(e.epoch, e.planned, e.seen, e.lost, e.repeated) for e in epochs] == [
        (0, 16, 16, 0, 0),
        (1, 16, 16, 0, 0),
    ]
    assert all(e.exactly_once for e in epochs)


def test_one_lost_and_one_repeated_id_are_counted_exactly(tmp_path: Path) -> None:
    rows = [record(s, r) for s in range(1, 5) for r in range(WORLD)]
    # Step 2 of rank 1 applied one of rank 0's step-1 samples instead of its own second one.
    stolen = ids_for(1, 0)[0]
    lost = ids_for(2, 1)[1]
    rows[3] = record(2, 1, [ids_for(2, 1)[0], stolen])
    (epoch,) = audit(write_logs(tmp_path, rows))
    assert (epoch.lost, epoch.repeated, epoch.unplanned) == (1, 1, 0)
    assert epoch.lost_examples == [lost] and epoch.repeated_examples == [stolen]
    assert not epoch.exactly_once


def test_a_redone_step_counts_once_and_the_last_application_wins(tmp_path: Path) -> None:
    rows = [record(s, r) for s in range(1, 4) for r in range(WORLD)]
    # Rank 1's first application of step 3 took wrong samples; after a rollback to the
    # checkpoint at step 2, steps 3 and 4 are applied (again) with the right ones.
    rows[5] = record(3, 1, ids_for(1, 1))
    rows += [record(s, r, t=2000.0 + s) for s in (3, 4) for r in range(WORLD)]
    records = read_sample_logs(write_logs(tmp_path, rows))
    (epoch,) = audit(tmp_path)
    assert epoch.exactly_once
    assert steps_redone(records) == 1
    assert final_step(records) == 4
    assert steps_missing(records) == []


def test_the_last_epoch_is_planned_only_as_far_as_it_went(tmp_path: Path) -> None:
    rows = [record(s, r) for s in range(1, 7) for r in range(WORLD)]  # 1.5 epochs
    epochs = audit(write_logs(tmp_path, rows))
    assert [(e.epoch, e.batches_per_rank, e.planned) for e in epochs] == [(0, 4, 16), (1, 2, 8)]
    assert all(e.exactly_once for e in epochs)


def test_a_step_nobody_logged_shows_as_lost_samples_and_a_missing_step(tmp_path: Path) -> None:
    rows = [record(s, r) for s in range(1, 5) for r in range(WORLD) if (s, r) != (2, 0)]
    records = read_sample_logs(write_logs(tmp_path, rows))
    (epoch,) = audit(tmp_path)
    assert (epoch.lost, epoch.repeated) == (BATCH, 0)
    assert steps_missing(records) == [2]


def test_planned_positions_follow_the_layouts() -> None:
    kw = {"num_samples": 10, "world_size": 2, "batch_size": 2}
    # per_rank = (10 // 2) // 2 = 2 batches: 8 of the 10 positions are planned per epoch.
    assert list(planned_positions(batches=2, layout=Layout.BLOCK, **kw)) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert list(planned_positions(batches=1, layout=Layout.BLOCK, **kw)) == [0, 1, 4, 5]
    assert list(planned_positions(batches=1, layout=Layout.STRIDED, **kw)) == [0, 1, 2, 3]
    assert list(planned_positions(batches=9, layout=Layout.STRIDED, **kw)) == list(range(8))


def test_recovery_is_from_the_notice_to_the_first_step_after_the_resume(tmp_path: Path) -> None:
    rows = [record(s, 0, t=100.0 + s) for s in range(1, 6)]  # steps until 105
    rows += [record(s, 0, t=130.0 + s) for s in (5, 6)]  # resumed at 135
    records = read_sample_logs(write_logs(tmp_path, rows))
    # Notice at 103.5; the old trainer went on to step 5; a new worker started at 120.
    assert recovery_seconds(103.5, [50.0, 120.0, 125.0], records) == 135.0 - 103.5
    assert recovery_seconds(103.5, [50.0], records) is None  # never resumed


def test_step_watcher_follows_growing_files(tmp_path: Path) -> None:
    watcher = StepWatcher(tmp_path)
    assert watcher.current_step() == 0
    write_logs(tmp_path, [record(1, 0), record(1, 1)])
    assert watcher.current_step() == 1
    with open(tmp_path / "rank-0.jsonl", "a") as f:
        f.write(json.dumps(record(2, 0)) + "\n" + '{"step": 9, "ra')  # a torn last line
    assert watcher.current_step() == 2
    with open(tmp_path / "rank-0.jsonl", "a") as f:
        f.write('nk": 0}\n')  # completed, but not a record: ignored
    assert watcher.current_step() == 2
    assert current_step(tmp_path) == 2
