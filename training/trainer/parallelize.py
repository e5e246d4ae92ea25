"""Apply the parallel strategy to a model: DDP, FSDP2 per block + root, or HSDP on the 2-D mesh."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from training.spec import Parallelism
from training.trainer.parallel_dims import ParallelDims

log = logging.getLogger(__name__)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP shards one by one (timm ViTs keep them in ``model.blocks``)."""
    blocks = getattr(model, "blocks", None)
    return list(blocks) if isinstance(blocks, nn.Sequential | nn.ModuleList) else []


def compile_blocks(model: nn.Module) -> None:
    """``torch.compile`` each transformer block in place (before wrapping, as torchtitan does:
    one small graph per block compiles fast and composes with FSDP's per-block hooks)."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.Sequential | nn.ModuleList) or len(blocks) == 0:
        log.warning("compile: the model has no .blocks; compiling it whole")
        model.compile()
        return
    for block in blocks:
        block.compile()


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh,
    device: torch.device,
    *,
    bf16: bool,
) -> nn.Module:
    """The model on ``device``, wrapped for ``dims.strategy``; returns the module to train."""
    model.to(device)
    if dims.strategy is Parallelism.DDP:
        if dims.world_size == 1:
            return model  # One rank: nothing to synchronise, no hooks to pay for.
        return DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=mesh.get_group("replicate"),
        )
    # FSDP: the 1-D shard mesh; HSDP: the 2-D mesh (FSDP2 replicates over dim 0, shards dim 1).
    shard_mesh = mesh["shard"] if dims.strategy is Parallelism.FSDP else mesh
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16 and device.type == "cuda"
        else MixedPrecisionPolicy()
    )
    blocks = transformer_blocks(model)
    if not blocks:
        log.warning("the model has no .blocks: sharding it as one unit (more peak memory)")
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        fully_shard(
            block, mesh=shard_mesh, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1
        )
    fully_shard(model, mesh=shard_mesh, mp_policy=policy)
    return model
