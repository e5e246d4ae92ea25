"""The input path at a GPU's rate: the real trainer fed by real data servers on the same host.

Two runs of the trainer entry point (``python -m training.trainer``), same model, batch and
steps (ViT-B/16, bf16, 224 px, batch 256 by default):

A. in-memory synthetic batches (``--synthetic-data``): the GPU's own rate, no input path;
B. fed over loopback gRPC by as many data servers as the host's cores allow (two cores kept for
   the trainer; two augmentation workers per server), each decoding and augmenting JPEGs
   (the synthetic source: 256 px JPEGs, RandomResizedCrop to 224 and a flip).

From each: steady-state images/s, data-wait share and GPU utilisation (the trainer's summary),
and the trainer process's CPU-seconds per image (``offload.trainer_summary``: ``getrusage`` of the
child once it has exited).
On a GPU that CPU time is mostly the CUDA driver waiting for the GPU (it spins while the host
is ahead), so it bounds the host's cost from above and is not the receive cost itself; the
receive CPU per image is measured apart by ``python -m benchmarks dataplane``. B/A near 1 with
a data-wait share near 0 means this host takes batches as fast as the GPU consumes them, and
that the host-to-device copies do not stall the steps. The data servers share the host with
the trainer here; on AWS they run on their own instances. Usage: ``python -m benchmarks
gpu_input`` (``--device cpu --quick``: a smoke run anywhere).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.offload import trainer_summary
from benchmarks.trainer_common import print_table, report, spec_data
from benchmarks.trainer_common import write_spec as write_spec_file
from training.dataplane.processes import start_server_process


def write_spec(path: Path, args: argparse.Namespace, checkpoints: Path) -> Path:
    """The spec both runs and the servers share."""
    samples = (args.warmup + args.steps + 4) * args.batch_size
    return write_spec_file(path, spec_data(
        name="bench-gpu-input", model=args.model, overrides=args.overrides,
        image_size=args.image_size, batch_size=args.batch_size, steps=args.warmup + args.steps,
        log_every=args.warmup, trainer={"instance_types": ["p5.48xlarge"]},
        dataprep={"count": args.servers},
        dataset={"source": "synthetic", "num_samples": samples, "num_classes": 1000},
        checkpoint={"dir": str(checkpoints)},
        job={"augmentation": "standard", "dataplane": {"workers_per_server": args.workers}},
    ))  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    images = (args.warmup + args.steps) * args.batch_size
    with tempfile.TemporaryDirectory(prefix="bench-gpu-input-") as tmp:
        work = Path(tmp)
        spec = write_spec(work / "spec.toml", args, work / "checkpoints")
        print("A: synthetic batches in memory ...", flush=True)
        synthetic = trainer_summary(
            spec, work / "a", None, args.timeout, ["--synthetic-data"], env=env
        )
        print(f"  {synthetic['samples_per_s']:,.1f} images/s", flush=True)
        print(f"B: {args.servers} data servers x {args.workers} workers on loopback ...",
              flush=True)  # fmt: skip
        with ThreadPoolExecutor(args.servers) as pool:
            servers = list(pool.map(
                lambda _: start_server_process(spec, workers=args.workers,
                                               timeout_s=args.timeout),
                range(args.servers),
            ))  # fmt: skip
        try:
            addresses = ",".join(s.address for s in servers)
            fed = trainer_summary(
                spec, work / "b", None, args.timeout, ["--data-servers", addresses], env=env
            )
        finally:
            # The trainer sends Shutdown at job end; stop() waits (or kills after a failure).
            codes = [s.stop(timeout_s=20.0) for s in servers]
        print(f"  {fed['samples_per_s']:,.1f} images/s, data-wait "
              f"{fed['data_wait_share'] * 100:.1f}%", flush=True)  # fmt: skip
    return {
        "config": {k: v for k, v in vars(args).items()},
        "cores": len(os.sched_getaffinity(0)),
        "images_per_run": images,
        "synthetic": _row(synthetic, images),
        "fed": _row(fed, images),
        "server_exit_codes": codes,
        "fed_over_synthetic": fed["samples_per_s"] / synthetic["samples_per_s"],
    }


def _row(summary: dict[str, Any], images: int) -> dict[str, Any]:
    return {
        "samples_per_s": float(summary["samples_per_s"]),
        "step_time_s": float(summary["step_time_s"]),
        "data_wait_share": summary.get("data_wait_share"),
        "gpu_util_pct": summary.get("gpu_util_pct"),
        "host_cpu_pct": summary.get("host_cpu_pct"),
        "trainer_cpu_s": summary["cpu_s"],
        "trainer_cpu_ms_per_image": summary["cpu_s"] / images * 1e3,
        "measured_steps": summary.get("measured_steps"),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    cores = len(os.sched_getaffinity(0))
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--overrides", type=json.loads, default={}, help="timm overrides (JSON)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=32, help="timed steps")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps first")
    p.add_argument("--workers", type=int, default=2, help="augmentation workers per server")
    p.add_argument(
        "--servers",
        type=int,
        default=max(1, (cores - 2) // 2),
        help="data servers (default: the host's cores less two, over --workers)",
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke mode: a tiny ViT at 32 px, batch 8, 3 steps, 1 server",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per process")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks gpu_input", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.image_size, args.batch_size = "vit_tiny_patch16_224", 32, 8
        args.overrides = {"img_size": 32, "patch_size": 8, "depth": 1, "embed_dim": 32,
                          "num_heads": 2}  # fmt: skip
        args.steps, args.warmup, args.servers, args.workers = 3, 1, 1, 1
    result = run(args)
    rows = [
        (
            label,
            f"{row['samples_per_s']:,.0f}",
            f"{row['data_wait_share'] * 100:.1f}%",
            f"{row['trainer_cpu_ms_per_image']:.3f}",
            "-" if row["gpu_util_pct"] is None else f"{row['gpu_util_pct']:.0f}%",
        )
        for label, row in (
            ("A in memory", result["synthetic"]),
            (f"B {args.servers} servers, loopback gRPC", result["fed"]),
        )
    ]
    print_table(
        f"input path: {args.model} at {args.image_size} px, batch {args.batch_size}, {args.device}",
        ("input", "images/s", "data-wait", "trainer process CPU ms/image", "GPU util"),
        rows,
    )
    print(f"B/A {result['fed_over_synthetic']:.3f}")
    name = "gpu_input" if args.device == "cuda" else "gpu_input_cpu_smoke"
    return report(name, result, {"fed_over_synthetic": result["fed_over_synthetic"]})


if __name__ == "__main__":
    raise SystemExit(main())
