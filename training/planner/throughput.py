"""Trainer samples/s per GPU: measured where the results store has it, else a FLOPs estimate.

Estimate: ``samples/s per GPU = peak FLOP/s x MFU / training FLOPs per sample``, with the GPU's
peak from ``priors.GPU_PEAKS`` (bf16, or its fp32/TF32 figure for ``precision = "fp32"``) and
the MFU prior (0.35). Both parts are labelled "estimate" wherever they are shown.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.planner.errors import PlanError
from training.planner.facts import Facts
from training.planner.results import Measured
from training.planner.workload import Workload
from training.spec import Precision


@dataclass(frozen=True)
class GpuThroughput:
    samples_per_s: float
    """Per GPU, compute only (no communication, no data wait)."""
    measured: bool
    source: str


def gpu_throughput(
    instance_type: str, workload: Workload, facts: Facts, measured: Measured
) -> GpuThroughput:
    """Samples/s one GPU of ``instance_type`` trains ``workload`` at."""
    entry = facts.instance(instance_type)
    result = measured.trainer_result(
        instance_type,
        entry.gpu_model,
        workload.model,
        workload.image_size,
        workload.precision.value,
    )
    if result is not None:
        return GpuThroughput(result.samples_per_s_per_device, True, result.describe())
    if entry.gpu_model is None or entry.gpu_model not in facts.gpu_peaks:
        raise PlanError(
            f"{instance_type}: no measured throughput and no peak FLOP/s for its GPU "
            f"({entry.gpu_model}); add the GPU to training/planner/priors.py GPU_PEAKS or a "
            "measured result to benchmarks/results/throughput.json"
        )
    peak = facts.gpu_peaks[entry.gpu_model]
    flops = peak.bf16 if workload.precision is Precision.BF16 else peak.fp32
    rate = flops * facts.mfu / workload.train_flops_per_sample
    return GpuThroughput(
        rate,
        False,
        f"estimate: {entry.gpu_model} {flops / 1e12:g} TFLOP/s x MFU {facts.mfu:g} / "
        f"{workload.train_flops_per_sample / 1e9:.1f} GFLOP per sample",
    )
