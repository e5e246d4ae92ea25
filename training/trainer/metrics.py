"""Training metrics, computed in one place and sent to the console, JSON lines and a plot.

Every ``log_every_steps`` steps (and at the end) the loop hands an interval's counters to
``MetricsLogger.log``; rank 0 writes one JSON object per line to ``<run_dir>/metrics.jsonl``,
prints a progress line, and at the end prints a summary table, writes ``summary.json`` and
plots samples/s and data-wait share to ``metrics.png``. Where enabled (``emf_cluster``: on the
stack's instances), rank 0 also prints each interval as a CloudWatch Embedded Metric Format line
on stdout (``training.trainer.emf``), which CloudWatch Logs turns into metrics.

Validation results (``MetricsLogger.log_eval``) go to the same places: a record with
``"kind": "eval"`` in ``metrics.jsonl`` (interval records have no ``kind``; ``summarise`` and
``plot`` keep the two apart), a console line, an EMF line, ``<run_dir>/last_eval.json`` (the
last one, read by the EC2 launcher's heartbeat for ``hetero status``), an ``accuracy`` section
in ``summary.json`` (``accuracy_summary``: the step, samples, wall time and USD at which top-1
first reached each of ``job.accuracy_targets``), rows of the summary table and panels of
``metrics.png``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch
from rich.console import Console
from rich.table import Table

from training.common.files import write_atomically
from training.common.names import LAST_EVAL_FILE
from training.trainer.emf import emf_document, eval_emf_document, write_emf
from training.trainer.tensorboard_log import TensorBoardLog

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

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
    return next((flops for key, flops in PEAK_FLOPS if key in device_name), None)


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
    grad_norm_sum: float = 0.0
    """Total gradient norms (before clipping) of the applied steps."""
    grad_norm_max: float | None = None
    skipped: int = 0
    """Steps skipped for a non-finite loss or gradient norm (``training.trainer.nonfinite``)."""

    @property
    def applied(self) -> int:
        """Steps whose update was applied."""
        return self.steps - self.skipped

    def add_grad_norm(self, norm: float) -> None:
        """One applied step's total gradient norm before clipping."""
        self.grad_norm_sum += norm
        self.grad_norm_max = norm if self.grad_norm_max is None else max(self.grad_norm_max, norm)

    def reset(self) -> None:
        self.started = time.perf_counter()
        self.steps = 0
        self.data_wait_s = 0.0
        self.loss_sum = 0.0
        self.checkpoint_s = 0.0
        self.grad_norm_sum = 0.0
        self.grad_norm_max = None
        self.skipped = 0


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
    accuracy_targets: tuple[float, ...] = ()
    """``job.accuracy_targets``: validation top-1 shares in (0, 1], sorted."""


EVAL_KIND = "eval"
UNREADABLE_SHOWN = 10
"""Unreadable samples the summary table names."""
"""``metrics.jsonl``'s ``kind`` of a validation record; interval records have no ``kind``."""


def is_eval(record: Mapping[str, Any]) -> bool:
    """True for a validation record of ``metrics.jsonl``, False for an interval record."""
    return record.get("kind") == EVAL_KIND


@dataclass(frozen=True)
class EvalScores:
    """Validation figures of one set of weights: top-1 and top-5 as shares in 0..1, mean loss."""

    top1: float
    top5: float
    loss: float


@dataclass(frozen=True)
class EvalResult:
    """One pass over the whole validation set (already reduced over ranks)."""

    top1: float
    top5: float
    loss: float
    samples: int
    """Validation images evaluated."""
    eval_s: float
    """Seconds the pass took (never counted as step time or data wait)."""
    ema: EvalScores | None = None
    """The EMA weights' figures, when the job keeps EMA weights."""


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
        tensorboard: TensorBoardLog | None = None,
    ) -> None:
        """``emf_cluster``: print EMF lines with this ``Cluster`` dimension (rank 0 only);
        None: none. ``tensorboard``: rank 0's event files (``tensorboard_log``), given a copy of
        every record."""
        self.tensorboard = tensorboard if rank == 0 else None
        self.run_dir = run_dir
        self.facts = facts
        self.rank = rank
        self.emf_cluster = emf_cluster
        self.records: list[dict[str, Any]] = []
        """Interval records (no ``kind``)."""
        self.evals: list[dict[str, Any]] = []
        """Validation records (``"kind": "eval"``)."""
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
        extra: Mapping[str, Any] | None = None,
        lrs: Sequence[float] = (),
    ) -> dict[str, Any]:
        """Record one interval (``loss``, over its applied steps, and ``data_wait_share``
        already averaged over ranks; ``interval``'s gradient norms and skipped steps as they are;
        ``checkpoint_age_s``: seconds since the newest durable checkpoint, None if none;
        ``extra``: more fields, e.g. the data tier's ``data_servers`` and
        ``data_servers_target``; ``lrs``: each param group's learning rate, for TensorBoard, where
        the groups run at scales of their own (layer decay), else none)."""
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
            # Over the interval's applied steps (the same on every rank); None without one.
            "grad_norm": (
                interval.grad_norm_sum / interval.applied
                if interval.grad_norm_max is not None
                else None
            ),
            "grad_norm_max": interval.grad_norm_max,
            "nonfinite_steps": interval.skipped,
        }
        record.update(extra or {})
        if self._device.type == "cuda":
            record["gpu_mem_peak_gib"] = torch.cuda.max_memory_allocated(self._device) / 2**30
        self.records.append(record)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            last_top1 = self.evals[-1]["top1"] if self.evals else None
            self._console.print(
                progress_line(record, self.facts.total_steps, last_top1=last_top1),
                highlight=False,
            )
        if self.rank == 0 and self.emf_cluster is not None:
            _write_emf(emf_document(record, cluster=self.emf_cluster), "metrics")
        if self.tensorboard is not None:
            self.tensorboard.train(record, lrs)
        return record

    def log_eval(
        self, step: int, result: EvalResult, *, samples_seen: int, train_wall_s: float
    ) -> None:
        """Record one validation pass at optimizer step ``step``: ``samples_seen`` training
        samples so far, ``train_wall_s`` training wall time so far (evaluation excluded). Rank 0
        writes the record, prints a line (and an EMF line where enabled) and replaces
        ``last_eval.json``; every rank keeps the record for the summary, as ``log`` does."""
        price = self.facts.cluster_usd_per_hour
        record: dict[str, Any] = {
            "kind": EVAL_KIND,
            "time": time.time(),
            "step": step,
            "top1": result.top1,
            "top5": result.top5,
            "val_loss": result.loss,
            "val_samples": result.samples,
            "eval_s": result.eval_s,
            "samples": samples_seen,
            "wall_s": train_wall_s,
            "usd": price * train_wall_s / 3600.0 if price > 0 else None,
        }
        if result.ema is not None:
            record["ema_top1"] = result.ema.top1
            record["ema_top5"] = result.ema.top5
            record["ema_val_loss"] = result.ema.loss
        self.evals.append(record)
        if self.rank != 0:
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
        self._console.print(eval_line(record), highlight=False, soft_wrap=True)
        accuracy = accuracy_summary(self.evals, self.facts.accuracy_targets)
        reached = [t["target"] for t in (accuracy or {}).get("targets", []) if t["reached"]]
        if self.tensorboard is not None:
            self.tensorboard.validation(record, reached)
        try:
            write_atomically(
                self.run_dir / LAST_EVAL_FILE,
                json.dumps({**record, "targets_reached": reached}) + "\n",
            )
        except OSError as e:
            log.warning("%s not written: %s", LAST_EVAL_FILE, e)
        if self.emf_cluster is not None:
            _write_emf(eval_emf_document(record, cluster=self.emf_cluster), "validation")

    def _mfu(self, samples_per_s: float) -> float | None:
        f, peak = self.facts.flops_per_sample, self.facts.peak_flops_per_rank
        if f is None or peak is None:
            return None
        return samples_per_s * f / (peak * self.facts.world_size)

    def finish(self, extra: Mapping[str, Any]) -> dict[str, Any]:
        """Write ``summary.json`` and ``metrics.png`` and print the table (rank 0); returns the
        summary on every rank."""
        summary = summarise(self.records)
        accuracy = accuracy_summary(self.evals, self.facts.accuracy_targets)
        if accuracy is not None:
            summary["accuracy"] = accuracy
        summary.update(extra)
        if self.rank == 0:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            if self.records or self.evals:
                plot(
                    [*self.records, *self.evals],
                    self.run_dir / "metrics.png",
                    targets=self.facts.accuracy_targets,
                )
            self._console.print(summary_table(summary))
            for line in unreadable_lines(summary.get("unreadable")):
                self._console.print(line, markup=False, highlight=False, soft_wrap=True)
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self.tensorboard is not None:
            self.tensorboard.close()
        return summary


def _write_emf(document: dict[str, Any] | None, what: str) -> None:
    try:
        if document is not None:
            write_emf(document)
    except OSError as e:  # A closed stdout costs the metric line, never the run.
        log.warning("EMF %s line not written: %s", what, e)


def _mean(values: Sequence[float | None], weights: Sequence[float]) -> float | None:
    pairs = [(v, w) for v, w in zip(values, weights, strict=True) if v is not None]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if pairs and total > 0 else None


def summarise(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Step-weighted averages over the run, leaving out the first interval (warm-up: compile,
    allocator, first batches) when there are others. Validation records are ignored."""
    records = [r for r in records if not is_eval(r)]
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


def _better(r: Mapping[str, Any]) -> tuple[str, float, float, float]:
    """(weights, top1, top5, val_loss) of the better weights of validation record ``r``: the
    EMA's when its top-1 is higher than the raw weights', else the raw weights'."""
    ema = r.get("ema_top1")
    return _ema(r) if ema is not None and ema > r["top1"] else _raw(r)


def _when(r: Mapping[str, Any]) -> dict[str, Any]:
    return {"step": r["step"], "samples": r["samples"], "wall_s": r["wall_s"], "usd": r["usd"]}


def _point(r: Mapping[str, Any], scores: tuple[str, float, float, float]) -> dict[str, Any]:
    weights, top1, top5, loss = scores
    return {"top1": top1, "top5": top5, "val_loss": loss, "weights": weights, **_when(r)}


def _ema(r: Mapping[str, Any]) -> tuple[str, float, float, float]:
    return "ema", float(r["ema_top1"]), float(r["ema_top5"]), float(r["ema_val_loss"])


def _raw(r: Mapping[str, Any]) -> tuple[str, float, float, float]:
    return "raw", float(r["top1"]), float(r["top5"]), float(r["val_loss"])


def accuracy_summary(
    records: Sequence[Mapping[str, Any]], targets: Sequence[float] = ()
) -> dict[str, Any] | None:
    """``summary.json``'s ``accuracy`` section from the validation records among ``records``
    (None without any). Each evaluation counts with its better weights (``_better``: the EMA's
    when its top-1 is higher), named in ``weights``:

    - ``targets``: per target, ``reached`` and, when reached, the first evaluation whose top-1
      is at least the target (``step``, ``samples``, ``wall_s``, ``usd``, ``weights``);
    - ``best``: the evaluation with the highest top-1 (the first of equals);
    - ``final``: the last evaluation, raw weights;
    - ``ema_best`` / ``ema_final`` (only with EMA): the same for the EMA weights alone.
    """
    evals = [r for r in records if is_eval(r)]
    if not evals:
        return None
    better = [_better(r) for r in evals]
    reached: list[dict[str, Any]] = []
    for target in targets:
        first = next((i for i, b in enumerate(better) if b[1] >= target), None)
        if first is None:
            reached.append({"target": target, "reached": False})
        else:
            when = _when(evals[first])
            reached.append({"target": target, "reached": True, **when, "weights": better[first][0]})
    best = max(range(len(evals)), key=lambda i: better[i][1])  # max keeps the first of equals
    out: dict[str, Any] = {
        "metric": "top1",
        "targets": reached,
        "best": _point(evals[best], better[best]),
        "final": _point(evals[-1], _raw(evals[-1])),
    }
    with_ema = [r for r in evals if r.get("ema_top1") is not None]
    if with_ema:
        ema_best = max(with_ema, key=lambda r: float(r["ema_top1"]))
        out["ema_best"] = _point(ema_best, _ema(ema_best))
        out["ema_final"] = _point(with_ema[-1], _ema(with_ema[-1]))
    return out


def _fmt(value: Any, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value * scale:{spec}}{suffix}"


def _pct(share: float) -> str:
    return f"{share * 100:.1f} %"


def eval_line(r: Mapping[str, Any]) -> str:
    """One console line per validation record, e.g. ``eval step 120: top-1 81.2 %, top-5
    97.0 %, loss 0.6200 (EMA top-1 82.0 %) over 360 images in 1.4 s``."""
    ema = f" (EMA top-1 {_pct(r['ema_top1'])})" if r.get("ema_top1") is not None else ""
    return (
        f"eval step {r['step']}: top-1 {_pct(r['top1'])}, top-5 {_pct(r['top5'])}, "
        f"loss {r['val_loss']:.4f}{ema} over {r['val_samples']:,} images in {r['eval_s']:.1f} s"
    )


def progress_line(
    r: Mapping[str, Any], total_steps: int | None, *, last_top1: float | None = None
) -> str:
    """One console line per interval; ``last_top1``: the last validation top-1, if any."""
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
    if r.get("grad_norm") is not None:
        parts.append(f"grad norm {r['grad_norm']:.3g}")
    if r.get("nonfinite_steps"):
        parts.append(f"{r['nonfinite_steps']} non-finite step(s) skipped")
    if r.get("mfu") is not None:
        parts.append(f"MFU {r['mfu'] * 100:.1f}%")
    if r.get("gpu_util_pct") is not None:
        parts.append(f"gpu {r['gpu_util_pct']:.0f}%")
    if last_top1 is not None:
        parts.append(f"val top-1 {last_top1 * 100:.1f}%")
    return " | ".join(parts)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _by(weights: str) -> str:
    return " (EMA)" if weights == "ema" else ""


def target_label(target: float) -> str:
    """``top-1 >= 80 %`` for 0.8."""
    return f"top-1 >= {target * 100:.4g} %"


def accuracy_rows(accuracy: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The summary table's rows for ``summary.json``'s ``accuracy`` section."""
    rows: list[tuple[str, str]] = []
    for prefix, key in (("final", "final"), ("EMA final", "ema_final")):
        p = accuracy.get(key)
        if p is None:
            continue
        rows.append(
            (f"{prefix} top-1 / top-5", f"{_pct(p['top1'])} / {_pct(p['top5'])} (step {p['step']})")
        )
        rows.append((f"{prefix} val loss", _fmt(p["val_loss"], ".4f")))
    best = accuracy["best"]
    rows.append(
        ("best top-1", f"{_pct(best['top1'])} at step {best['step']}{_by(best['weights'])}")
    )
    for t in accuracy["targets"]:
        if not t["reached"]:
            rows.append((target_label(t["target"]), "not reached"))
            continue
        parts = [f"step {t['step']}", _duration(t["wall_s"]), f"{t['samples']:,} samples"]
        if t.get("usd") is not None:
            parts.append(f"{t['usd']:,.3f} USD")
        rows.append((target_label(t["target"]), ", ".join(parts) + _by(t["weights"])))
    return rows


def unreadable_lines(unreadable: Mapping[str, Any] | None) -> list[str]:
    """The training samples left out as unreadable, printed under the summary table whole
    (paths are long): each by name with its reason, the first ``UNREADABLE_SHOWN``
    (summary.json lists more)."""
    if not unreadable or not unreadable["count"]:
        return []
    count, listed = unreadable["count"], unreadable["samples"]
    lines = [f"left out {count} unreadable training sample(s):"]
    lines += [f"  {u['name']}: {u['reason']}" for u in listed[:UNREADABLE_SHOWN]]
    if count > UNREADABLE_SHOWN:
        lines.append(f"  ... and {count - UNREADABLE_SHOWN} more (summary.json's unreadable)")
    return lines


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
    if s.get("accuracy"):
        rows.extend(accuracy_rows(s["accuracy"]))
    if s.get("unreadable") is not None:
        rows.append(("unreadable samples", f"{s['unreadable']['count']} (left out)"))
    for name, value in rows:
        table.add_row(name, value)
    return table


def figure(records: Sequence[Mapping[str, Any]], targets: Sequence[float] = ()) -> Figure:
    """The metrics figure: samples/s and data-wait share against the step; with validation
    records among ``records`` also validation top-1 against the step and against USD, each
    target a dotted line."""
    import matplotlib

    matplotlib.use("Agg")  # Files only: no display on training hosts.
    import matplotlib.pyplot as plt

    train = [r for r in records if not is_eval(r)]
    evals = [r for r in records if is_eval(r)]
    steps = [r["step"] for r in train]
    if not evals:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    else:
        fig, (top, bottom, by_step, by_usd) = plt.subplots(4, 1, figsize=(8, 12))
        bottom.sharex(top)
        by_step.sharex(top)
    top.plot(steps, [r["samples_per_s"] for r in train], marker=".")
    top.set_ylabel("samples/s (global)")
    top.grid(alpha=0.3)
    bottom.plot(steps, [r["data_wait_share"] * 100 for r in train], marker=".", color="C1")
    bottom.set_ylabel("data-wait share (%)")
    bottom.set_xlabel("step")
    bottom.set_ylim(bottom=0)
    bottom.grid(alpha=0.3)
    if evals:
        top.tick_params(labelbottom=False)
        bottom.tick_params(labelbottom=False)
        bottom.set_xlabel("")
        _accuracy_panel(by_step, evals, "step", targets)
        by_step.set_xlabel("step")
        priced = [r for r in evals if r.get("usd") is not None]
        _accuracy_panel(by_usd, priced, "usd", targets)
        by_usd.set_xlabel("USD (cluster price x training wall time)")
        if not priced:
            by_usd.text(0.5, 0.5, "no price: USD unknown", ha="center", transform=by_usd.transAxes)
    fig.tight_layout()
    return fig


def _accuracy_panel(
    ax: Axes, evals: Sequence[Mapping[str, Any]], x: str, targets: Sequence[float]
) -> None:
    xs = [r[x] for r in evals]
    ax.plot(xs, [r["top1"] * 100 for r in evals], marker="o", color="C2", label="top-1")
    ema = [r for r in evals if r.get("ema_top1") is not None]
    if ema:
        ax.plot(
            [r[x] for r in ema], [r["ema_top1"] * 100 for r in ema],
            marker="o", linestyle="--", color="C4", label="top-1, EMA weights",
        )  # fmt: skip
    for i, target in enumerate(targets):
        ax.axhline(
            target * 100, linestyle=":", color="grey",
            label="accuracy targets" if i == 0 else None,
        )  # fmt: skip
    ax.set_ylabel("validation top-1 (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")


def plot(
    records: Sequence[Mapping[str, Any]], path: Path, *, targets: Sequence[float] = ()
) -> None:
    """Write ``figure(records, targets)`` to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    fig = figure(records, targets)
    fig.savefig(path, dpi=100)
    plt.close(fig)
