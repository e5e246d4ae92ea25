"""Apply the parallel strategy to a model: DDP (optionally with bf16 gradient all-reduce), FSDP2
per block + root, or HSDP on the 2-D mesh; and gather a wrapped model's full weights back
(``full_state_dict``)."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from training.spec import GradCompression, Parallelism
from training.trainer.config import ConfigError
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
    grad_compression: GradCompression = GradCompression.NONE,
) -> nn.Module:
    """The model on ``device``, wrapped for ``dims.strategy``; returns the module to train.
    ``grad_compression`` ``bf16`` (DDP only) makes DDP all-reduce each gradient bucket as bf16
    (torch's ``bf16_compress_hook``), halving the bytes on the wire; the averaged gradients come
    back rounded to bf16."""
    if grad_compression is not GradCompression.NONE and dims.strategy is not Parallelism.DDP:
        # The spec refuses this too; a config built by hand must not silently train uncompressed.
        raise ConfigError(
            [
                f"job.parallelism.grad_compression = '{grad_compression}' only applies to "
                f"strategy 'ddp' (strategy is {dims.strategy}); set strategy = 'ddp' or remove it"
            ]
        )
    model.to(device)
    if dims.strategy is Parallelism.DDP:
        if dims.world_size == 1:
            if grad_compression is not GradCompression.NONE:
                log.info(
                    "grad_compression '%s' has no effect: one rank, no all-reduce", grad_compression
                )
            return model  # One rank: nothing to synchronise, no hooks to pay for.
        group = mesh.get_group("replicate")
        ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=group,
        )
        if grad_compression is GradCompression.BF16:
            # torch's own hook: cast the bucket to bf16, divide by the group size, all-reduce
            # (NCCL or gloo), copy back into the gradient bucket.
            ddp.register_comm_hook(group, bf16_compress_hook)
            log.info(
                "DDP gradients are all-reduced in bf16 (job.parallelism.grad_compression = "
                "'bf16'): half the bytes per step, gradients rounded to bf16"
            )
        return ddp
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


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s full weights on the CPU (collective when a process group is up: every rank
    calls it; rank 0 gets them, the others an empty dict). DDP's ``module.`` prefix and FSDP's
    shards are undone by torch's ``get_model_state_dict``."""
    if not dist.is_initialized():
        inner = getattr(module, "module", module)
        return {k: v.detach().cpu() for k, v in inner.state_dict().items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(module, options=options)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
