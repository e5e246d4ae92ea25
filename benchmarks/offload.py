"""``python -m benchmarks offload``: the offload speedup on two cores (the project's central claim).

The real trainer (``torchrun -m training.trainer``, ``OMP_NUM_THREADS=1``) is pinned to one core
in both configurations, with the same model, batch, precision and heavy recipe (RandAugment on
JPEG files decoded per sample):

A. homogeneous: the trainer's own DataLoader augments, its worker pinned to the same core;
B. heterogeneous: one ``hetero serve`` data server (one augmentation worker) pinned to the other
   core feeds the trainer through ``--data-servers``.

Steady-state samples/s and data-wait share come from each run's ``summary.json`` (the first
``--warmup`` steps are one metrics interval, which the trainer leaves out). Beside them, the
regime: the trainer's step on in-memory batches (``--synthetic-data``, same core) and the
augmentation of one batch on one core. Target: B/A >= 1.8 (2.0 is the two-core limit).
Prints a table and writes ``benchmarks/results/offload.json`` with the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.trainer_common import print_table, report, spec_data
from benchmarks.trainer_common import write_spec as write_spec_file
from training.data.augment import augment_samples
from training.data.datasets import SyntheticImages
from training.data.splits import build_dataset
from training.data.transforms import build_transform
from training.dataplane.processes import start_server_process
from training.planner.bench import pinned, thread_environ
from training.spec import load_spec

log = logging.getLogger(__name__)

TARGET = 1.8

# A ViT sized so that one core's training step on a 160 px batch costs about what RandAugment
# of that batch costs (the regime where offloading approaches 2x); measured, not assumed.
DEFAULT_MODEL = "vit_tiny_patch16_224"
DEFAULT_OVERRIDES = {"patch_size": 16, "depth": 2, "embed_dim": 64, "num_heads": 2}
QUICK_OVERRIDES = {"patch_size": 8, "depth": 1, "embed_dim": 32, "num_heads": 2}


NUM_CLASSES = 10


class BenchmarkError(RuntimeError):
    """A run could not be made or measured; the message says which and why."""


@dataclass(frozen=True)
class Settings:
    """One benchmark configuration (defaults: the full run; ``--quick``: the smoke test)."""

    model: str
    overrides: dict[str, Any]
    image_size: int
    batch_size: int
    steps: int
    """Timed steps per run, after the warm-up."""
    warmup: int
    """Steps in the first metrics interval, which the trainer's summary leaves out."""
    recipe: str
    trainer_core: int
    server_core: int
    timeout_s: float
    quick: bool = False
    """Smoke mode: also skips the train-step-alone run."""


def child_env() -> dict[str, str]:
    """One intra-op thread: the point is a host with one core per role."""
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def write_dataset(root: Path, num_images: int, num_classes: int, image_size: int) -> Path:
    """An ImageFolder of ``num_images`` JPEGs (the synthetic source's bytes, ~8/7 of the crop
    size), so both configurations read and decode real files."""
    source = SyntheticImages(num_images, num_classes, image_size)
    for c in range(num_classes):
        (root / f"class{c:03d}").mkdir(parents=True, exist_ok=True)
    for i in range(num_images):
        (root / f"class{source.label(i):03d}" / f"{i:06d}.jpg").write_bytes(source.read(i))
    return root


def write_spec(path: Path, s: Settings, dataset: Path, checkpoints: Path) -> Path:
    """The spec both configurations share."""
    return write_spec_file(path, spec_data(
        name="bench-offload", model=s.model, overrides=s.overrides, image_size=s.image_size,
        batch_size=s.batch_size, steps=s.warmup + s.steps, precision="fp32",
        log_every=s.warmup, dataprep={"count": 1},
        dataset={"source": "folder", "path": str(dataset), "num_classes": NUM_CLASSES},
        checkpoint={"dir": str(checkpoints)},
        job={"augmentation": s.recipe, "dataplane": {
            "prefetch_batches": 4, "chunk_batches": 2, "workers_per_server": 1,
        }},
    ))  # fmt: skip


def run_trainer(
    spec: Path, run_dir: Path, s: Settings, extra: Sequence[str] = ()
) -> dict[str, Any]:
    """``trainer_summary`` on ``s.trainer_core`` within ``s.timeout_s``."""
    return trainer_summary(spec, run_dir, s.trainer_core, s.timeout_s, extra)


def trainer_summary(
    spec: Path,
    run_dir: Path,
    core: int | None,
    timeout_s: float,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The real trainer entry point (one rank: without torchrun it makes its own single-process
    group, which spares a second torch import on the measured core), pinned to ``core`` (None:
    not pinned), in ``env`` (default ``child_env()``: one thread); returns its summary with
    ``cpu_s``, the process's user + system CPU-seconds. Its process group is killed if it
    overruns ``timeout_s``."""
    cmd = [sys.executable, "-m", "training.trainer", "--spec", str(spec), "--run-dir", str(run_dir)]
    # A checkpoint folder per run: a shared one would make the next run resume at the end.
    cmd += ["--checkpoint-dir", str(run_dir / "checkpoints"), "--log-level", "WARNING", *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    # Its children (DataLoader workers, the forkserver and its workers) inherit the mask.
    with pinned([core]) if core is not None else contextlib.nullcontext():
        proc = subprocess.Popen(
            cmd, env=child_env() if env is None else env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise BenchmarkError(
            f"trainer did not finish within {timeout_s:.0f} s (raise --timeout or lower "
            f"--steps): {' '.join(cmd)}\n{output[-3000:]}"
        ) from None
    summary_path = run_dir / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        raise BenchmarkError(
            f"trainer exited with code {proc.returncode}: {' '.join(cmd)}\n{output[-3000:]}"
        )
    # The child is reaped (communicate waited for it): its CPU time is in RUSAGE_CHILDREN.
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    summary: dict[str, Any] = json.loads(summary_path.read_text())
    summary["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if not summary.get("measured_steps"):
        raise BenchmarkError(
            f"{summary_path} has no steady-state steps; raise --steps:\n{json.dumps(summary)}"
        )
    return summary


def run_offloaded(spec: Path, run_dir: Path, s: Settings) -> dict[str, Any]:
    """Configuration B: a data server on ``s.server_core``, the trainer fed by it."""
    # start_server_process passes this process's environment on: set one thread for its start.
    with pinned([s.server_core]), thread_environ(1):
        server = start_server_process(spec, workers=1, timeout_s=s.timeout_s)
    try:
        summary = run_trainer(spec, run_dir, s, ["--data-servers", server.address])
    finally:
        # The trainer sends Shutdown at job end; stop() only waits (or, after a failure, kills).
        code = server.stop(timeout_s=10.0)
        if code != 0:
            log.warning("data server %s exited with code %s", server.address, code)
    return summary


def augment_cost_s(spec: Path, s: Settings, batches: int) -> float:
    """CPU seconds to read, decode and augment one batch on one core, in this process."""
    import torch

    job = load_spec(spec).job
    source = build_dataset(job.dataset)
    transform = build_transform(job.augmentation, job.dataset.image_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pinned([s.trainer_core]):
            augment_samples(source, transform, range(s.batch_size), s.image_size)  # warm-up
            start = time.process_time()
            for b in range(batches):
                lo = (b * s.batch_size) % max(len(source) - s.batch_size, 1)
                augment_samples(source, transform, range(lo, lo + s.batch_size), s.image_size)
            return (time.process_time() - start) / batches
    finally:
        torch.set_num_threads(threads)


class CpuWindow:
    """Per-core busy share over a run (psutil), to show where the work went."""

    def __init__(self, cores: Sequence[int]) -> None:
        import psutil

        self._psutil = psutil
        self.cores = list(cores)
        self._start = psutil.cpu_times(percpu=True)

    def busy_pct(self) -> dict[str, float]:
        end = self._psutil.cpu_times(percpu=True)
        out = {}
        for c in self.cores:
            a, b = self._start[c], end[c]
            total = sum(b) - sum(a)
            idle = (b.idle + getattr(b, "iowait", 0.0)) - (a.idle + getattr(a, "iowait", 0.0))
            out[f"core{c}"] = 100.0 * (1 - idle / total) if total > 0 else 0.0
        return out


def _row(summary: dict[str, Any], cpu: dict[str, float]) -> dict[str, Any]:
    return {
        "samples_per_s": float(summary["samples_per_s"]),
        "step_time_s": float(summary["step_time_s"]),
        "data_wait_share": summary.get("data_wait_share"),
        "measured_steps": int(summary["measured_steps"]),
        "cpu_busy_pct": cpu,
    }


def run(s: Settings) -> dict[str, Any]:
    """Regime (train step alone, augmentation alone), then A and B; the result dictionary."""
    cores = sorted(os.sched_getaffinity(0))
    if s.trainer_core == s.server_core or not {s.trainer_core, s.server_core} <= set(cores):
        raise BenchmarkError(
            f"--trainer-core {s.trainer_core} and --server-core {s.server_core} must be two "
            f"different cores this process may use: {cores}"
        )
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-offload-") as tmp:
        work = Path(tmp)
        # One epoch covers the run, so neither configuration pays an epoch boundary.
        images = (s.warmup + s.steps + 2) * s.batch_size
        dataset = write_dataset(work / "images", images, NUM_CLASSES, s.image_size)
        spec = write_spec(work / "spec.toml", s, dataset, work / "checkpoints")
        aug_s = augment_cost_s(spec, s, batches=max(2, s.steps // 4))
        print(f"augmentation: {aug_s * 1e3:.1f} CPU-ms per batch", flush=True)
        train: dict[str, Any] | None = None
        if not s.quick:  # the smoke test spares itself a third trainer start
            train = run_trainer(spec, work / "train-only", s, ["--synthetic-data"])
            print(f"train step alone: {train['step_time_s'] * 1e3:.1f} ms", flush=True)
        cpu = CpuWindow([s.trainer_core, s.server_core])
        local = _row(run_trainer(spec, work / "local", s), cpu.busy_pct())
        print(f"A local: {local['samples_per_s']:.1f} samples/s", flush=True)
        cpu = CpuWindow([s.trainer_core, s.server_core])
        offloaded = _row(run_offloaded(spec, work / "offloaded", s), cpu.busy_pct())
        print(f"B offloaded: {offloaded['samples_per_s']:.1f} samples/s", flush=True)
    speedup = offloaded["samples_per_s"] / local["samples_per_s"]
    return {
        "settings": {k: v for k, v in vars(s).items()},
        "load_average_before": list(load),
        "load_average_after": list(os.getloadavg()),
        "regime": {
            "train_step_s": None if train is None else float(train["step_time_s"]),
            "augment_batch_cpu_s": aug_s,
            "augment_over_train": None if train is None else aug_s / float(train["step_time_s"]),
            "train_only_samples_per_s": None if train is None else float(train["samples_per_s"]),
        },
        "local": local,
        "offloaded": offloaded,
        "speedup": speedup,
        "target": TARGET,
        "meets_target": speedup >= TARGET,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="smoke mode: tiny model, a few steps")
    p.add_argument("--model", help=f"timm name or trainer preset (default {DEFAULT_MODEL})")
    p.add_argument("--overrides", help="timm keyword overrides as JSON (default: a 2-block ViT)")
    p.add_argument("--image-size", type=int, help="crop size (default 160; quick 32)")
    p.add_argument("--batch-size", type=int, help="per step (default 32; quick 8)")
    p.add_argument("--steps", type=int, help="timed steps per run (default 40; quick 3)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 8; quick 1)")
    p.add_argument("--recipe", default="randaugment", choices=["randaugment", "standard"])
    p.add_argument("--trainer-core", type=int, default=0)
    p.add_argument("--server-core", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per process")


def settings_from(args: argparse.Namespace) -> Settings:
    """Settings from the flags, ``--quick`` choosing the small defaults; bad values raise
    ``BenchmarkError`` naming the flag."""
    quick = bool(args.quick)
    try:
        overrides = json.loads(args.overrides) if args.overrides else None
    except json.JSONDecodeError as e:
        raise BenchmarkError(f"--overrides is not JSON ({e}); e.g. '{{\"depth\": 2}}'") from e
    if overrides is not None and not isinstance(overrides, dict):
        raise BenchmarkError("--overrides must be a JSON object, e.g. '{\"depth\": 2}'")
    s = Settings(
        model=args.model or DEFAULT_MODEL,
        overrides=overrides if overrides is not None else
        dict(QUICK_OVERRIDES if quick else DEFAULT_OVERRIDES),
        image_size=args.image_size or (32 if quick else 160),
        batch_size=args.batch_size or (8 if quick else 32),
        steps=args.steps or (3 if quick else 40),
        warmup=args.warmup or (1 if quick else 8),
        recipe=args.recipe,
        trainer_core=args.trainer_core,
        server_core=args.server_core,
        timeout_s=args.timeout,
        quick=quick,
    )  # fmt: skip
    for flag, value in (("--batch-size", s.batch_size), ("--steps", s.steps),
                        ("--warmup", s.warmup)):  # fmt: skip
        if value < 1:
            raise BenchmarkError(f"{flag} must be at least 1, got {value}")
    return s


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks offload", description=__doc__)
    add_arguments(parser)
    try:
        result = run(settings_from(parser.parse_args(argv)))
    except BenchmarkError as e:
        print(f"offload benchmark: {e}", file=sys.stderr)
        return 2
    reg = result["regime"]
    rows = [
        (
            name,
            f"{row['samples_per_s']:.1f}",
            f"{row['step_time_s'] * 1e3:.1f}",
            "-" if row["data_wait_share"] is None else f"{row['data_wait_share']:.2f}",
            " / ".join(f"{v:.0f}" for v in row["cpu_busy_pct"].values()),
        )
        for name, row in (
            ("A local DataLoader", result["local"]),
            ("B data server, other core", result["offloaded"]),
        )
    ]
    print_table(
        "offload speedup: trainer on one core, augmentation local vs offloaded",
        (
            "configuration",
            "samples/s",
            "step ms",
            "data-wait share",
            "busy % (trainer/server core)",
        ),
        rows,
    )
    aug_ms = reg["augment_batch_cpu_s"] * 1e3
    if reg["train_step_s"] is None:
        print(f"regime: augmentation {aug_ms:.1f} CPU-ms/batch (train step alone: not run)")
    else:
        print(
            f"regime: train step alone {reg['train_step_s'] * 1e3:.1f} ms/batch, augmentation "
            f"{aug_ms:.1f} CPU-ms/batch (ratio {reg['augment_over_train']:.2f})"
        )
    print(f"load average before/after: {result['load_average_before'][0]:.2f} / "
          f"{result['load_average_after'][0]:.2f}")  # fmt: skip
    return report("offload", result, {k: result[k] for k in ("speedup", "meets_target")})


if __name__ == "__main__":
    raise SystemExit(main())
