"""GPU throughput: ViT-B/16 bf16 through our Trainer against a bare timm + torch loop.

Four configurations, each in a child process of its own (a clean allocator, an out-of-memory
that ends only that child, and one compiled graph per batch shape): ``compile`` off and on
(each transformer block compiled, as ``job.compile`` does), at batch 256 and at the largest
batch that fits. The largest is predicted from the batch-256 run's peak memory (per-image
activations over what the card has left after the weights, gradients and AdamW state),
rounded down to a multiple of 64 and stepped down by 64 on out-of-memory.

In each child, runs alternate (bare, trainer, bare, trainer, ...) so that drifting clocks hit
both alike; the ratio trainer / bare is the median over the rounds, as ``trainer_overhead``
does on the CPU. The bare loop keeps its one batch in page-locked memory (its best case); at
batch 256 without compile it also runs from pageable memory, which shows what the copy costs
when it is not asynchronous. MFU counts 105 GFLOP per training image at 224 px (forward +
backward; torch's FlopCounterMode gives 105.15e9 for vit_base_patch16_224) against the peak
bf16 table in ``training.trainer.metrics``. Memory is ``torch.cuda.max_memory_allocated``.

The measured rate of the default configuration (batch 256, compile off) goes into the
planner's results store (``throughput.json``), keyed by the GPU model, so ``hetero plan``
uses it for that GPU and calibrates the MFU of the others on it.

Usage: ``python -m benchmarks trainer_gpu`` (``--quick``: a small model for a smoke run;
``--device cpu`` runs anywhere, for the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.trainer_common import bench_spec, print_table, report, trainer_run, write_result
from benchmarks.trainer_overhead import RECIPES, bare_loop
from training.data.batch import Batch
from training.planner.bench import TrainerFigure, common_fields, gpu_model, merge, trainer_record
from training.planner.results import THROUGHPUT_FILE, read_throughput
from training.trainer.config import ModelConfig, TrainerConfig
from training.trainer.evaluate import evaluate
from training.trainer.metrics import peak_flops
from training.trainer.model import build_model, training_flops_per_sample
from training.trainer.stream import to_device

FLOPS_PER_IMAGE_224 = 105e9
TARGET_H100 = 3000.0
TARGET_RATIO = 0.95
RESULT_PREFIX = "RESULT "
OOM_EXIT = 3
BATCH_STEP = 64
MEMORY_HEADROOM = 0.88
"""Share of the card's memory the predicted largest batch may plan to use."""


# ------------------------------------------------------------------------------------------
# One configuration (the child process).


def _spec(args: argparse.Namespace, batch_size: int, compile: bool) -> Any:
    return bench_spec(
        model=args.model, image_size=args.image_size, batch_size=batch_size,
        steps=args.warmup + args.steps, precision=args.precision, log_every=args.warmup,
        job={**RECIPES["off"], "compile": compile},
    )  # fmt: skip


def _peak_reset() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak() -> int | None:
    import torch

    return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None


def trainer_figures(spec: Any, work: Path) -> dict[str, Any]:
    """One run of the Trainer on in-memory synthetic batches: its steady-state figures and
    its peak GPU memory from the model's construction on."""
    _peak_reset()
    s = trainer_run(spec, work)
    memory = (s.get("memory_per_rank") or [{}])[0]
    return {
        "samples_per_s": float(s["samples_per_s"]),
        "step_time_s": float(s["step_time_s"]),
        "measured_steps": int(s["measured_steps"]),
        "gpu_util_pct": s.get("gpu_util_pct"),
        "data_wait_share": s.get("data_wait_share"),
        "peak_bytes": _peak(),
        "state_bytes": sum(
            memory.get(k, 0) for k in ("param_bytes", "grad_bytes", "optimizer_bytes")
        ),
    }


def eval_rate(spec: Any, batches: int) -> float:
    """Images/s of the trainer's validation pass (``training.trainer.evaluate``: eval mode, no
    gradients, bf16 autocast on a GPU) over ``batches`` in-memory batches, after one batch of
    warm-up."""
    import torch

    config = TrainerConfig.from_spec(spec, run_dir=".", synthetic=True)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = build_model(config.model, seed=0).to(device)
    size, b = config.model.image_size, config.batch_size
    batch = Batch(
        images=torch.randint(0, 256, (b, 3, size, size), dtype=torch.uint8),
        labels=torch.randint(0, config.model.num_classes, (b,)),
        sample_ids=torch.arange(b),
    )

    def normalise(images: torch.Tensor) -> torch.Tensor:
        return to_device(images, device).float().div_(255)

    def score(n: int) -> None:
        evaluate(model, [batch] * n, passes=n, normalise=normalise, device=device,
                 autocast=cuda and config.bf16, image_size=size)  # fmt: skip

    score(1)
    started = time.perf_counter()
    score(batches)  # ends in a .tolist(): the device is synchronised
    return b * batches / (time.perf_counter() - started)


def measure_one(args: argparse.Namespace) -> dict[str, Any]:
    """``args.rounds`` interleaved rounds of the bare loop and the Trainer at one batch size
    and compile setting (raises torch.OutOfMemoryError when the batch does not fit)."""
    compile = args.compile == "on"
    spec = _spec(args, args.batch_size, compile)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        for i in range(args.rounds):
            _peak_reset()
            bare = bare_loop(spec, args.steps, args.warmup, pinned=True)
            bare_peak = _peak()
            pageable = None
            if args.pageable and i == 0:
                pageable = bare_loop(spec, args.steps, args.warmup, pinned=False)
            ours = trainer_figures(spec, Path(tmp) / f"r{i}")
            rounds.append({
                "bare": bare, "bare_pageable": pageable, "bare_peak_bytes": bare_peak,
                "trainer": ours, "ratio": ours["samples_per_s"] / bare,
            })  # fmt: skip
            print(
                f"  round {i + 1}: bare {bare:,.1f}"
                + (f" (pageable {pageable:,.1f})" if pageable else "")
                + f", trainer {ours['samples_per_s']:,.1f} images/s",
                file=sys.stderr, flush=True,
            )  # fmt: skip
    evaluated = eval_rate(spec, args.eval_batches) if args.eval_batches else None
    best = max(rounds, key=lambda r: r["trainer"]["samples_per_s"])
    pageables = [r["bare_pageable"] for r in rounds if r["bare_pageable"]]
    return {
        "batch_size": args.batch_size,
        "compile": compile,
        "rounds": rounds,
        "bare_samples_per_s": statistics.median(r["bare"] for r in rounds),
        "bare_pageable_samples_per_s": statistics.median(pageables) if pageables else None,
        "trainer_samples_per_s": statistics.median(r["trainer"]["samples_per_s"] for r in rounds),
        "ratio": statistics.median(r["ratio"] for r in rounds),
        "trainer_peak_bytes": best["trainer"]["peak_bytes"],
        "bare_peak_bytes": best["bare_peak_bytes"],
        "state_bytes": best["trainer"]["state_bytes"],
        "gpu_util_pct": best["trainer"]["gpu_util_pct"],
        "step_time_s": statistics.median(r["trainer"]["step_time_s"] for r in rounds),
        "eval_images_per_s": evaluated,
    }


def child_main(args: argparse.Namespace) -> int:
    import torch

    try:
        result = measure_one(args)
    except torch.OutOfMemoryError as e:
        print(f"out of memory at batch {args.batch_size}: {str(e)[:200]}", file=sys.stderr)
        return OOM_EXIT
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


# ------------------------------------------------------------------------------------------
# The orchestrator.


def _child_args(args: argparse.Namespace, batch: int, compile: bool, first: bool) -> list[str]:
    out = [
        "--one", "--model", args.model, "--image-size", str(args.image_size),
        "--batch-size", str(batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--rounds", str(args.rounds), "--precision", args.precision,
        "--compile", "on" if compile else "off", "--device", args.device,
    ]  # fmt: skip
    # The first configuration also times the bare loop from pageable memory and validation.
    if first:
        return [*out, "--pageable", "--eval-batches", str(args.eval_batches)]
    return [*out, "--eval-batches", "0"]


def run_child(
    args: argparse.Namespace, batch: int, compile: bool, first: bool = False
) -> dict[str, Any] | None:
    """One configuration in a child process; None when the batch does not fit."""
    cmd = [sys.executable, "-m", "benchmarks", "trainer_gpu",
           *_child_args(args, batch, compile, first)]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    label = f"batch {batch}, compile {'on' if compile else 'off'}"
    print(f"{label} ...", flush=True)
    started = time.perf_counter()
    proc = subprocess.run(
        cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=args.timeout, check=False
    )
    if proc.returncode == OOM_EXIT:
        print(f"  {label}: out of memory ({time.perf_counter() - started:.0f} s)", flush=True)
        return None
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{label} failed with exit code {proc.returncode}: {' '.join(cmd)}")
    result: dict[str, Any] = json.loads(lines[-1][len(RESULT_PREFIX) :])
    result["wall_s"] = time.perf_counter() - started
    return result


def predicted_largest(r256: dict[str, Any], total_bytes: int, batch: int) -> int:
    """The largest batch (a multiple of 64) whose activations fit beside the training state,
    from one run's peak memory at ``batch``."""
    state = int(r256["state_bytes"])
    per_image = max(1.0, (int(r256["trainer_peak_bytes"]) - state) / batch)
    fits = (total_bytes * MEMORY_HEADROOM - state) / per_image
    return max(batch, int(fits // BATCH_STEP) * BATCH_STEP)


def largest_fitting(
    args: argparse.Namespace, compile: bool, start: int, floor: int
) -> dict[str, Any] | None:
    """From ``start`` down by 64 (three tries at most) to the first batch that fits."""
    batch = start
    for _ in range(3):
        if batch <= floor:
            return None
        result = run_child(args, batch, compile)
        if result is not None:
            return result
        batch -= BATCH_STEP
    return None


def _mfu(samples_per_s: float, flops: float, peak: float | None) -> float | None:
    return samples_per_s * flops / peak if peak else None


def run(
    args: argparse.Namespace, save: Callable[[dict[str, Any]], None] = lambda _: None
) -> dict[str, Any]:
    """Every configuration, the largest batch predicted from the first; ``save`` gets the
    result so far after each configuration (a run cut short keeps what it measured)."""
    import torch

    cuda = torch.cuda.is_available() and args.device == "cuda"
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    total = torch.cuda.get_device_properties(0).total_memory if cuda else 0
    peak = peak_flops(name) if cuda else None
    if (args.model, args.image_size) == ("vit_base_patch16_224", 224):
        flops = FLOPS_PER_IMAGE_224
    else:  # Another model or size: count it.
        flops = training_flops_per_sample(ModelConfig(args.model, {}, args.image_size, 1000))
    configs: list[dict[str, Any]] = []

    def result() -> dict[str, Any]:
        for c in configs:
            c["mfu"] = _mfu(c["trainer_samples_per_s"], flops, peak)
            c["bare_mfu"] = _mfu(c["bare_samples_per_s"], flops, peak)
        default = configs[0]
        return {
            "config": {k: v for k, v in vars(args).items() if k != "one"},
            "device": name,
            "gpu_memory_bytes": total,
            "flops_per_image": flops,
            "peak_flops": peak,
            "configurations": configs,
            # The default configuration (batch 256, compile off).
            "batch_size": default["batch_size"],
            "samples_per_s": default["trainer_samples_per_s"],
            "mfu": default["mfu"],
            "ratio": default["ratio"],
            "eval_images_per_s": default.get("eval_images_per_s"),
            "best_samples_per_s": max(c["trainer_samples_per_s"] for c in configs),
            "target_images_per_s_h100": TARGET_H100,
            "target_ratio": TARGET_RATIO,
            "meets_ratio": all(c["ratio"] >= TARGET_RATIO for c in configs),
        }

    compiles = [False, True] if args.compile == "both" else [args.compile == "on"]
    largest: int | None = None
    for compile in compiles:
        base = run_child(args, args.batch_size, compile, first=not configs)
        if base is None:
            raise RuntimeError(f"batch {args.batch_size} does not fit; lower --batch-size")
        configs.append(base)
        save(result())
        if cuda and not args.no_largest:
            if largest is None:
                largest = predicted_largest(base, total, args.batch_size)
                print(f"predicted largest batch: {largest}", flush=True)
            if largest > args.batch_size:
                big = largest_fitting(args, compile, largest, args.batch_size)
                if big is not None:
                    largest = big["batch_size"]  # the compiled run starts from what fitted
                    configs.append(big)
                    save(result())
    return result()


def store_entry(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The planner's results-store entry for the default configuration's measured rate."""
    default = result["configurations"][0]
    spec = _spec(args, default["batch_size"], default["compile"])
    figure = TrainerFigure(
        samples_per_s=default["trainer_samples_per_s"],
        step_time_s=default["step_time_s"],
        measured_steps=args.steps * args.rounds,
        device=gpu_model(result["device"]),
        threads=1,
    )
    common = common_fields(spec, None, "python -m benchmarks trainer_gpu")
    entry = trainer_record(spec, figure, common)
    entry["mfu"] = default["mfu"]
    entry["compile"] = default["compile"]
    return entry


def store_default(result: dict[str, Any], args: argparse.Namespace, results: Path) -> Path:
    """Merge the default configuration's entry into the results store beside ``results``
    (written as soon as it is measured: a run cut short keeps it)."""
    store = results / THROUGHPUT_FILE
    merge(store, [store_entry(result, args)], [])
    read_throughput(store)  # What was written reads back.
    return store


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument(
        "--warmup", type=int, default=10, help="untimed steps first (also the log interval)"
    )
    p.add_argument("--rounds", type=int, default=2, help="bare/trainer pairs per configuration")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--compile", choices=["off", "on", "both"], default="both")
    p.add_argument("--no-largest", action="store_true", help="only --batch-size")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds per configuration")
    p.add_argument("--no-store", action="store_true", help="leave throughput.json alone")
    p.add_argument("--eval-batches", type=int, default=20, help="validation batches timed")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pageable", action="store_true", help=argparse.SUPPRESS)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks trainer_gpu", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # Before torch initialises CUDA.
    if args.one:
        return child_main(args)
    name = "trainer_gpu" if args.device == "cuda" else "trainer_gpu_cpu_smoke"
    stored: list[Path] = []

    def save(partial: dict[str, Any]) -> None:
        path = write_result(name, partial)
        if args.device == "cuda" and not args.no_store and not stored:
            stored.append(store_default(partial, args, path.parent))

    result = run(args, save=save)
    print_table(
        f"{args.model} {args.precision} on {result['device']}: our Trainer against a bare "
        "timm + torch loop",
        ("batch", "compile", "trainer images/s", "bare images/s", "ratio", "MFU", "peak memory",
         "step"),
        [
            (
                str(c["batch_size"]), "on" if c["compile"] else "off",
                f"{c['trainer_samples_per_s']:,.0f}", f"{c['bare_samples_per_s']:,.0f}",
                f"{c['ratio']:.3f}", "-" if c["mfu"] is None else f"{c['mfu'] * 100:.1f}%",
                _gib(c["trainer_peak_bytes"]), f"{c['step_time_s'] * 1e3:.0f} ms",
            )
            for c in result["configurations"]
        ],
    )  # fmt: skip
    evaluated = result["configurations"][0].get("eval_images_per_s")
    if evaluated:
        print(f"validation (eval mode, no gradients): {evaluated:,.0f} images/s at batch "
              f"{result['batch_size']}")  # fmt: skip
    pageable = result["configurations"][0].get("bare_pageable_samples_per_s")
    if pageable:
        print(f"bare loop from pageable memory: {pageable:,.0f} images/s (pinned: "
              f"{result['configurations'][0]['bare_samples_per_s']:,.0f})")  # fmt: skip
    if stored:
        print(f"-> {stored[0]}")
    keys = ("samples_per_s", "mfu", "ratio", "batch_size")
    return report(name, result, {k: result[k] for k in keys})


if __name__ == "__main__":
    raise SystemExit(main())
