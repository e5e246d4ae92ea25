"""bf16 gradient compression (``job.parallelism.grad_compression``): the spec accepts it for DDP
only, and in two real gloo processes torch's ``bf16_compress_hook`` makes DDP's gradients the
bf16-rounded average of the ranks' gradients (without it: the exact fp32 average), both through
``parallelize`` and through the ``Trainer`` built from a spec."""

from __future__ import annotations

import logging
import multiprocessing
import os
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from training.spec import GradCompression, Parallelism, SpecError, load_spec
from training.trainer.config import ConfigError, ParallelConfig, TrainerConfig
from training.trainer.local_run import FORKSERVER_PRELOAD, free_port
from training.trainer.parallel_dims import ParallelDims
from training.trainer.parallelize import parallelize

from .conftest import write_spec

BF16 = 'grad_compression = "bf16"'
HOOK_LOG = (
    "DDP gradients are all-reduced in bf16 (job.parallelism.grad_compression = 'bf16'): "
    "half the bytes per step, gradients rounded to bf16"
)


# --- the spec and the configuration -----------------------------------------------------------


def test_default_is_none_and_bf16_reaches_the_trainer_config(tmp_path: Path) -> None:
    plain = load_spec(write_spec(tmp_path, name="plain.toml"))
    assert plain.job.parallelism.grad_compression is GradCompression.NONE
    spec = load_spec(write_spec(tmp_path, extra_parallel=BF16))
    assert spec.job.parallelism.grad_compression is GradCompression.BF16
    config = TrainerConfig.from_spec(spec, run_dir=tmp_path / "run", synthetic=True, environ={})
    assert config.parallel == ParallelConfig(Parallelism.DDP, None, None, GradCompression.BF16)


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp"])
def test_sharded_strategies_refuse_bf16_compression(tmp_path: Path, strategy: str) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(write_spec(tmp_path, strategy=strategy, extra_parallel=BF16))
    assert info.value.problems == [
        "job.parallelism.grad_compression: 'bf16' only applies to strategy 'ddp' (strategy is "
        f"{strategy}: it reduce-scatters gradients in its own dtype); set strategy = 'ddp' or "
        "remove grad_compression"
    ]
    # "none" is the default and valid with every strategy.
    spec = load_spec(
        write_spec(tmp_path, strategy=strategy, extra_parallel='grad_compression = "none"')
    )
    assert spec.job.parallelism.grad_compression is GradCompression.NONE


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (
            'grad_compression = "fp16"',
            "job.parallelism.grad_compression: 'fp16' is not valid; use one of 'none', 'bf16'",
        ),
        (
            "grad_compression = true",
            "job.parallelism.grad_compression: expected str, got bool True",
        ),
    ],
)
def test_bad_values_are_named(tmp_path: Path, line: str, problem: str) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(write_spec(tmp_path, extra_parallel=line))
    assert info.value.problems == [problem]


def test_parallelize_refuses_compression_for_fsdp_built_by_hand() -> None:
    """A config made without the spec must not train uncompressed while it says bf16."""
    dims = ParallelDims(Parallelism.FSDP, replicate=1, shard=2)
    with pytest.raises(ConfigError) as info:
        parallelize(
            nn.Linear(2, 2), dims, cast(Any, None), torch.device("cpu"), bf16=False,
            grad_compression=GradCompression.BF16,
        )  # fmt: skip
    assert info.value.problems == [
        "job.parallelism.grad_compression = 'bf16' only applies to strategy 'ddp' (strategy is "
        "fsdp); set strategy = 'ddp' or remove it"
    ]


# --- two gloo ranks ---------------------------------------------------------------------------


def _tiny_model() -> nn.Module:
    """The same weights on every rank (DDP also broadcasts rank 0's)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _backward(model: nn.Module, rank: int) -> None:
    """One backward pass on data of this rank's own, so the ranks' gradients differ."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + rank))
    model(x).square().mean().backward()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return {n: p.grad.detach().clone() for n, p in inner.named_parameters() if p.grad is not None}


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _rank(rank: int, port: int, tmp: Path, spec: Path) -> None:
    """Rank ``rank`` of 2: gradients with and without the hook, then a Trainer from ``spec``;
    writes what it saw to ``tmp/rank-<rank>.pt``."""
    from training.trainer.train import Trainer

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    logger = logging.getLogger("training.trainer.parallelize")
    logger.setLevel(logging.INFO)
    seen: dict[str, Any] = {}
    local = _tiny_model()
    _backward(local, rank)
    seen["local"] = _grads(local)
    for mode in GradCompression:
        handler = _Messages()
        logger.addHandler(handler)
        dims = ParallelDims.resolve(
            ParallelConfig(Parallelism.DDP, None, None, mode), world_size=2, local_world_size=2
        )
        model = parallelize(
            _tiny_model(), dims, dims.build_mesh("cpu", timeout_s=30), torch.device("cpu"),
            bf16=False, grad_compression=mode,
        )  # fmt: skip
        assert isinstance(model, DistributedDataParallel)
        _backward(model, rank)
        logger.removeHandler(handler)
        seen[str(mode)] = {
            "grads": _grads(model),
            "hook": model._get_ddp_logging_data().get("comm_hook"),
            "log": handler.messages,
        }
    # The Trainer, configured from the spec: the hook is on its DDP module and it trains.
    handler = _Messages()
    logger.addHandler(handler)
    config = TrainerConfig.from_spec(
        load_spec(spec), run_dir=tmp / "run", synthetic=True, steps=2, environ={}
    )
    trainer = Trainer(config)
    logger.removeHandler(handler)
    assert isinstance(trainer.model, DistributedDataParallel)
    seen["trainer"] = {
        "hook": trainer.model._get_ddp_logging_data().get("comm_hook"),
        "log": handler.messages,
        "exit": trainer.train(),
        "summary": trainer.summary.get("grad_compression") if rank == 0 else None,
    }
    trainer.close()
    torch.save(seen, tmp / f"rank-{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_bf16_hook_all_reduces_bf16_rounded_average_on_gloo(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, batch_size=4, steps=2, extra_parallel=BF16)
    # The forkserver the trainer tests use (torch imported once, ranks forked from it).
    multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    torch_mp.start_processes(
        _rank, args=(free_port(), tmp_path, spec), nprocs=2, start_method="forkserver"
    )
    seen = [torch.load(tmp_path / f"rank-{r}.pt") for r in (0, 1)]
    g0, g1 = seen[0]["local"], seen[1]["local"]
    assert set(g0) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name in g0:
        a, b = g0[name], g1[name]
        assert not torch.equal(a, b), name  # the ranks really disagree
        fp32_average = (a + b) / 2
        # bf16_compress_hook: each rank casts its bucket to bf16 and halves it; the all-reduce
        # sums the halves in bf16; the result is copied back into the fp32 gradients.
        bf16_average = (a.bfloat16() / 2 + b.bfloat16() / 2).float()
        for s in seen:
            plain, hooked = s["none"]["grads"][name], s["bf16"]["grads"][name]
            torch.testing.assert_close(plain, fp32_average, rtol=0, atol=0)
            torch.testing.assert_close(hooked, bf16_average, rtol=0, atol=0)
            # Every value is a bf16 number, off the fp32 average by bf16 rounding (two
            # roundings, each at most 2^-8 relative: 8 significant bits), which is far beyond
            # fp32 rounding (2^-24).
            assert torch.equal(hooked, hooked.bfloat16().float()), name
            error = (hooked - fp32_average).abs()
            scale = (a.abs() + b.abs()) / 2
            assert bool((error <= 2**-7 * 1.01 * scale).all()), name
            assert float((error / scale.clamp_min(1e-30)).max()) > 2**-12, name
            assert not torch.allclose(hooked, fp32_average, rtol=1e-6, atol=0), name
    for s in seen:
        assert s["none"]["hook"] is None and s["none"]["log"] == []
        assert s["bf16"]["hook"] == "bf16_compress_hook"
        assert s["bf16"]["log"] == [HOOK_LOG]
        assert s["trainer"]["hook"] == "bf16_compress_hook"
        assert s["trainer"]["log"] == [HOOK_LOG]
        assert s["trainer"]["exit"] == 0
    assert seen[0]["trainer"]["summary"] == "bf16"
