"""What the sample logs say about a rehearsal: samples lost or repeated per epoch, steps redone,
steps missing, and how long each interruption took to recover.

Reconciliation: for each (step, rank) the LAST record wins (a step redone after a rollback to a
checkpoint replaces the lost application of it). Then, per epoch and over all ranks, ``lost`` is
the planned sample ids never seen and ``repeated`` the ids seen more than once.

The planned set of an epoch follows ``training.data.order``: the epoch's order is
``epoch_order(seed, epoch, num_samples)``; each of the W ranks takes ``per_rank = (N // W) //
batch_size`` full batches, so a whole epoch covers positions ``[0, W * per_rank * batch_size)``
of the order (the rest is cut so every rank gets the same batch count). With the data plane, rank
r's share is the block ``[r * P, (r + 1) * P)`` (P = per_rank * batch_size); with the local
loader it is positions ``r, r + W, ...``. An epoch the job stopped in (the last one) is planned
only as far as its steps went.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from training.rehearsal.samples import SampleRecord
from training.spec import ClusterSpec

_EXAMPLES = 10
_RESUMED_RE = re.compile(
    # training/trainer/checkpoint.py logs "resumed from PATH (step N) in Ss"; the trainer's log
    # format (training/trainer/__main__.py) starts each line "ASCTIME LEVEL [rank R] LOGGER: ".
    r"(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) \w+ \[rank 0\] "
    r"training\.trainer\.checkpoint: resumed from (?P<path>\S+) \(step (?P<step>\d+)\)"
)


class Layout(StrEnum):
    BLOCK = "block"
    """Data plane: each rank a contiguous block of the epoch's positions."""
    STRIDED = "strided"
    """Local loader: rank r takes positions r, r + W, r + 2W, ..."""


def layout_for(spec: ClusterSpec) -> Layout:
    """The data plane serves the trainer whenever the spec has dataprep groups."""
    return Layout.BLOCK if spec.dataprep_groups else Layout.STRIDED


def last_wins(records: Iterable[SampleRecord]) -> dict[tuple[int, int], SampleRecord]:
    """(step, rank) -> the record applied last (records in their files' append order)."""
    out: dict[tuple[int, int], SampleRecord] = {}
    for r in sorted(records, key=lambda r: (r.rank, r.order)):
        out[(r.step, r.rank)] = r
    return out


def planned_positions(
    *, num_samples: int, world_size: int, batch_size: int, batches: int, layout: Layout
) -> range | list[int]:
    """Epoch positions the ranks take in their first ``batches`` batches each."""
    per_rank = (num_samples // world_size) // batch_size
    b = max(0, min(batches, per_rank))
    if layout is Layout.STRIDED:
        return range(0, world_size * b * batch_size)
    block = per_rank * batch_size
    return [p for r in range(world_size) for p in range(r * block, r * block + b * batch_size)]


@dataclass
class EpochAudit:
    epoch: int
    world_size: int
    batches_per_rank: int
    planned: int
    seen: int
    """Distinct planned-or-not ids seen."""
    lost: int
    repeated: int
    """Distinct ids seen more than once."""
    unplanned: int = 0
    """Ids seen that the plan does not hold (another layout, a wrong epoch tag)."""
    lost_examples: list[int] = field(default_factory=list)
    repeated_examples: list[int] = field(default_factory=list)

    @property
    def exactly_once(self) -> bool:
        return self.lost == 0 and self.repeated == 0 and self.unplanned == 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def audit_samples(
    records: Sequence[SampleRecord],
    *,
    num_samples: int,
    batch_size: int,
    seed: int,
    layout: Layout,
    grad_accum_steps: int = 1,
    order: Callable[[int], Any] | None = None,
) -> list[EpochAudit]:
    """One ``EpochAudit`` per epoch that has records (see the module docstring). ``order``
    gives an epoch's order when it is not ``epoch_order(seed, epoch, num_samples)`` (a sharded
    source: ``training.data.order.order_for``)."""
    from training.data.order import epoch_order  # torch: only when auditing

    final = last_wins(records)
    by_epoch: dict[int, list[SampleRecord]] = defaultdict(list)
    for r in final.values():
        by_epoch[r.epoch].append(r)
    audits: list[EpochAudit] = []
    previous_last_step = 0
    for epoch in sorted(by_epoch):
        recs = by_epoch[epoch]
        world = Counter(r.world_size for r in recs).most_common(1)[0][0]
        last_step = max(r.step for r in recs)
        # Steps between the previous epoch's last and this one's: a step nobody logged still
        # counts as planned, so its samples show up as lost rather than vanish from the plan.
        batches = (last_step - previous_last_step) * grad_accum_steps
        previous_last_step = last_step
        permutation = order(epoch) if order else epoch_order(seed, epoch, num_samples)
        positions = planned_positions(
            num_samples=num_samples,
            world_size=world,
            batch_size=batch_size,
            batches=batches,
            layout=layout,
        )
        planned = {int(permutation[p]) for p in positions}
        counts = Counter(i for r in recs for i in r.sample_ids)
        lost = sorted(planned - counts.keys())
        repeated = sorted(i for i, n in counts.items() if n > 1)
        unplanned = sorted(counts.keys() - planned)
        audits.append(
            EpochAudit(
                epoch=epoch,
                world_size=world,
                batches_per_rank=min(batches, (num_samples // world) // batch_size),
                planned=len(planned),
                seen=len(counts),
                lost=len(lost),
                repeated=len(repeated),
                unplanned=len(unplanned),
                lost_examples=lost[:_EXAMPLES],
                repeated_examples=repeated[:_EXAMPLES],
            )
        )
    return audits


def final_step(records: Iterable[SampleRecord]) -> int:
    return max((r.step for r in records), default=0)


def steps_redone(records: Iterable[SampleRecord]) -> int:
    """Applications of a step beyond its first (a rollback to a checkpoint redoes the steps
    after it): per step, the most times any one rank applied it, minus one, summed."""
    per_rank: Counter[tuple[int, int]] = Counter((r.step, r.rank) for r in records)
    most: dict[int, int] = {}
    for (step, _rank), n in per_rank.items():
        most[step] = max(most.get(step, 0), n)
    return sum(n - 1 for n in most.values())


def steps_missing(records: Sequence[SampleRecord]) -> list[int]:
    """Steps up to the last one that some rank of that step never logged."""
    final = last_wins(records)
    ranks_by_step: dict[int, set[int]] = defaultdict(set)
    world_by_step: dict[int, int] = {}
    for (step, rank), r in final.items():
        ranks_by_step[step].add(rank)
        world_by_step[step] = max(world_by_step.get(step, 0), r.world_size)
    return [
        s
        for s in range(1, final_step(records) + 1)
        if len(ranks_by_step.get(s, ())) < world_by_step.get(s, 1)
    ]


def recovery_seconds(
    notice_wall: float, worker_starts_wall: Iterable[float], records: Iterable[SampleRecord]
) -> float | None:
    """Seconds from a notice to the first step applied after the resume: the first record
    written after the first trainer worker that started after the notice (None: no resume)."""
    starts = [s for s in worker_starts_wall if s >= notice_wall]
    if not starts:
        return None
    resumed = min(starts)
    after = [r.time for r in records if r.time >= resumed]
    return min(after) - notice_wall if after else None


def resumes(logs: Iterable[Path]) -> list[dict[str, Any]]:
    """Every resume of the job from a checkpoint, in order: rank 0's "resumed from ... (step N)"
    lines in the instances' launcher logs (one per generation that loaded a checkpoint), each
    ``{"time", "step", "path", "log"}``, sorted by the line's time (ties: log, line order)."""
    found: list[tuple[str, str, int, dict[str, Any]]] = []
    for log_path in logs:
        try:
            text = log_path.read_text(errors="replace")
        except OSError:
            continue
        for n, line in enumerate(text.splitlines()):
            m = _RESUMED_RE.search(line)
            if m:
                entry = {
                    "time": m["time"],
                    "step": int(m["step"]),
                    "path": m["path"],
                    "log": str(log_path),
                }
                found.append((m["time"], str(log_path), n, entry))
    return [entry for *_, entry in sorted(found, key=lambda f: f[:3])]
