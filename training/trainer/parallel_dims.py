"""Parallel degrees: one small object whose product must equal the world size, and its mesh.

Every strategy is described on the same named 2-D mesh ``("replicate", "shard")``: DDP is
``(world, 1)``, FSDP ``(1, world)``, HSDP ``(replicate, shard)`` with the shard groups made of
consecutive ranks, which torchrun places on one node (shard within a node, replicate across:
the MiCS / ZeRO-2D layout).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from training.spec import Parallelism
from training.trainer.config import ConfigError, ParallelConfig

log = logging.getLogger(__name__)

MESH_DIM_NAMES = ("replicate", "shard")


@dataclass(frozen=True)
class ParallelDims:
    """How ``world_size`` ranks split into replicas and shards."""

    strategy: Parallelism
    replicate: int
    shard: int

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard

    @property
    def sharded(self) -> bool:
        """True when parameters and optimizer state are split (FSDP2 ``fully_shard``)."""
        return self.strategy is not Parallelism.DDP

    @classmethod
    def resolve(
        cls, config: ParallelConfig, *, world_size: int, local_world_size: int
    ) -> ParallelDims:
        """The degrees for ``config`` on this job; raises ``ConfigError`` naming
        ``job.parallelism.shard_degree`` / ``replicate_degree`` when they cannot multiply to
        ``world_size``."""
        if world_size < 1:
            raise ConfigError([f"world size must be at least 1, got {world_size}"])
        if config.strategy is Parallelism.DDP:
            return cls(config.strategy, replicate=world_size, shard=1)
        if config.strategy is Parallelism.FSDP:
            return cls(config.strategy, replicate=1, shard=world_size)
        shard = config.shard_degree or min(max(1, local_world_size), world_size)
        if config.replicate_degree is None and world_size % shard:
            raise ConfigError(
                [
                    f"job.parallelism.shard_degree = {shard} does not divide the world size "
                    f"{world_size}; choose a divisor of {world_size}"
                ]
            )
        replicate = config.replicate_degree or world_size // shard
        if shard * replicate != world_size:
            raise ConfigError(
                [
                    f"job.parallelism.shard_degree ({shard}) x job.parallelism.replicate_degree "
                    f"({replicate}) = {shard * replicate}, but the trainer has {world_size} "
                    f"ranks; set them so that the product is {world_size}"
                ]
            )
        return cls(config.strategy, replicate=replicate, shard=shard)

    def build_mesh(self, device_type: str, *, timeout_s: float | None = None) -> DeviceMesh:
        """The named ``("replicate", "shard")`` mesh over every rank (collective: all ranks
        must call it). A dimension that spans every rank reuses the default group (and its
        timeout); the subgroups of a 2-D mesh get ``timeout_s`` (torch's default otherwise:
        10-30 minutes)."""
        override: dict[int | str, Any] = {}
        if timeout_s is not None:
            for name, size in zip(MESH_DIM_NAMES, (self.replicate, self.shard), strict=True):
                if 1 < size < self.world_size:
                    override[name] = _options_with_timeout(device_type, timeout_s)
        mesh = init_device_mesh(
            device_type,
            (self.replicate, self.shard),
            mesh_dim_names=MESH_DIM_NAMES,
            backend_override=override or None,
        )
        log.info(
            "parallelism %s: mesh replicate=%d x shard=%d",
            self.strategy,
            self.replicate,
            self.shard,
        )
        return mesh


def _options_with_timeout(device_type: str, timeout_s: float) -> Any:
    """Backend options that carry only a timeout (the mesh passes it on to ``new_group``)."""
    if device_type == "cuda":
        options: Any = dist.ProcessGroupNCCL.Options()
    else:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timedelta(seconds=timeout_s)
    return options
