"""``hetero demo``: the data plane on this machine: N data servers, one client printing images/s.

Every server gets the Shutdown RPC at the end and every child process is waited for, also on
Ctrl-C, so nothing is left running.
"""

from __future__ import annotations

import argparse
import sys
import time

from training.dataplane.processes import ServerProcess, start_server_process
from training.spec import load_spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--servers", type=int, default=2, help="data servers to start (default 2)")
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="how long to stream (default 10)"
    )
    parser.add_argument(
        "--spec", default="specs/local-cpu.toml", help="spec for dataset, recipe, batch size"
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="augmentation workers per server (default: spec)"
    )


def run(args: argparse.Namespace) -> int:
    if args.servers < 1 or args.seconds <= 0:
        print("--servers must be at least 1 and --seconds positive", file=sys.stderr)
        return 2
    spec = load_spec(args.spec)
    from training.dataplane.client import DataPlaneClient  # Deferred: torch, gRPC after arg checks.

    job, dp = spec.job, spec.job.dataplane
    servers: list[ServerProcess] = []
    client: DataPlaneClient | None = None
    try:
        for _ in range(args.servers):
            servers.append(start_server_process(args.spec, workers=args.workers))
        addresses = [s.address for s in servers]
        print(f"data servers: {', '.join(addresses)}", flush=True)
        client = DataPlaneClient(
            addresses,
            batch_size=job.batch_size,
            seed=job.seed,
            prefetch_batches=dp.prefetch_batches,
            chunk_batches=dp.chunk_batches,
            rpc_timeout_s=dp.rpc_timeout_s,
        )
        client.wait_for_servers(timeout_s=dp.rpc_timeout_s)
        start = last = time.monotonic()
        images = since_last = 0
        done = False
        while not done:
            for batch in client:
                images += len(batch)
                since_last += len(batch)
                now = time.monotonic()
                if now - last >= 1.0:
                    print(
                        f"epoch {client.epoch}: {since_last / (now - last):8.1f} images/s "
                        f"({images} images in {now - start:.1f}s)",
                        flush=True,
                    )
                    last, since_last = now, 0
                if now - start >= args.seconds:
                    done = True
                    break
        elapsed = time.monotonic() - start
        print(f"total: {images} images in {elapsed:.1f}s = {images / elapsed:.1f} images/s")
    except KeyboardInterrupt:
        print("interrupted: shutting the data servers down", file=sys.stderr)
    finally:
        if client is not None:
            client.shutdown_servers(grace_s=1.0)
            client.close()
        codes = [s.stop() for s in servers]
    if any(codes):
        print(f"data server exit codes: {codes}", file=sys.stderr)
        return 1
    print(f"{len(servers)} data server(s) shut down cleanly")
    return 0
