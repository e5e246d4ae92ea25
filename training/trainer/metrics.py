"""Training metrics, computed in one place and sent to the console, JSON lines and a plot.

Every ``log_every_steps`` steps (and at the end) the loop hands an interval's counters to
``MetricsLogger.log``; rank 0 writes one JSON object per line to ``<run_dir>/metrics.jsonl``,
prints a progress line, and at the end prints a summary table, writes ``summary.json`` and
plots samples/s and data-wait share to ``metrics.png``. Where enabled (``emf_cluster``: on the
stack's instances), rank 0 also prints each interval as a CloudWatch Embedded Metric Format line
on stdout (``training.trainer.emf``), which CloudWatch Logs turns into metrics.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from rich.console import Console
from rich.table import Table

from training.trainer.emf import emf_document, write_emf

log = logging.getLogger(__name__)

# Dense peak tensor FLOP/s per GPU (bf16; fp16 for V100 and T4, which lack bf16). Keys are
# matched as substrings of torch.cuda.get_device_name(), most specific first.
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
    # NVIDIA's A10 datasheet figure; the A10G (AWS g5) is clocked lower, so MFU is a floor.
    ("A10G", 125e12),
    ("A10", 125e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("V100", 125e12),
    ("T4", 65e12),
)


def peak_flops(device_name: str) -> float | None:
    """Peak dense bf16/fp16 FLOP/s of the GPU called ``device_name``; None if unknown."""
    for key, flops in PEAK_FLOPS:
        if key in device_name:
            return flops
    return None


class GpuMonitor:
    """GPU utilisation and memory through NVML, when a GPU and pynvml are present."""

    def __init__(self, device: torch.device) -> None:
        self._handle: Any = None
        self._nvml: Any = None
        if device.type != "cuda":
            return
        try:
            import pynvml  # nvidia-ml-py; optional at run time

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            self._nvml = pynvml
        except Exception as e:  # NVML missing or unusable: the metric is simply absent
            log.info("GPU utilisation unavailable (NVML: %s)", e)

    def utilisation_pct(self) -> float | None:
        if self._handle is None:
            return None
        return float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)


@dataclass
class Interval:
    """Counters for the steps since the last log line (one rank's view)."""

    started: float = field(default_factory=time.perf_counter)
    steps: int = 0
    data_wait_s: float = 0.0
    loss_sum: float = 0.0
    checkpoint_s: float = 0.0
    """Time the loop spent on checkpoints (not counted as step time)."""

    def reset(self) -> None:
        self.started = time.perf_counter()
        self.steps = 0
        self.data_wait_s = 0.0
        self.loss_sum = 0.0
        self.checkpoint_s = 0.0


@dataclass(frozen=True)
class RunFacts:
    """What does not change during a run and turns counters into rates."""

    global_batch: int
    """Samples per optimizer step across all ranks (batch x accumulation x world)."""
    world_size: int
    cluster_usd_per_hour: float
    """Every instance group of the spec: trainers and data servers alike."""
    flops_per_sample: float | None
    peak_flops_per_rank: float | None
    total_steps: int | None


class MetricsLogger:
    """Turns interval counters into records; rank 0 writes them out."""

    def __init__(
        self,
        run_dir: Path,
        facts: RunFacts,
        *,
        rank: int,
        device: torch.device,
        emf_cluster: str | None = None,
    ) -> None:
        """``emf_cluster``: print EMF lines with this ``Cluster`` dimension (rank 0 only);
        None: none."""
        self.run_dir = run_dir
        self.facts = facts
        self.rank = rank
        self.emf_cluster = emf_cluster
        self.records: list[dict[str, Any]] = []
        self._gpu = GpuMonitor(device)
        self._device = device
        self._console = Console(stderr=True)
        self._jsonl = None
        if rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        psutil.cpu_percent(interval=None)  # Start the CPU-time window.

    def log(
        self,
        step: int,
        interval: Interval,
        *,
        loss: float,
        lr: float,
        data_wait_share: float,
        epoch: int,
        checkpoint_age_s: float | None = None,
    ) -> dict[str, Any]:
        """Record one interval (``loss`` and ``data_wait_share`` already averaged over ranks;
        ``checkpoint_age_s``: seconds since the newest durable checkpoint, None if none)."""
        elapsed = max(time.perf_counter() - interval.started, 1e-9)
        steps = max(interval.steps, 1)
        samples_per_s = self.facts.global_batch * steps / elapsed
        usd_per_s = self.facts.cluster_usd_per_hour / 3600.0
        record: dict[str, Any] = {
            "time": time.time(),
            "step": step,
            "epoch": epoch,
            "loss": loss,
            "lr": lr,
            "samples_per_s": samples_per_s,
            "step_time_s": elapsed / steps,
            "data_wait_share": data_wait_share,
            "samples_per_usd": samples_per_s / usd_per_s if usd_per_s > 0 else None,
            "host_cpu_pct": psutil.cpu_percent(interval=None),
            "mfu": self._mfu(samples_per_s),
            "gpu_util_pct": self._gpu.utilisation_pct(),
            "steps": steps,
            "checkpoint_stall_s": interval.checkpoint_s,
            "checkpoint_age_s": checkpoint_age_s,
        }
        if self._device.type == "cuda":
            record["gpu_mem_peak_gib"] = torch.cuda.max_memory_allocated(self._device) / 2**30
        self.records.append(record)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._console.print(progress_line(record, self.facts.total_steps), highlight=False)
        if self.rank == 0 and self.emf_cluster is not None:
            document = emf_document(record, cluster=self.emf_cluster)
            try:
                if document is not None:
                    write_emf(document)
            except OSError as e:  # A closed stdout costs the metric line, never the run.
                log.warning("EMF metrics line not written: %s", e)
        return record

    def _mfu(self, samples_per_s: float) -> float | None:
        f, peak = self.facts.flops_per_sample, self.facts.peak_flops_per_rank
        if f is None or peak is None:
            return None
        return samples_per_s * f / (peak * self.facts.world_size)

    def finish(self, extra: Mapping[str, Any]) -> dict[str, Any]:
        """Write ``summary.json`` and ``metrics.png`` and print the table (rank 0); returns the
        summary on every rank."""
        summary = summarise(self.records)
        summary.update(extra)
        if self.rank == 0:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            if self.records:
                plot(self.records, self.run_dir / "metrics.png")
            self._console.print(summary_table(summary))
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        return summary


def _mean(values: Sequence[float | None], weights: Sequence[float]) -> float | None:
    pairs = [(v, w) for v, w in zip(values, weights, strict=True) if v is not None]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if pairs and total > 0 else None


def summarise(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Step-weighted averages over the run, leaving out the first interval (warm-up: compile,
    allocator, first batches) when there are others."""
    steady = list(records[1:]) if len(records) > 1 else list(records)
    weights = [float(r["steps"] * r["step_time_s"]) for r in steady]  # time-weighted
    steps = sum(int(r["steps"]) for r in steady)
    seconds = sum(weights)
    out: dict[str, Any] = {
        "steps": records[-1]["step"] if records else 0,
        "final_loss": records[-1]["loss"] if records else None,
        "measured_steps": steps,
        "step_time_s": seconds / steps if steps else None,
    }
    for key in ("samples_per_s", "data_wait_share", "samples_per_usd", "host_cpu_pct", "mfu"):
        out[key] = _mean([r[key] for r in steady], weights)
    out["gpu_util_pct"] = _mean([r["gpu_util_pct"] for r in steady], weights)
    return out


def _fmt(value: Any, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value * scale:{spec}}{suffix}"


def progress_line(r: Mapping[str, Any], total_steps: int | None) -> str:
    """One console line per interval."""
    of = f"/{total_steps}" if total_steps else ""
    parts = [
        f"step {r['step']}{of}",
        f"loss {r['loss']:.4f}",
        f"{r['samples_per_s']:.1f} samples/s",
        f"step {r['step_time_s'] * 1e3:.1f} ms",
        f"data wait {r['data_wait_share'] * 100:.1f}%",
        f"{_fmt(r['samples_per_usd'], ',.0f')} samples/$",
        f"cpu {r['host_cpu_pct']:.0f}%",
    ]
    if r.get("mfu") is not None:
        parts.append(f"MFU {r['mfu'] * 100:.1f}%")
    if r.get("gpu_util_pct") is not None:
        parts.append(f"gpu {r['gpu_util_pct']:.0f}%")
    return " | ".join(parts)


def summary_table(s: Mapping[str, Any]) -> Table:
    table = Table(title="training summary (steady state: first interval left out)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("steps", str(s.get("steps"))),
        ("final loss", _fmt(s.get("final_loss"), ".4f")),
        ("samples/s (global)", _fmt(s.get("samples_per_s"), ",.1f")),
        ("step time", _fmt(s.get("step_time_s"), ".1f", 1e3, " ms")),
        ("data-wait share", _fmt(s.get("data_wait_share"), ".1f", 100, "%")),
        ("samples per USD", _fmt(s.get("samples_per_usd"), ",.0f")),
        ("cluster USD/hour", _fmt(s.get("cluster_usd_per_hour"), ".3f")),
        ("host CPU", _fmt(s.get("host_cpu_pct"), ".0f", 1, "%")),
        ("MFU", _fmt(s.get("mfu"), ".1f", 100, "%")),
        ("GPU utilisation", _fmt(s.get("gpu_util_pct"), ".0f", 1, "%")),
        ("stopped by", str(s.get("stopped_by", "-"))),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def plot(records: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Samples/s and data-wait share against the step, one panel each."""
    import matplotlib

    matplotlib.use("Agg")  # Files only: no display on training hosts.
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, [r["samples_per_s"] for r in records], marker=".")
    top.set_ylabel("samples/s (global)")
    top.grid(alpha=0.3)
    bottom.plot(steps, [r["data_wait_share"] * 100 for r in records], marker=".", color="C1")
    bottom.set_ylabel("data-wait share (%)")
    bottom.set_xlabel("step")
    bottom.set_ylim(bottom=0)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
