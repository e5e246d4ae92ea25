"""The trainer-side data plane client: an iterable of ``Batch`` fed by the data servers that
exist now.

Servers come from a discovery source (``training.dataplane.discovery``) and are admitted,
retried and readmitted by a ``ServerPool`` (``training.dataplane.membership``): a server that
joins mid-epoch gets ranges as soon as it passes its health check. An epoch is planned as a
sequence of batches (``batch_size`` positions each); ranges of up to ``chunk_batches`` of them
go to whichever stream is free, but only within the reorder window: the ``prefetch_batches``
batches from the next one the trainer will consume. The window runs on across an epoch's end
when the caller names the epoch that follows (``iter_epoch(e, then=e + 1)``): the servers make
its first batches while the trainer takes the last of this one, so they do not idle through the
epoch's tail and the trainer does not wait at the next epoch's start (``EpochRun``, in
``training.dataplane.epoch_run``, moves one epoch's batches). Batches are yielded in the planned
order whichever server made them, so with the same seed the trainer sees the same bytes in the
same order with one server, three, or three with one killed mid-epoch. A stream that fails gives its
unreceived batches back, so within an epoch no sample is lost or repeated; the positions the
trainer has consumed (a prefix of its share) are the checkpointable state.
"""

from __future__ import annotations

import bisect
import collections
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from training.data.batch import Batch
from training.data.splits import Split, parse_split
from training.dataplane.discovery import ServerDiscovery, StaticServers
from training.dataplane.epoch_run import (
    DataPlaneError,
    DataPlaneUnavailable,
    DataWaitInterrupted,
    EpochRun,
)
from training.dataplane.membership import ServerPool
from training.dataplane.v1 import dataplane_pb2, dataplane_pb2_grpc

__all__ = [
    "DataPlaneClient",
    "DataPlaneError",
    "DataPlaneUnavailable",
    "DataWaitInterrupted",
    "Intervals",
]

log = logging.getLogger(__name__)

STATE_VERSION = 1


@dataclass
class Intervals:
    """Disjoint, sorted, merged half-open intervals of positions."""

    spans: list[list[int]] = field(default_factory=list)

    def add(self, start: int, stop: int) -> None:
        if stop <= start:
            return
        i = bisect.bisect_left(self.spans, [start, start])
        # Merge with the neighbour on the left when touching or overlapping.
        if i > 0 and self.spans[i - 1][1] >= start:
            i -= 1
            start = min(start, self.spans[i][0])
        j = i
        while j < len(self.spans) and self.spans[j][0] <= stop:
            stop = max(stop, self.spans[j][1])
            j += 1
        self.spans[i:j] = [[start, stop]]

    def total(self, start: int = 0, stop: int | None = None) -> int:
        """Positions covered within [start, stop) (default: all)."""
        hi = stop if stop is not None else max((b for _, b in self.spans), default=0)
        return sum(max(0, min(b, hi) - max(a, start)) for a, b in self.spans)

    def complement(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The gaps in [start, stop)."""
        gaps, at = [], start
        for a, b in self.spans:
            if a > at:
                gaps.append((at, min(a, stop)))
            at = max(at, b)
        if at < stop:
            gaps.append((at, stop))
        return [(a, b) for a, b in gaps if b > a]


class DataPlaneClient:
    """Iterate augmented batches from the data servers ``servers`` names: a discovery source
    (``training.dataplane.discovery``) or a list of ``host:port``.

    ``num_samples`` defaults to what the servers report. ``prefetch_batches`` is the reorder
    window: batches are requested or held at most that far ahead of the trainer (memory: that
    many batches). Each range handed to a stream is at most ``chunk_batches`` batches;
    ``streams_per_server`` streams (each on its own connection) run per server. Every RPC has an
    ``rpc_timeout_s`` deadline; a failed server is checked again after ``backoff_s`` doubling to
    ``max_backoff_s`` and readmitted when healthy; the source is asked again every
    ``refresh_s``. The trainer waits at most ``wait_for_data_s`` for any one batch.
    ``share`` limits each epoch to positions ``[start, stop)``: a trainer rank's block, so ranks
    that each run a client over the same servers see disjoint samples.

    ``split="val"`` delivers the servers' validation split instead: position ``i`` is validation
    sample ``i`` (no shuffling; seed and epoch change nothing), ``num_samples`` is the servers'
    ``num_val_samples``, and servers without a validation set are not admitted. A pass over it
    is ``iter_epoch(epoch)``; ``rewind()`` makes the next one deliver the whole share again.

    ``pin_memory`` (a trainer on a GPU): each stream's thread copies the images it receives
    into page-locked memory, so the training thread's copy to the GPU needs no staging copy.
    """

    def __init__(
        self,
        servers: ServerDiscovery | Sequence[str],
        *,
        batch_size: int,
        num_samples: int | None = None,
        seed: int = 0,
        prefetch_batches: int = 8,
        chunk_batches: int = 2,
        streams_per_server: int = 1,
        rpc_timeout_s: float = 60.0,
        recipe: str = "",
        image_size: int = 0,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        refresh_s: float = 5.0,
        wait_for_data_s: float = 600.0,
        share: tuple[int, int] | None = None,
        split: Split | str = Split.TRAIN,
        pin_memory: bool = False,
    ) -> None:
        self.split = parse_split(split)
        if isinstance(servers, str):
            servers = [servers]
        if isinstance(servers, Sequence):
            if not servers:
                raise ValueError(
                    "DataPlaneClient needs at least one data server address (host:port) "
                    "or a discovery source"
                )
            servers = StaticServers(servers)
        for name, value in (
            ("batch_size", batch_size),
            ("prefetch_batches", prefetch_batches),
            ("chunk_batches", chunk_batches),
            ("streams_per_server", streams_per_server),
        ):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        for name, seconds in (
            ("rpc_timeout_s", rpc_timeout_s),
            ("refresh_s", refresh_s),
            ("wait_for_data_s", wait_for_data_s),
            ("backoff_s", backoff_s),
        ):
            if not seconds > 0:
                raise ValueError(f"{name} must be positive, got {seconds}")
        self.batch_size = batch_size
        self.seed = seed
        self.prefetch_batches = prefetch_batches
        self.chunk_batches = chunk_batches
        self.streams_per_server = streams_per_server
        self.rpc_timeout_s = rpc_timeout_s
        self.recipe = recipe
        self.image_size = image_size
        self.wait_for_data_s = wait_for_data_s
        self.pin_memory = pin_memory
        self._pool = ServerPool(
            servers,
            refresh_s=refresh_s,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            streams_per_server=streams_per_server,
            expected_samples=num_samples,
            validation=self.split is Split.VAL,
        )
        self._num_samples = num_samples
        self._share: tuple[int, int] | None = None
        self.share = share
        self._epoch = 0
        self._consumed = Intervals()
        self._ahead: EpochRun | None = None
        """The next epoch's run, reading ahead since the last one ended (``iter_epoch(then=)``)."""
        self.skipped_samples = 0
        """Samples the servers could not read this epoch (skipped, not delivered)."""
        self.batches_by_server: collections.Counter[str] = collections.Counter()
        """Batches received from each server (since the client was made)."""
        self.interrupt: Callable[[], bool] | None = None
        """Checked while the trainer waits for a batch: True ends the wait with
        ``DataWaitInterrupted`` (the trainer was asked to stop)."""

    # ---- servers ---------------------------------------------------------------------------

    @property
    def pool(self) -> ServerPool:
        """The data servers as this client sees them (started on first use)."""
        self._pool.start()
        return self._pool

    @property
    def addresses(self) -> list[str]:
        """Every data server the discovery source lists now."""
        return self.pool.known()

    def wait_for_servers(self, timeout_s: float = 60.0, settle_s: float | None = None) -> list[str]:
        """Wait until every listed server is serving, or (with ``settle_s``) at least one has
        been for that long, or ``timeout_s`` passes; return the serving addresses. Raises
        ``DataPlaneUnavailable`` listing each address and its last error when none serves."""
        pool = self.pool
        started = time.monotonic()

        def ready() -> bool:
            serving, known = pool.serving(), pool.known()
            if known and len(serving) == len(known):
                return True
            settled = settle_s is not None and time.monotonic() - started >= settle_s
            return bool(serving) and settled

        pool.wait(ready, timeout_s)
        serving = pool.serving()
        if not serving:
            raise DataPlaneUnavailable(
                f"no data server is reachable after {timeout_s:.0f}s "
                f"({pool.discovery.describe()}):\n{pool.describe_errors()}\n"
                "check that `hetero serve` runs at these addresses and the ports are open"
            )
        for address, problem in pool.errors().items():
            if address not in serving:
                log.warning(
                    "data server %s is not serving (%s); it joins when healthy", address, problem
                )
        return serving

    def server_info(self, address: str | None = None) -> dataplane_pb2.ServerInfo:
        """What a server serves (dataset size, image size, recipes): ``address`` or the first
        serving one."""
        pool = self.pool
        target = address or next(iter(pool.serving() or pool.known()), None)
        channel = pool.channel(target) if target else None
        if channel is None:
            raise DataPlaneUnavailable(f"no data server to ask:\n{pool.describe_errors()}")
        return dataplane_pb2_grpc.DataPlaneStub(channel).GetInfo(
            dataplane_pb2.GetInfoRequest(), timeout=self.rpc_timeout_s
        )

    @property
    def num_samples(self) -> int:
        """Samples per epoch of the client's split (learned from the first server admitted,
        waiting for one at most ``wait_for_data_s``, when not given)."""
        if self._num_samples is None:
            pool = self.pool
            if not pool.wait(lambda: pool.num_samples() is not None, self.wait_for_data_s):
                what = "validation set's" if self.split is Split.VAL else "dataset"
                raise DataPlaneUnavailable(
                    f"cannot learn the {what} size: no data server is serving "
                    f"({pool.discovery.describe()}):\n{pool.describe_errors()}"
                )
            self._num_samples = pool.num_samples()
            assert self._num_samples is not None
            pool.expect_samples(self._num_samples)
        return self._num_samples

    def shutdown_servers(self, grace_s: float = 5.0) -> list[str]:
        """Ask every listed server to shut down (Shutdown RPC); return those that acknowledged.
        A server already gone is logged, not an error: the job is ending anyway."""
        pool = self.pool
        pool.refresh(rediscover=True)
        acknowledged = []
        for address in pool.known():
            channel = pool.channel(address)
            if channel is None:
                continue
            try:
                dataplane_pb2_grpc.DataPlaneStub(channel).Shutdown(
                    dataplane_pb2.ShutdownRequest(grace_s=grace_s), timeout=self.rpc_timeout_s
                )
                acknowledged.append(address)
            except grpc.RpcError as e:
                detail = e.code().name if isinstance(e, grpc.Call) else str(e)
                log.info("data server %s did not take Shutdown (%s)", address, detail)
        return acknowledged

    def close(self) -> None:
        self._drop_ahead()
        self._pool.close()

    def __enter__(self) -> DataPlaneClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- epochs and state ------------------------------------------------------------------

    @property
    def share(self) -> tuple[int, int]:
        """The positions [start, stop) of each epoch this client delivers (default: all)."""
        n = self.num_samples
        if self._share is None:
            return (0, n)
        if self._share[1] > n:
            raise DataPlaneError(f"share {self._share} is beyond the epoch's {n} samples")
        return self._share

    @share.setter
    def share(self, value: tuple[int, int] | None) -> None:
        if value is not None and not 0 <= value[0] < value[1]:
            raise ValueError(
                f"share must be positions [start, stop) with stop > start, got {value}"
            )
        self._share = value

    @property
    def epoch(self) -> int:
        return self._epoch

    def state_dict(self) -> dict[str, Any]:
        """The position for a checkpoint: the epoch and the positions already yielded to the
        trainer (batches received but not yet yielded are fetched again after a restore)."""
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "consumed": [list(s) for s in self._consumed.spans],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next ``iter_epoch(state['epoch'])`` (or ``iter``)
        delivers exactly the positions not yet consumed, in the same order."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"data plane state version {state.get('version')!r} is not {STATE_VERSION}"
            )
        if state["seed"] != self.seed or state["num_samples"] != self.num_samples:
            raise ValueError(
                f"data plane state is for seed {state['seed']} / {state['num_samples']} samples; "
                f"this client has seed {self.seed} / {self.num_samples} (the order would differ)"
            )
        consumed = Intervals()
        for a, b in state["consumed"]:
            consumed.add(int(a), int(b))
        self._drop_ahead()
        self._epoch = int(state["epoch"])
        self._consumed = consumed

    def rewind(self) -> None:
        """Forget the positions consumed in the current epoch: the next ``iter_epoch`` of it
        delivers the whole share again (another pass over the validation set)."""
        self._drop_ahead()
        self._consumed = Intervals()
        self.skipped_samples = 0

    def __iter__(self) -> Iterator[Batch]:
        """The current epoch (resumed where the state says), then the next epoch starts."""
        yield from self.iter_epoch(self._epoch)
        self._epoch += 1
        self._consumed = Intervals()

    def plan(self, epoch: int | None = None) -> list[tuple[int, int]]:
        """The positions [start, stop) of each batch still to come in ``epoch`` (default: the
        current one), in the order they are yielded."""
        lo, hi = self.share
        consumed = self._consumed if epoch in (None, self._epoch) else Intervals()
        bs = self.batch_size
        return [
            (a, min(a + bs, gap_stop))
            for gap_start, gap_stop in consumed.complement(lo, hi)
            for a in range(gap_start, gap_stop, bs)
        ]

    def iter_epoch(self, epoch: int, *, then: int | None = None) -> Iterator[Batch]:
        """Every sample of ``epoch`` not yet consumed, exactly once, as ``Batch``es in the
        planned order. A batch whose samples were all unreadable is yielded empty (it keeps its
        slot, so every rank sees the same batch count). Raises ``DataPlaneError`` on a refused
        request, ``DataPlaneUnavailable`` if no batch came for ``wait_for_data_s``.

        ``then``: the epoch the caller takes next. Its first batches are requested as the
        window reaches past this epoch's end (the two together never hold more than
        ``prefetch_batches``), and the next ``iter_epoch(then)`` continues that run; anything
        else (another epoch, a restore, an epoch left early) drops it."""
        if then is not None and then == epoch:
            raise ValueError(f"then={then} is the epoch being read")
        if epoch != self._epoch:
            self._epoch, self._consumed = epoch, Intervals()
            self.skipped_samples = 0
        batches = self.plan(epoch)
        run = self._adopt_ahead(epoch, batches)
        if run is None:
            if not batches:
                return
            run = EpochRun(self, epoch, batches)
            run.start()
        follower = None
        if then is not None:
            follower = EpochRun(self, then, self.plan(then), after=run)
            run.follower = follower
            follower.start()
        finished = False
        try:
            for _ in range(len(batches)):
                received = run.next_batch()
                self.skipped_samples += received.skipped
                self._consumed.add(received.position_start, received.position_stop)
                yield received.batch
            finished = True
        finally:
            run.close()
            if follower is not None:
                run.follower = None
                if finished:
                    self._ahead = follower
                else:
                    follower.close()

    def _adopt_ahead(self, epoch: int, batches: list[tuple[int, int]]) -> EpochRun | None:
        """The run read ahead for ``epoch``, when it plans exactly ``batches``; any other is
        closed."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if ahead.epoch == epoch and ahead.batches == batches:
            ahead.after = None
            return ahead
        ahead.close()
        return None

    def _drop_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.close()
