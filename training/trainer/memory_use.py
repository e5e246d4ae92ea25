"""What one rank holds in memory, as the run's summary reports it (``memory_per_rank``): its
parameter, gradient and optimizer-state bytes counted from the tensors (an FSDP rank's shards
only), and the process's peak resident memory."""

from __future__ import annotations

import resource

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for ``t`` (its shard, for an FSDP DTensor)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def local_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes held by this rank, from the tensors."""
    params = grads = 0
    for p in model.parameters():
        params += _local_bytes(p)
        if p.grad is not None:
            grads += _local_bytes(p.grad)
    optim = sum(
        _local_bytes(v)
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.numel() > 1
    )
    return {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": optim}


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
