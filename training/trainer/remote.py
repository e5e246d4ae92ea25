"""Batches from the gRPC data servers: one ``DataPlaneClient`` per trainer rank.

Every rank runs a client over every data server its discovery source lists (servers that join
mid-epoch get work; failed ones are retried); each client's ``share`` is this rank's block of the
epoch's positions, ``[rank * per_rank, (rank + 1) * per_rank)`` (``per_rank`` is a whole number
of batches, equal on every rank), so ranks see disjoint samples.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from training.data.batch import Batch
from training.data.transforms import encode_recipe
from training.dataplane.client import DataPlaneClient, DataWaitInterrupted
from training.dataplane.discovery import ServerDiscovery, parse_discovery
from training.trainer.config import TrainerConfig
from training.trainer.stream import DataInterrupted, EndOfData, rank_positions

log = logging.getLogger(__name__)


def dataplane_client(
    config: TrainerConfig,
    discovery: ServerDiscovery,
    *,
    recipe: str,
    batch_size: int,
    split: str = "",
    pin_memory: bool = False,
) -> DataPlaneClient:
    """A client over ``discovery`` with the spec's data-plane settings (training batches, or
    with ``split="val"`` validation ones; ``pin_memory``: received in page-locked memory)."""
    dp = config.spec.job.dataplane
    return DataPlaneClient(
        discovery,
        batch_size=batch_size,
        seed=config.seed,
        prefetch_batches=dp.prefetch_batches,
        chunk_batches=dp.chunk_batches,
        streams_per_server=dp.streams_per_server,
        rpc_timeout_s=dp.rpc_timeout_s,
        refresh_s=dp.refresh_s,
        wait_for_data_s=dp.wait_for_data_s,
        recipe=recipe,
        image_size=config.model.image_size,
        split=split,
        pin_memory=pin_memory,
    )


class DataPlaneBatches:
    """This rank's share of each epoch, streamed from every data server discovery finds."""

    def __init__(
        self, config: TrainerConfig, *, rank: int, world_size: int, pin_memory: bool = False
    ) -> None:
        """``pin_memory``: batches arrive in page-locked memory (a trainer on a GPU)."""
        job = config.spec.job
        dp = job.dataplane
        self.epochs = config.epochs
        self.discovery = parse_discovery(config.input.data_servers, config.spec)
        self.client = dataplane_client(
            config, self.discovery, recipe=encode_recipe(job.augmentation),
            batch_size=config.batch_size, pin_memory=pin_memory,
        )  # fmt: skip
        # Start with the servers that are up (a late one joins when healthy), waiting for the
        # first at most wait_for_data_s: a trainer that starts before its data tier waits.
        serving = self.client.wait_for_servers(timeout_s=dp.wait_for_data_s, settle_s=10.0)
        n = self.client.num_samples
        self.batches_per_epoch, _ = rank_positions(n, rank, world_size, config.batch_size)
        per_rank = self.batches_per_epoch * config.batch_size
        self._block = (rank * per_rank, (rank + 1) * per_rank)
        self.client.share = self._block
        log.info(
            "data plane (%s): %d/%d server(s) serving; rank %d takes positions [%d, %d) of %d",
            self.discovery.describe(), len(serving), len(self.client.addresses), rank,
            *self._block, n,
        )  # fmt: skip
        self._batches_needed = (
            None if config.total_steps is None else config.total_steps * config.grad_accum_steps
        )
        """Batches this rank takes in the run (``--steps``); None: ``epochs`` whole epochs."""
        self.epoch = 0
        self._batch = 0
        self._iter: Iterator[Batch] | None = None
        self._restored: dict[str, Any] | None = None

    def _open(self) -> Iterator[Batch]:
        if self._restored is not None:
            self.client.load_state_dict(self._restored)
            self._restored = None
        return self.client.iter_epoch(self.epoch, then=self._next_epoch())

    def _next_epoch(self) -> int | None:
        """The epoch after this one when the run will take batches from it (its first ones are
        then made while this one ends); None at the last."""
        following = self.epoch + 1
        if self.epochs is not None and following >= self.epochs:
            return None
        needed = self._batches_needed
        if needed is not None and following * self.batches_per_epoch >= needed:
            return None
        return following

    def set_interrupt(self, check: Callable[[], bool]) -> None:
        """While waiting for data, ``check()`` True ends the wait with ``DataInterrupted``."""
        self.client.interrupt = check

    def next(self) -> Batch:
        while True:
            if self.epochs is not None and self.epoch >= self.epochs:
                raise EndOfData
            if self._iter is None:
                self._iter = self._open()
            try:
                batch = next(self._iter, None)
            except DataWaitInterrupted as e:
                self._iter = None  # the epoch resumes from the batches consumed so far
                raise DataInterrupted(str(e)) from e
            except BaseException:
                self._iter = None
                raise
            if batch is None:
                self.epoch, self._batch, self._iter = self.epoch + 1, 0, None
                continue
            self._batch += 1
            return batch

    def state_dict(self) -> dict[str, Any]:
        client = None if self._iter is None else self.client.state_dict()
        return {"epoch": self.epoch, "batch": self._batch, "client": client}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self._batch, self._iter = int(state["epoch"]), int(state["batch"]), None
        client = state.get("client")
        if client is None and self._batch:
            log.warning("no data plane position saved: epoch %d restarts", self.epoch)
        self._restored = client

    def close(self, *, job_done: bool) -> None:
        """Close the streams; at the end of the job (rank 0) tell every server to shut down."""
        self._iter = None
        try:
            if job_done:
                acknowledged = self.client.shutdown_servers()
                log.info("job done: %d data server(s) shut down", len(acknowledged))
        finally:
            self.client.close()
