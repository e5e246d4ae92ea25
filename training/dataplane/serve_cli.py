"""``hetero serve``: run one data server for a cluster spec until told to shut down."""

from __future__ import annotations

import argparse
import sys

from training.spec import load_spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", default="cluster.toml", help="cluster spec (TOML)")
    parser.add_argument(
        "--port", type=int, default=None, help="port (default: job.dataplane.port; 0: any free)"
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="augmentation worker processes (default: job.dataplane.workers_per_server; 0: cores)",
    )
    parser.add_argument(
        "--memory-mb",
        type=int,
        default=None,
        help="bound on batch bytes in flight across all streams, in MB (default: "
        "job.dataplane.server_memory_mb; 0: derived from the host's memory)",
    )


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    if args.port is not None and not 0 <= args.port <= 65535:
        print(f"--port must be 0-65535, got {args.port}", file=sys.stderr)
        return 2
    if args.workers is not None and args.workers < 0:
        print(f"--workers must be 0 (one per core) or more, got {args.workers}", file=sys.stderr)
        return 2
    if args.memory_mb is not None and args.memory_mb < 0:
        print(
            f"--memory-mb must be 0 (derived from the host's memory) or more, got {args.memory_mb}",
            file=sys.stderr,
        )
        return 2
    # Deferred: torch and gRPC load only when a server is really started.
    from training.dataplane.server import serve

    def announce(port: int) -> None:
        # Parents (hetero demo, tests, the launcher) read this line to learn the port.
        print(f"data server listening on {args.host}:{port}", flush=True)

    try:
        return serve(
            spec,
            port=args.port,
            host=args.host,
            workers=args.workers,
            memory_mb=args.memory_mb,
            on_listening=announce,
        )
    except (ValueError, OSError) as e:
        print(f"hetero serve: {e}", file=sys.stderr)
        return 2
