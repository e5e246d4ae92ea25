"""Parallel degrees: every strategy's mesh shape, and mismatches refused by field name."""

from __future__ import annotations

import pytest

from training.spec import Parallelism
from training.trainer.config import ConfigError, ParallelConfig
from training.trainer.parallel_dims import ParallelDims


def resolve(strategy: Parallelism, world: int, local: int, shard=None, replicate=None):
    cfg = ParallelConfig(strategy, shard_degree=shard, replicate_degree=replicate)
    return ParallelDims.resolve(cfg, world_size=world, local_world_size=local)


def test_ddp_replicates_over_every_rank() -> None:
    d = resolve(Parallelism.DDP, 8, 8)
    assert (d.replicate, d.shard, d.sharded) == (8, 1, False)


def test_fsdp_shards_over_every_rank() -> None:
    d = resolve(Parallelism.FSDP, 8, 4)
    assert (d.replicate, d.shard, d.sharded) == (1, 8, True)


def test_hsdp_shards_within_a_node_by_default() -> None:
    # 4 nodes x 8 GPUs: shard over the 8 ranks of a node, replicate over the 4 nodes.
    d = resolve(Parallelism.HSDP, 32, 8)
    assert (d.replicate, d.shard) == (4, 8)


def test_hsdp_degrees_from_the_spec_win() -> None:
    d = resolve(Parallelism.HSDP, 4, 4, shard=2, replicate=2)
    assert (d.replicate, d.shard, d.world_size) == (2, 2, 4)


def test_hsdp_degrees_that_do_not_multiply_name_the_fields() -> None:
    with pytest.raises(ConfigError) as e:
        resolve(Parallelism.HSDP, 4, 4, shard=2, replicate=3)
    msg = str(e.value)
    assert "job.parallelism.shard_degree" in msg and "job.parallelism.replicate_degree" in msg
    assert "= 6" in msg and "4 ranks" in msg


def test_hsdp_shard_degree_that_does_not_divide_the_world() -> None:
    with pytest.raises(ConfigError, match=r"job\.parallelism\.shard_degree = 3 does not divide"):
        resolve(Parallelism.HSDP, 4, 4, shard=3)
