"""``python -m benchmarks [NAME [options]]``: run one benchmark, or list them.

Each module exposes ``main(argv) -> int``, prints a table and writes
``benchmarks/results/<name>.json`` with the machine it ran on.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line description)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "dataplane": (
        "benchmarks.dataplane",
        "gRPC transport images/s vs plain socket; receive vs augmentation CPU",
    ),
    "trainer_overhead": (
        "benchmarks.trainer_overhead",
        "trainer loop vs bare timm+torch loop, same model/batch (target >= 0.97)",
    ),
    "trainer_gpu": (
        "benchmarks.trainer_gpu",
        "ViT-B/16 bf16 images/s, MFU, memory vs a bare loop, compile off/on (--device cpu: smoke)",
    ),
    "gpu_input": (
        "benchmarks.gpu_input",
        "trainer fed by data servers on loopback vs in memory: data-wait, receive CPU per image",
    ),
    "offload": (
        "benchmarks.offload",
        "trainer on one core: local augmentation vs a data server on the other (target >= 1.8x)",
    ),
    "checkpoint": (
        "benchmarks.checkpoint",
        "ViT-B/16 + AdamW: SIGTERM to durable checkpoint (local, S3), stall per save sync/async",
    ),
    "checkpoint_s3_clients": (
        "benchmarks.checkpoint_s3_clients",
        "ViT-B/16 + AdamW to/from moto S3: boto3 uploader vs s3torchconnector (optional package)",
    ),
    "shard_read_clients": (
        "benchmarks.shard_read_clients",
        "prepared-dataset shards from moto S3 into files: boto3 vs s3torchconnector (optional)",
    ),
    "per_core": (
        "benchmarks.per_core",
        "a data server's images per CPU-second vs a plain timm loop, same core and photos (>= 1.0)",
    ),
    "prep": (
        "benchmarks.prep",
        "hetero dataset prep of ImageNet-size JPEGs from a folder and S3; the ImageNet-1k estimate",
    ),
    "autoscale": (
        "benchmarks.autoscale",
        "elastic data tier vs fixed counts, throttled servers and a paced trainer (hetero local)",
    ),
    "planner": (
        "benchmarks.planner",
        "hetero plan's predicted samples/s vs real runs, 4 configurations (target within 15%)",
    ),
    "trainer_memory": (
        "benchmarks.trainer_memory",
        "memory per rank, hsdp vs ddp, 4 CPU processes",
    ),
    "export": (
        "benchmarks.export",
        "hetero export of ViT-B/16 from a checkpoint of 2 FSDP ranks (target < 30 s)",
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "list"):
        print("usage: python -m benchmarks NAME [options]\n\nbenchmarks:")
        for name, (_, text) in BENCHMARKS.items():
            print(f"  {name:<20} {text}")
        return 0
    name, rest = args[0], args[1:]
    if name not in BENCHMARKS:
        valid = ", ".join(BENCHMARKS)
        print(f"unknown benchmark {name!r}; choose one of: {valid}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[name][0])
    return int(module.main(rest))


if __name__ == "__main__":
    sys.exit(main())
