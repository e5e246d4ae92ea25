"""``python -m benchmarks checkpoint_s3_clients``: the S3 side of a checkpoint, two clients.

The same state as ``python -m benchmarks checkpoint`` (ViT-B/16 with its AdamW state, about
1 GB, one rank) saved to and loaded from S3 emulated by a moto server in its own process on
127.0.0.1, two ways:

- **boto3** (what ``training.trainer.checkpoint`` does today): ``dcp.save`` into a local staging
  folder, then ``S3CheckpointStore.upload_files`` (boto3 ``upload_file``, multipart, a few files
  at once), then the ``COMPLETE`` marker. Load: ``S3CheckpointStore.download`` into a local
  folder, then ``dcp.load`` from it.
- **s3torchconnector**: ``dcp.save`` straight into S3 with its ``S3StorageWriter`` (the CRT-based
  client; no local copy), then the same marker through the store. Load: ``dcp.load`` with its
  ``S3StorageReader`` (default DCP-optimised ranged reader).

Each is timed ``--repeats`` times (median reported) from the start of the save to the marker in
S3, and from the start of the load to the tensors filled. Moto on loopback is not S3: there is
no network and moto's own request handling dominates, so the figures speak only to client-side
overhead, not to throughput against AWS.

s3torchconnector is not a dependency of the project: install it first
(``pip install --constraint containers/constraints.txt 's3torchconnector[dcp]'``). It reads the
endpoint from ``AWS_ENDPOINT_URL`` (plain HTTP works). Writes
``benchmarks/results/checkpoint_s3_clients.json`` with the machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.checkpoint import moto_s3
from benchmarks.trainer_common import print_table, report
from training.common.aws import CONNECT_TIMEOUT_S, MAX_ATTEMPTS
from training.trainer.checkpoint_s3 import MARKER, S3CheckpointStore
from training.trainer.model import PRESETS

REGION = "us-east-1"


def build_state(model_name: str, image_size: int) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` as the trainer's ``Checkpointer`` saves them, for one
    rank of ``model_name`` with AdamW state after one step."""
    import timm
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    name, overrides = PRESETS.get(model_name, (model_name, {}))
    model = timm.create_model(name, img_size=image_size, num_classes=1000, **overrides)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates exp_avg and exp_avg_sq
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _patient_client() -> Any:
    """The production client (``training.common.aws.client``) but with a 120 s read timeout: moto
    joins a 1 GB multipart upload in Python, which on a loaded 2-core machine can take longer than
    the production 10 s and then fails the save (a limit of moto, not of S3). The CRT client has no
    read timeout of its own to match."""
    import boto3
    from botocore.config import Config

    config = Config(
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=120,
        retries={"total_max_attempts": MAX_ATTEMPTS, "mode": "standard"},
    )
    return boto3.client("s3", config=config)


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def compare(args: argparse.Namespace, bucket_uri: str, work: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

    state = build_state(args.model, args.image_size)
    state_bytes = sum(
        t.numel() * t.element_size()
        for t in _tensors(state)  # parameters and optimizer moments
    )
    store = S3CheckpointStore(f"{bucket_uri}/ckpt", client=_patient_client())
    marker = work / MARKER
    marker.write_text("complete\n")
    runs: dict[str, list[float]] = {"boto3": [], "s3torchconnector": []}
    loads: dict[str, list[float]] = {"boto3": [], "s3torchconnector": []}
    sizes: dict[str, int] = {}
    step = 0
    for rep in range(args.repeats):
        for client in ("boto3", "s3torchconnector"):
            step += 1
            staging = work / f"staging-{step}"

            def save_boto3(n: int = step, folder: Path = staging) -> None:
                dcp.save(state, checkpoint_id=str(folder))
                store.upload_files(folder, n)
                store.upload_marker(marker, n)

            def save_s3tc(n: int = step) -> None:
                writer = S3StorageWriter(REGION, store.step_uri(n), thread_count=args.threads)
                dcp.save(state, storage_writer=writer)
                store.upload_marker(marker, n)

            runs[client].append(_timed(save_boto3 if client == "boto3" else save_s3tc))
            shutil.rmtree(staging, ignore_errors=True)
            keys = store.steps()[step]
            sizes[client] = sum(
                store.client.head_object(Bucket=store.bucket, Key=k)["ContentLength"] for k in keys
            )
            assert store.is_complete(step), f"step {step} has no marker"

            def load_boto3(n: int = step) -> None:
                dest = work / f"load-{n}"
                store.download(n, dest)
                dcp.load(state, checkpoint_id=str(dest))
                shutil.rmtree(dest)

            def load_s3tc(n: int = step) -> None:
                dcp.load(state, storage_reader=S3StorageReader(REGION, store.step_uri(n)))

            loads[client].append(_timed(load_boto3 if client == "boto3" else load_s3tc))
            store.delete_step(step)  # moto keeps objects in memory
            print(
                f"rep {rep + 1} {client}: save {runs[client][-1]:.2f}s, "
                f"load {loads[client][-1]:.2f}s",
                flush=True,
            )
    rows = []
    for client in runs:
        save_s = statistics.median(runs[client])
        load_s = statistics.median(loads[client])
        rows.append(
            {
                "client": client,
                "save_s": runs[client],
                "save_s_median": save_s,
                "save_mb_per_s": sizes[client] / 1e6 / save_s,
                "load_s": loads[client],
                "load_s_median": load_s,
                "load_mb_per_s": sizes[client] / 1e6 / load_s,
                "checkpoint_mb": sizes[client] / 1e6,
            }
        )
    return {"state_mb": state_bytes / 1e6, "clients": rows}


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


def connector_comparison(
    args: argparse.Namespace,
    requirement: str,
    compare: Callable[[argparse.Namespace, str, Path], dict[str, Any]],
) -> dict[str, Any] | None:
    """``compare(args, bucket_uri, work_dir)`` against a moto S3 server of its own, with the
    run's facts (config, load, the connector's version, the target); None, after saying how to
    install it (``pip install ... REQUIREMENT``), when s3torchconnector is missing."""
    try:
        import s3torchconnector
    except ImportError:
        print(
            "s3torchconnector is not installed: pip install --constraint "
            f"containers/constraints.txt {requirement}",
            file=sys.stderr,
        )
        return None
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp, moto_s3() as bucket:
        result = compare(args, bucket, Path(tmp))
    return {
        "config": vars(args),
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "s3torchconnector": getattr(s3torchconnector, "__version__", "?"),
        "target": "s3 (moto on 127.0.0.1, own process)",
        **result,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="vit_base_patch16_224", help="timm name or preset")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--repeats", type=int, default=3, help="saves and loads per client")
    p.add_argument(
        "--threads", type=int, default=1, help="S3StorageWriter thread_count (its default: 1)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks checkpoint_s3_clients")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    result = connector_comparison(args, "'s3torchconnector[dcp]'", compare)
    if result is None:
        return 2
    print_table(
        f"checkpoint S3 clients: {args.model}, {result['state_mb']:.0f} MB state",
        ("client", "save to marker s (median)", "MB/s", "load s (median)", "MB/s"),
        [
            (
                r["client"],
                f"{r['save_s_median']:.2f}",
                f"{r['save_mb_per_s']:.0f}",
                f"{r['load_s_median']:.2f}",
                f"{r['load_mb_per_s']:.0f}",
            )
            for r in result["clients"]
        ],
        left=1,
    )
    summary = {r["client"]: r["save_s_median"] for r in result["clients"]}
    return report("checkpoint_s3_clients", result, summary)


if __name__ == "__main__":
    raise SystemExit(main())
