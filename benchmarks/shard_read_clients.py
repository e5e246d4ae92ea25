"""``python -m benchmarks shard_read_clients``: a prepared dataset's shards read from S3, two
clients.

What a data server does on a cache miss (``training.data.shard_source.ShardCache``): a whole
shard from S3 into a file on the instance's disk. Shards of ``--shard-mb`` (random bytes: the
contents do not matter to a read) sit in S3 emulated by a moto server in its own process on
127.0.0.1, and are read ``--concurrency`` at a time (a server's workers each fetch their own
shard), two ways:

- **boto3**: ``download_file``, what ``ShardImages`` does today (the managed transfer: ranged
  GETs of 8 MB, up to 10 threads per object, into a file).
- **s3torchconnector**: ``S3MapDataset.from_objects`` (AWS's connector for PyTorch, on the
  CRT-based client), its item's reader streamed into a file in 8 MB reads.

Each is timed ``--repeats`` times (median reported) over all shards, and each file is checked
against the shard's sha256. Moto on loopback is not S3: there is no network and moto's request
handling dominates, so the figures speak only to client-side cost on this machine, not to
throughput against AWS.

s3torchconnector is not a dependency of the project: install it first
(``pip install --constraint containers/constraints.txt s3torchconnector``). It reads the
endpoint from ``AWS_ENDPOINT_URL`` (plain HTTP works). Writes
``benchmarks/results/shard_read_clients.json`` with the machine.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from benchmarks.checkpoint_s3_clients import connector_comparison
from benchmarks.trainer_common import print_table, report
from training.common import aws
from training.data.manifest import file_sha256

REGION = "us-east-1"
READ_BYTES = 8 * 2**20
CLIENTS = ("boto3", "s3torchconnector")


def put_shards(bucket_uri: str, count: int, shard_mb: int) -> dict[str, str]:
    """``count`` objects of ``shard_mb`` MB of seeded random bytes; {key: sha256}."""
    import numpy as np

    bucket = urlparse(bucket_uri).netloc
    client = aws.client()
    rng = np.random.default_rng(0)
    shards = {}
    for i in range(count):
        body = rng.bytes(shard_mb * 10**6)
        key = f"shards/train-{i:06d}.tar"
        client.put_object(Bucket=bucket, Key=key, Body=body)
        shards[key] = hashlib.sha256(body).hexdigest()
    return shards


def _sha256(path: Path) -> str:
    return file_sha256(path)


def readers(bucket: str, keys: Sequence[str]) -> dict[str, Callable[[str, Path], None]]:
    """One ``read(key, path)`` per client, each writing the whole object to ``path``."""
    from s3torchconnector import S3MapDataset

    boto = aws.client()  # what LazyS3Client makes
    # The connector's dataset API over the shards (one client; its default sequential reader).
    dataset = S3MapDataset.from_objects([f"s3://{bucket}/{k}" for k in keys], region=REGION)
    index = {k: i for i, k in enumerate(keys)}

    def read_boto3(key: str, path: Path) -> None:
        boto.download_file(bucket, key, str(path))

    def read_crt(key: str, path: Path) -> None:
        reader = dataset[index[key]]
        with path.open("wb") as f:
            while chunk := reader.read(READ_BYTES):
                f.write(chunk)

    return {"boto3": read_boto3, "s3torchconnector": read_crt}


def compare(args: argparse.Namespace, bucket_uri: str, work: Path) -> list[dict[str, Any]]:
    shards = put_shards(bucket_uri, args.shards, args.shard_mb)
    total = args.shards * args.shard_mb * 10**6
    read = readers(urlparse(bucket_uri).netloc, list(shards))
    times: dict[str, list[float]] = {c: [] for c in CLIENTS}
    for rep in range(args.repeats):
        for client in CLIENTS:
            folder = work / f"{client}-{rep}"
            folder.mkdir()

            def one(key: str, folder: Path = folder, client: str = client) -> None:
                path = folder / Path(key).name
                read[client](key, path)
                if _sha256(path) != shards[key]:
                    raise AssertionError(f"{client} read {key} wrong")

            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(one, shards))
            times[client].append(time.perf_counter() - t0)
            for p in folder.iterdir():
                p.unlink()
            folder.rmdir()
            print(
                f"rep {rep + 1} {client}: {times[client][-1]:.2f}s "
                f"({total / 1e6 / times[client][-1]:.0f} MB/s, sha256 checks included)",
                flush=True,
            )
    rows = []
    for client in CLIENTS:
        median = statistics.median(times[client])
        rows.append(
            {
                "client": client,
                "seconds": times[client],
                "seconds_median": median,
                "mb_per_s": total / 1e6 / median,
            }
        )
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--shard-mb", type=int, default=128, help="MB per shard")
    p.add_argument("--concurrency", type=int, default=4, help="shards read at once")
    p.add_argument("--repeats", type=int, default=3)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks shard_read_clients")
    add_arguments(parser)
    args = parser.parse_args(argv)
    for name in ("shards", "shard_mb", "concurrency", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    result = connector_comparison(
        args, "s3torchconnector", lambda a, bucket, work: {"clients": compare(a, bucket, work)}
    )
    if result is None:
        return 2
    rows = result["clients"]
    print_table(
        f"shard reads: {args.shards} x {args.shard_mb} MB, {args.concurrency} at once",
        ("client", "seconds (median)", "MB/s"),
        [(r["client"], f"{r['seconds_median']:.2f}", f"{r['mb_per_s']:.0f}") for r in rows],
        left=1,
    )
    return report("shard_read_clients", result, {r["client"]: r["mb_per_s"] for r in rows})


if __name__ == "__main__":
    raise SystemExit(main())
