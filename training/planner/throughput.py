"""Trainer samples/s per GPU: measured where the results store has it, else a FLOPs estimate.

Estimate: ``samples/s per GPU = peak FLOP/s x MFU / training FLOPs per sample``, with the GPU's
peak from ``priors.GPU_PEAKS`` (bf16, or its fp32/TF32 figure for ``precision = "fp32"``) and an
MFU calibrated on the measured GPU runs in the results store: the median, over every stored
result for the same model (parameter count), image size and precision on a GPU the peak table
knows, of ``measured samples/s x FLOPs per sample / peak``. With no such run, the MFU prior
(0.35). Both parts are labelled "estimate" wherever they are shown, with the MFU's origin.
"""

from __future__ import annotations

import statistics
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


def calibrated_mfu(workload: Workload, facts: Facts, measured: Measured) -> tuple[float, str]:
    """(MFU, where it comes from): the median over the store's matching GPU runs, else the
    prior (see the module docstring)."""
    observed: list[float] = []
    for r in measured.throughput:
        if (r.model, r.image_size, r.precision) != (
            workload.model,
            workload.image_size,
            workload.precision.value,
        ) or (r.params is not None and r.params != workload.params):
            continue
        gpu = r.device
        if r.instance_type is not None and r.instance_type in facts.catalog:
            gpu = facts.catalog[r.instance_type].gpu_model
        if gpu is None or gpu not in facts.gpu_peaks:
            continue  # A CPU run, or a GPU without a peak figure: nothing to calibrate with.
        peak = facts.gpu_peaks[gpu]
        flops = peak.bf16 if workload.precision is Precision.BF16 else peak.fp32
        observed.append(r.samples_per_s_per_device * workload.train_flops_per_sample / flops)
    if not observed:
        return facts.mfu, f"MFU prior {facts.mfu:g}"
    mfu = statistics.median(observed)
    return mfu, f"MFU {mfu:.3g} calibrated on {len(observed)} measured GPU run(s)"


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
        workload.params,
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
    mfu, mfu_source = calibrated_mfu(workload, facts, measured)
    rate = flops * mfu / workload.train_flops_per_sample
    return GpuThroughput(
        rate,
        False,
        f"estimate: {entry.gpu_model} {flops / 1e12:g} TFLOP/s x {mfu_source} / "
        f"{workload.train_flops_per_sample / 1e9:.1f} GFLOP per sample",
    )
