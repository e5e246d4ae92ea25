"""The input path at a GPU's rate: the real trainer fed by real data servers on the same host.

Runs of the trainer entry point (``python -m training.trainer``), same model, batch and steps
(ViT-B/16, bf16, 224 px, batch 256 by default), one per row:

- ``memory``: in-memory synthetic batches (``--synthetic-data``): the GPU's own rate;
- ``receive``: fed over loopback gRPC by ``--servers`` data servers that serve pre-made batches
  (``PremadeBatchSource``): the trainer host's receive path alone (gRPC, decode, page-locked
  copy, host-to-device copy) at the GPU's rate, with no augmentation competing for the cores;
- ``fed``: the same servers augmenting JPEGs (the synthetic source: 256 px JPEGs,
  RandomResizedCrop to 224 and a flip), ``--workers`` processes each, with the reorder window
  the docs ask for (``prefetch_batches >= servers x chunk_batches``);
- ``fed 2 big``: two servers with the rest of the cores as workers, at the spec's defaults
  (window 8, 2 batches per range): the shape of two dataprep instances;
- with ``--before PATH``: that row again with servers that import ``training`` from ``PATH``
  (a checkout of another commit), for a before/after on one machine.

From each: steady-state images/s, data-wait share and GPU utilisation (the trainer's summary),
and the trainer process's CPU-seconds per image (``offload.trainer_summary``). On a GPU that CPU
time includes the CUDA driver waiting for the GPU, so the receive row's figure less the memory
row's is what receiving costs the trainer host. A row near the memory row's rate with a
data-wait share near 0 means that input keeps up with the GPU. The servers share the host with
the trainer here; on AWS they run on their own instances. Usage: ``python -m benchmarks
gpu_input`` (``--device cpu --quick``: a smoke run anywhere).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.dataplane import start_premade_server
from benchmarks.offload import trainer_summary
from benchmarks.trainer_common import print_table, report, spec_data
from benchmarks.trainer_common import write_spec as write_spec_file
from training.dataplane.processes import ServerProcess, start_server_process
from training.dataplane.server import PART_IMAGES
from training.spec.schema import DataPlaneSpec


def write_spec(path: Path, args: argparse.Namespace, checkpoints: Path, **dataplane: int) -> Path:
    """The spec of one row, for the trainer and its servers (``dataplane``: the row's
    ``[job.dataplane]`` keys)."""
    samples = (args.warmup + args.steps + 4) * args.batch_size
    return write_spec_file(path, spec_data(
        name="bench-gpu-input", model=args.model, overrides=args.overrides,
        image_size=args.image_size, batch_size=args.batch_size, steps=args.warmup + args.steps,
        log_every=args.warmup, trainer={"instance_types": ["p5.48xlarge"]},
        dataprep={"count": args.servers},
        dataset={"source": "synthetic", "num_samples": samples, "num_classes": 1000},
        checkpoint={"dir": str(checkpoints)},
        job={"augmentation": "standard", "dataplane": dataplane},
    ))  # fmt: skip


def importing_from(path: str | None) -> dict[str, str]:
    """The environment in which a child imports ``training`` from ``path`` (None: nothing
    added): ``PYTHONSAFEPATH`` keeps the working folder off its ``sys.path``."""
    if path is None:
        return {}
    pythonpath = os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": pythonpath, "PYTHONSAFEPATH": "1"}


def _package_at(path: str | None) -> str:
    out = subprocess.run(
        [sys.executable, "-c", "import training; print(training.__file__)"],
        capture_output=True, text=True, check=True, env={**os.environ, **importing_from(path)},
    )  # fmt: skip
    return out.stdout.strip()


def _fed(
    args: argparse.Namespace,
    work: Path,
    env: dict[str, str],
    name: str,
    servers: int,
    workers: int,
    dataplane: dict[str, int],
    before: str | None = None,
) -> dict[str, Any]:
    """One trainer run fed by ``servers`` augmenting data servers of ``workers`` each."""
    spec = write_spec(work / f"{name}.toml", args, work / "checkpoints", **dataplane)
    child_env = importing_from(before)
    with ThreadPoolExecutor(servers) as pool:
        started = list(pool.map(
            lambda _: start_server_process(spec, workers=workers, timeout_s=args.timeout,
                                           env=child_env),
            range(servers),
        ))  # fmt: skip
    return _run_fed(args, work / name, spec, env, started, servers, workers, dataplane)


def _run_fed(
    args: argparse.Namespace,
    run_dir: Path,
    spec: Path,
    env: dict[str, str],
    servers: Sequence[ServerProcess],
    count: int,
    workers: int,
    dataplane: dict[str, int],
) -> dict[str, Any]:
    try:
        addresses = ",".join(s.address for s in servers)
        summary = trainer_summary(
            spec, run_dir, None, args.timeout, ["--data-servers", addresses], env=env
        )
    finally:
        # The trainer sends Shutdown at job end; stop() waits (or kills after a failure).
        codes = [s.stop(timeout_s=20.0) for s in servers]
    row = _row(summary, args)
    row.update(servers=count, workers_per_server=workers, dataplane=dataplane, exit_codes=codes)
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    cores = len(os.sched_getaffinity(0))
    defaults = DataPlaneSpec()
    # Every server has a range at once: prefetch_batches >= servers x chunk_batches.
    window = {"prefetch_batches": max(defaults.prefetch_batches,
                                      args.servers * defaults.chunk_batches)}  # fmt: skip
    big_workers = max(1, (cores - 2) // 2)
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-gpu-input-") as tmp:
        work = Path(tmp)
        spec = write_spec(work / "memory.toml", args, work / "checkpoints")
        print("memory: synthetic batches in memory ...", flush=True)
        rows["memory"] = _row(
            trainer_summary(spec, work / "memory", None, args.timeout, ["--synthetic-data"],
                            env=env), args)  # fmt: skip
        print(f"  {rows['memory']['samples_per_s']:,.1f} images/s", flush=True)

        print(f"receive: {args.servers} servers of pre-made batches ...", flush=True)
        spec = write_spec(work / "receive.toml", args, work / "checkpoints", **window)
        samples = (args.warmup + args.steps + 4) * args.batch_size
        with ThreadPoolExecutor(args.servers) as pool:
            premade = list(pool.map(
                lambda _: start_premade_server(PART_IMAGES, args.image_size, samples),
                range(args.servers),
            ))  # fmt: skip
        rows["receive"] = _run_fed(
            args, work / "receive", spec, env,
            [ServerProcess(p, address) for p, address in premade], args.servers, 0, window,
        )  # fmt: skip
        _say(rows["receive"])

        if not args.quick:  # the two-server row's code with other counts
            print(f"fed: {args.servers} servers x {args.workers} workers ...", flush=True)
            rows["fed"] = _fed(args, work, env, "fed", args.servers, args.workers, window)
            _say(rows["fed"])
        print(f"fed 2 big: 2 servers x {big_workers} workers, default window ...", flush=True)
        rows["fed_2_big"] = _fed(args, work, env, "fed_2_big", 2, big_workers, {})
        _say(rows["fed_2_big"])
        if args.before:
            print(f"fed 2 big, servers from {args.before} ...", flush=True)
            rows["fed_2_big_before"] = _fed(
                args, work, env, "fed_2_big_before", 2, big_workers, {}, before=args.before
            )
            rows["fed_2_big_before"]["package"] = _package_at(args.before)
            _say(rows["fed_2_big_before"])
    memory = rows["memory"]
    receive = rows["receive"]
    return {
        "config": {k: v for k, v in vars(args).items()},
        "cores": cores,
        "images_per_run": (args.warmup + args.steps) * args.batch_size,
        "rows": rows,
        "receive_cpu_ms_per_image": receive["trainer_cpu_ms_per_image"]
        - memory["trainer_cpu_ms_per_image"],
        "over_memory": {k: r["samples_per_s"] / memory["samples_per_s"] for k, r in rows.items()},
    }


def _say(row: dict[str, Any]) -> None:
    print(f"  {row['samples_per_s']:,.1f} images/s, data-wait "
          f"{row['data_wait_share'] * 100:.1f}%", flush=True)  # fmt: skip


def _row(summary: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    images = (args.warmup + args.steps) * args.batch_size
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
    p.add_argument(
        "--before",
        default=None,
        metavar="PATH",
        help="also run the two-server row with servers importing `training` from PATH",
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke mode: a tiny ViT at 32 px, batch 8, 3 steps, 1 server; no 7 x 2 row",
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
    labels = {
        "memory": "in memory",
        "receive": "pre-made batches",
        "fed": "augmenting",
        "fed_2_big": "augmenting, 2 servers",
        "fed_2_big_before": "the same, --before",
    }
    rows = [
        (
            labels[name],
            "-" if name == "memory" else
            f"{row['servers']} x {row['workers_per_server']}, window "
            f"{row['dataplane'].get('prefetch_batches', DataPlaneSpec().prefetch_batches)}",
            f"{row['samples_per_s']:,.0f}",
            f"{result['over_memory'][name]:.2f}",
            f"{row['data_wait_share'] * 100:.1f}%",
            f"{row['trainer_cpu_ms_per_image']:.3f}",
            "-" if row["gpu_util_pct"] is None else f"{row['gpu_util_pct']:.0f}%",
        )
        for name, row in result["rows"].items()
    ]  # fmt: skip
    print_table(
        f"input path: {args.model} at {args.image_size} px, batch {args.batch_size}, {args.device}",
        (
            "input",
            "servers x workers",
            "images/s",
            "/ memory",
            "data-wait",
            "trainer CPU ms/image",
            "GPU util",
        ),
        rows,
        left=2,
    )
    print(f"receive CPU per image (receive row less memory row): "
          f"{result['receive_cpu_ms_per_image']:.3f} ms")  # fmt: skip
    name = "gpu_input" if args.device == "cuda" else "gpu_input_cpu_smoke"
    return report(name, result, {"over_memory": result["over_memory"]})


if __name__ == "__main__":
    raise SystemExit(main())
