"""``python -m benchmarks prep``: ``hetero dataset prep`` at ImageNet's image size, from a local
folder and from S3, and what that says about preparing ImageNet-1k.

The source is ``--images`` JPEGs made once, seeded, at ImageNet-1k's typical shape (``--width`` x
``--height``, 500 x 375 by default, quality 90; smooth noise so they compress like photographs:
about 93 KB each at the defaults, near ImageNet's 110 KB) in ``--classes`` class folders. Prep
runs on them exactly as the command does (``training.data.prep.prep``: every image read, checked
with the data servers' full decode, packed into shards with its manifest):

- **folder**: local folder to local shards, once per ``--threads`` count (prep's
  ``--read-threads``), to find the count that saturates this machine;
- **s3**: the same images uploaded to S3 emulated by a moto server in its own process on
  127.0.0.1, prepped from ``s3://`` to ``s3://`` with the best thread count.

Each run reports images/s and source MB/s. Moto on loopback is not S3 (no network; moto's request
handling costs CPU on the same cores), so the S3 row speaks to prep's own cost with an S3 source
on this machine, not to S3's throughput. The estimate for ImageNet-1k (1,281,167 training images,
``IMAGENET_GB`` GB) for one ``--instance`` (c6i.8xlarge by default) is the longer of its
CPU-bound time (the best rate per core measured here, times its vCPUs) and its network-bound time
(the source read and the shards written at its baseline bandwidth, ``priors.BASELINE_GBPS``) and
its request-bound time (prep's read threads each waiting ``--s3-latency-ms`` per image), at its
On-Demand price; that scaling is an assumption the result file states, not a measurement.
Writes ``benchmarks/results/prep.json`` with the machine.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from benchmarks.checkpoint import moto_s3
from benchmarks.trainer_common import print_table, report
from training import instance_types
from training.common import aws
from training.common.s3 import parse_s3_uri
from training.data.prep import PrepRequest, prep
from training.data.prep_inputs import DEFAULT_READ_THREADS
from training.planner import priors

IMAGENET_IMAGES = 1_281_167
"""ImageNet-1k's training images (ILSVRC 2012)."""
IMAGENET_GB = 140
"""Its training set's size on disk, about 140 GB (as the project's issue and docs state it)."""


def make_images(root: Path, count: int, classes: int, width: int, height: int) -> int:
    """``count`` seeded JPEGs in ``classes`` folders under ``root``; their total bytes."""
    rng = np.random.default_rng(0)
    total = 0
    for i in range(count):
        folder = root / f"n{i % classes:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        # Noise at a quarter of the size, scaled up: smooth enough to compress like a photo.
        small = rng.integers(0, 256, (height // 4, width // 4, 3), dtype=np.uint8)
        image = Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC)
        path = folder / f"{i:07d}.JPEG"
        image.save(path, format="JPEG", quality=90)
        total += path.stat().st_size
    return total


def timed_prep(src: str, out: str, threads: int) -> float:
    """Seconds for one prep of ``src`` into ``out`` with ``threads`` read threads."""
    request = PrepRequest(src=src, out=out, read_threads=threads, shard_bytes=64 * 2**20)
    started = time.perf_counter()
    result = prep(request)
    seconds = time.perf_counter() - started
    if result.manifest.excluded:
        raise RuntimeError(f"prep left out {len(result.manifest.excluded)} benchmark images")
    return seconds


def upload(root: Path, bucket_uri: str) -> str:
    """``root``'s class folders under ``<bucket>/src/``; the source URI."""
    bucket, _ = parse_s3_uri(bucket_uri + "/")
    client = aws.client()
    for path in sorted(root.rglob("*.JPEG")):
        key = f"src/{path.parent.name}/{path.name}"
        client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
    return f"{bucket_uri}/src/"


def row(where: str, threads: int, seconds: float, images: int, source_bytes: int) -> dict[str, Any]:
    return {
        "source": where,
        "read_threads": threads,
        "seconds": seconds,
        "images_per_s": images / seconds,
        "mb_per_s": source_bytes / 1e6 / seconds,
    }


def imagenet_estimate(
    best: dict[str, Any], cores_here: int, instance: str, read_threads: int, latency_ms: float
) -> dict[str, Any]:
    """Hours and On-Demand USD to prep ImageNet-1k from S3 to S3 on one ``instance``: the
    longest of its CPU-bound time (the rate per core measured here, times its vCPUs), its
    network-bound time (the source read and the shards written, at its baseline bandwidth) and
    its request-bound time (``read_threads`` GETs in flight, each ``latency_ms``)."""
    kind = instance_types.lookup(instance)
    gbps = priors.BASELINE_GBPS.get(instance)
    if kind is None or gbps is None:
        raise SystemExit(f"--instance {instance}: no vCPU count, price or bandwidth known for it")
    per_core = best["images_per_s"] / cores_here
    cpu_hours = IMAGENET_IMAGES / (per_core * kind.vcpus) / 3600
    network_hours = 2 * IMAGENET_GB * 8 / gbps / 3600
    request_hours = IMAGENET_IMAGES * latency_ms / 1e3 / read_threads / 3600
    hours = max(cpu_hours, network_hours, request_hours)
    return {
        "images": IMAGENET_IMAGES,
        "gb": IMAGENET_GB,
        "instance": instance,
        "vcpus": kind.vcpus,
        "baseline_gbps": gbps,
        "on_demand_usd_per_hour": kind.on_demand_usd_per_hour,
        "images_per_s_per_core_here": per_core,
        "cpu_bound_hours": cpu_hours,
        "network_bound_hours": network_hours,
        "read_threads": read_threads,
        "s3_get_latency_ms": latency_ms,
        "request_bound_hours": request_hours,
        "hours": hours,
        "usd": hours * kind.on_demand_usd_per_hour,
        "assumption": (
            "prep's rate grows with the vCPUs in proportion to the rate per core measured here "
            "(its work is the decode check in its read threads), and S3 serves the instance at "
            "its baseline bandwidth, the 140 GB read and the shards written; each GET of a small "
            "object takes the latency given (AWS: 'median latencies often in the tens of "
            "milliseconds' for requests under 512 KB, the S3 performance whitepaper); none is "
            "measured beyond this machine"
        ),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", type=int, default=600)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--width", type=int, default=500)
    p.add_argument("--height", type=int, default=375)
    p.add_argument(
        "--threads", type=int, nargs="+", default=[1, 2, 4, 8], help="read threads to try"
    )
    p.add_argument("--instance", default="c6i.8xlarge", help="the instance the estimate is for")
    p.add_argument(
        "--estimate-read-threads", type=int, default=DEFAULT_READ_THREADS,
        help="prep's --read-threads in the estimate (default: prep's own)",
    )  # fmt: skip
    p.add_argument(
        "--s3-latency-ms", type=float, default=50.0, help="one small GET's latency in the estimate"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks prep")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.images < args.classes or min(args.threads) < 1:
        parser.error("--images must be at least --classes, and each --threads at least 1")
    cores = len(os.sched_getaffinity(0))
    load_before = os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "images"
        source_bytes = make_images(root, args.images, args.classes, args.width, args.height)
        for threads in args.threads:
            seconds = timed_prep(str(root), str(Path(tmp) / f"out-{threads}"), threads)
            rows.append(row("folder", threads, seconds, args.images, source_bytes))
        best = max(rows, key=lambda r: r["images_per_s"])
        with moto_s3() as bucket:
            src = upload(root, bucket)
            seconds = timed_prep(src, f"{bucket}/prepared/", best["read_threads"])
            rows.append(row("s3 (moto)", best["read_threads"], seconds, args.images, source_bytes))
    result = {
        "config": vars(args),
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "image_kb_mean": source_bytes / args.images / 1e3,
        "runs": rows,
        "imagenet_1k": imagenet_estimate(
            best, cores, args.instance, args.estimate_read_threads, args.s3_latency_ms
        ),
    }
    table = [
        (r["source"], str(r["read_threads"]), f"{r['seconds']:.1f}",
         f"{r['images_per_s']:.0f}", f"{r['mb_per_s']:.1f}")
        for r in rows
    ]  # fmt: skip
    print_table(
        f"hetero dataset prep: {args.images} JPEGs of {args.width}x{args.height} "
        f"({result['image_kb_mean']:.0f} KB each), {cores} cores",
        ("source", "read threads", "seconds", "images/s", "MB/s"),
        table,
        left=1,
    )
    estimate = result["imagenet_1k"]
    summary = {
        "best_images_per_s": best["images_per_s"],
        "read_threads": best["read_threads"],
        "imagenet_1k": {k: estimate[k] for k in ("instance", "hours", "usd")},
    }
    return report("prep", result, summary)


if __name__ == "__main__":
    raise SystemExit(main())
