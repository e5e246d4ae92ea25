"""This process's place in a trainer job and its process groups: torchrun's environment, the
default group (NCCL on a GPU, gloo on the CPU) and CPU groups with timeouts of their own."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, from torchrun's environment (one process without it)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_environ(cls) -> DistEnv:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            world_size=world,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
        )


def init_distributed(env: DistEnv, timeout_s: float = 60.0) -> tuple[torch.device, bool]:
    """Join the process group (NCCL on GPU, gloo on CPU) unless already in one; returns the
    device and whether this call created the group (and so must destroy it). A collective
    that waits for a peer longer than ``timeout_s`` fails (NCCL's default is 10-30 minutes)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        return device, False
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if "MASTER_ADDR" not in os.environ and env.world_size == 1:
        # A single process without torchrun: an in-memory store, no port to open.
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    else:
        kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=timeout, **kwargs)
    return device, True


def gloo_group(timeout_s: float) -> dist.ProcessGroup:
    """A new CPU group over every rank whose collectives wait at most ``timeout_s`` (all ranks
    must create it, in the same order)."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    assert isinstance(group, dist.ProcessGroup)
    return group
