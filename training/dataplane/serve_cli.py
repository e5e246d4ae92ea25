"""``hetero serve``: run one data server for a cluster spec until told to shut down."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

# load.py imports neither torch nor gRPC: cheap before a server is really started.
from training.common.outcome import mark_server_stopped
from training.dataplane.load import ENV_MAX_IMAGES_PER_S
from training.spec import load_spec


def images_per_s(text: str) -> float:
    """A ``--max-images-per-s`` value: a positive, finite number (argparse type)."""
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not (math.isfinite(rate) and rate > 0):
        raise argparse.ArgumentTypeError(
            f"must be a positive, finite number of images per second, got {text!r}"
        )
    return rate


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
    parser.add_argument(
        "--max-images-per-s",
        type=images_per_s,
        default=None,
        metavar="R",
        help="throttle: the server as a whole delivers at most R images per second, like a "
        f"slower machine (tests, rehearsals; default: ${ENV_MAX_IMAGES_PER_S} if set, else none)",
    )
    parser.add_argument(
        "--outcome-dir",
        default=None,
        help="write server-<PORT>.stopped here once the server stopped on request (the "
        "launcher's health watch then knows its silence is on purpose)",
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
    max_images_per_s = args.max_images_per_s
    if max_images_per_s is None and os.environ.get(ENV_MAX_IMAGES_PER_S, "").strip():
        try:
            max_images_per_s = images_per_s(os.environ[ENV_MAX_IMAGES_PER_S].strip())
        except argparse.ArgumentTypeError as e:
            print(f"{ENV_MAX_IMAGES_PER_S} {e}", file=sys.stderr)
            return 2
    from training.dataplane.server import serve  # Deferred: torch and gRPC after arg checks.

    def announce(port: int) -> None:
        # Parents (hetero demo, tests, the launcher) read this line to learn the port.
        print(f"data server listening on {args.host}:{port}", flush=True)

    def stopped(port: int) -> None:
        if args.outcome_dir is not None:
            mark_server_stopped(Path(args.outcome_dir), port)

    try:
        return serve(
            spec,
            port=args.port,
            host=args.host,
            workers=args.workers,
            memory_mb=args.memory_mb,
            max_images_per_s=max_images_per_s,
            on_listening=announce,
            on_stopped=stopped,
        )
    except (ValueError, OSError) as e:
        print(f"hetero serve: {e}", file=sys.stderr)
        return 2
