"""``python -m benchmarks dataplane``: data-plane transport and trainer-side receive cost.

Side by side, in one run on this machine:
1. transport: pre-made uint8 batches from one data server (a child process) to the real
   ``DataPlaneClient`` on loopback, in order through its reorder window, with 1, 2 and 4
   concurrent streams (each its own connection): images/s and GB/s, aggregate and per stream;
   and a plain Python TCP socket moving the same message size between the same two kinds of
   process: GB/s and the ratio;
2. receive cost: CPU-seconds per 1,000 images spent by the client process while receiving,
   divided by CPU-seconds per 1,000 images for the standard augmentation done locally (decode a
   JPEG, RandomResizedCrop to 224, flip), one thread.
Prints a table and writes ``benchmarks/results/dataplane.json`` with the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from training.data.datasets import SyntheticImages
from training.data.decode import decode_image
from training.data.transforms import build_transform
from training.dataplane.client import DataPlaneClient
from training.dataplane.server import create_server
from training.dataplane.sources import PremadeBatchSource

RESULTS = Path(__file__).resolve().parent / "results" / "dataplane.json"


def _machine() -> dict[str, Any]:
    import grpc
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpc": grpc.__version__,
        "platform": platform.platform(),
    }


# ---- child processes ------------------------------------------------------------------------


def _serve_premade(batch: int, size: int, num_samples: int) -> int:
    source = PremadeBatchSource(num_samples, image_size=size, max_batch=batch)
    server, port = create_server(source, port=0)
    print(f"port {port}", flush=True)
    server.wait_for_termination()
    return 0


def _socket_send(port: int, message_bytes: int, seconds: float) -> int:
    payload = os.urandom(message_bytes)
    header = struct.pack("!Q", message_bytes)
    with socket.create_connection(("127.0.0.1", port)) as s:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            s.sendall(header)
            s.sendall(payload)
    return 0


def _child(args: list[str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "benchmarks.dataplane", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


# ---- measurements ---------------------------------------------------------------------------


def measure_socket(message_bytes: int, seconds: float) -> dict[str, float]:
    """GB/s a plain TCP socket moves between two Python processes, one message per recv loop
    into a fresh buffer (what any receiver must at least do)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        sender = _child(["--socket-send", str(port), str(message_bytes), str(seconds)])
        conn, _ = listener.accept()
        received = messages = 0
        start = time.perf_counter()
        with conn:
            header = bytearray(8)
            while True:
                if not _recv_exact(conn, memoryview(header)):
                    break
                (length,) = struct.unpack("!Q", header)
                buf = bytearray(length)
                if not _recv_exact(conn, memoryview(buf)):
                    break
                received += length
                messages += 1
        elapsed = time.perf_counter() - start
        sender.wait()
    return {"gb_per_s": received / elapsed / 1e9, "messages": messages}


def _recv_exact(conn: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def start_premade_server(
    batch: int, size: int, num_samples: int
) -> tuple[subprocess.Popen[str], str]:
    """A data server process serving pre-made batches (``PremadeBatchSource``: the transport
    without augmentation) of ``num_samples`` samples; the process and its address. It stops
    on a Shutdown RPC."""
    server = _child(["--serve-premade", str(batch), str(size), str(num_samples)])
    assert server.stdout is not None
    line = server.stdout.readline()
    if not line.startswith("port "):
        server.kill()
        server.wait()
        raise RuntimeError(f"the pre-made data server did not start: {line!r}")
    return server, f"127.0.0.1:{int(line.split()[1])}"


def measure_transport(
    batch: int, size: int, seconds: float, prefetch: int, chunk: int, streams: int = 1
) -> dict[str, float]:
    """The real client receiving pre-made batches from one server process, in the planned
    order through its reorder window of ``prefetch`` batches, over ``streams`` concurrent
    streams (each its own TCP connection)."""
    per_epoch = batch * chunk * 8
    server, address = start_premade_server(batch, size, per_epoch)
    client: DataPlaneClient | None = None
    try:
        client = DataPlaneClient(
            [address],
            batch_size=batch,
            prefetch_batches=prefetch,
            chunk_batches=chunk,
            streams_per_server=streams,
            image_size=size,
            rpc_timeout_s=60,
        )
        client.wait_for_servers(timeout_s=60)
        for _ in client.iter_epoch(0):  # warm-up: connections, allocator, code paths
            pass
        images = nbytes = 0
        epoch = 1
        cpu0, t0 = time.process_time(), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for b in client.iter_epoch(epoch):
                images += len(b)
                nbytes += b.images.numel()
            epoch += 1
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        client.shutdown_servers(grace_s=1.0)
    finally:
        if client is not None:
            client.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    return {
        "streams": streams,
        "images_per_s": images / wall,
        "gb_per_s": nbytes / wall / 1e9,
        "gb_per_s_per_stream": nbytes / wall / 1e9 / streams,
        "client_cpu_s_per_1000_images": cpu / images * 1000,
        "client_cpu_share": cpu / wall,
        "images": images,
    }


# Training augmentation decodes the full-size originals: ImageNet's most common size is 500x375.
BASELINE_SOURCE_PX = (500, 375)


def measure_local_augmentation(size: int, images: int) -> dict[str, Any]:
    """CPU-seconds per 1,000 images for the standard recipe on this host, from JPEG bytes of
    ImageNet's typical size (decode, RandomResizedCrop, flip: what the trainer host would do)."""
    import torch

    torch.set_num_threads(1)
    source = SyntheticImages(images, 1000, size, source_size=BASELINE_SOURCE_PX)
    encoded = [source.read(i) for i in range(images)]
    transform = build_transform("standard", size)
    for data in encoded[:20]:
        transform(decode_image(data))
    cpu0 = time.process_time()
    for data in encoded:
        transform(decode_image(data))
    cpu = time.process_time() - cpu0
    return {
        "cpu_s_per_1000_images": cpu / images * 1000,
        "source_jpeg_px": source.source_size,
        "mean_jpeg_kb": sum(map(len, encoded)) / len(encoded) / 1e3,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    message = args.batch * 3 * args.size * args.size
    sweep = []
    for streams in args.streams:
        print(f"transport: {streams} stream(s) for {args.seconds:g}s ...", flush=True)
        sweep.append(
            measure_transport(
                args.batch, args.size, args.seconds, args.prefetch, args.chunk, streams
            )
        )
    transport = max(sweep, key=lambda t: t["images_per_s"])
    print("plain socket ...", flush=True)
    sock = measure_socket(message, min(args.seconds, 5.0))
    print("local augmentation baseline ...", flush=True)
    augment = measure_local_augmentation(args.size, args.augment_images)
    for t in sweep:
        t["grpc_vs_socket"] = t["gb_per_s"] / sock["gb_per_s"]
        t["receive_vs_augment_cpu"] = (
            t["client_cpu_s_per_1000_images"] / augment["cpu_s_per_1000_images"]
        )
    return {
        "machine": _machine(),
        "settings": {
            "batch_images": args.batch,
            "image_size": args.size,
            "message_mb": message / 1e6,
            "reorder_window_batches": args.prefetch,
            "prefetch_batches": args.prefetch,
            "chunk_batches": args.chunk,
            "streams": args.streams,
            "seconds": args.seconds,
        },
        "sweep": sweep,
        "transport": transport,
        "socket": sock,
        "local_augmentation": augment,
        "ratios": {
            "grpc_vs_socket": transport["grpc_vs_socket"],
            "receive_vs_augment_cpu": transport["receive_vs_augment_cpu"],
        },
        "targets": {"images_per_s": 5000, "grpc_vs_socket": 0.5, "receive_vs_augment_cpu": 0.10},
    }


def _print(result: dict[str, Any]) -> None:
    s, a = result["socket"], result["local_augmentation"]
    st = result["settings"]
    m = result["machine"]
    print(
        f"machine: {m['cpu']} ({m['cores']} cores), python {m['python']}, "
        f"torch {m['torch']}, grpc {m['grpc']}"
    )
    print(
        f"message: {st['batch_images']} x 3x{st['image_size']}x{st['image_size']} uint8 = "
        f"{st['message_mb']:.2f} MB; reorder window = prefetch {st['reorder_window_batches']} "
        f"batches; ranges of {st['chunk_batches']} batches; one server, one client, loopback"
    )
    print(
        f"plain TCP socket, same message size: {s['gb_per_s']:.2f} GB/s; local standard "
        f"augmentation: {a['cpu_s_per_1000_images']:.3f} CPU-s per 1000 images"
    )
    header = (
        "streams",
        "images/s",
        "GB/s",
        "GB/s per stream",
        "gRPC/socket",
        "client CPU-s/1000 img",
        "receive/augment CPU",
    )
    rows = [
        (
            str(t["streams"]),
            f"{t['images_per_s']:.0f}",
            f"{t['gb_per_s']:.2f}",
            f"{t['gb_per_s_per_stream']:.2f}",
            f"{t['grpc_vs_socket']:.2f}",
            f"{t['client_cpu_s_per_1000_images']:.3f}",
            f"{t['receive_vs_augment_cpu']:.3f}",
        )
        for t in result["sweep"]
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for r in rows:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))
    print(
        "targets: >= 5000 images/s, gRPC/socket >= 0.5, receive/augment CPU <= 0.10; best: "
        f"{result['transport']['streams']} stream(s)"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Child roles (started by this module itself).
    if argv[:1] == ["--serve-premade"]:
        return _serve_premade(int(argv[1]), int(argv[2]), int(argv[3]))
    if argv[:1] == ["--socket-send"]:
        return _socket_send(int(argv[1]), int(argv[2]), float(argv[3]))
    parser = argparse.ArgumentParser(prog="python -m benchmarks dataplane", description=__doc__)
    parser.add_argument("--batch", type=int, default=32, help="images per message (default 32)")
    parser.add_argument("--size", type=int, default=224, help="image side (default 224)")
    parser.add_argument(
        "--prefetch", type=int, default=16, help="reorder window = prefetch depth (batches)"
    )
    parser.add_argument("--chunk", type=int, default=4, help="batches per range handed out")
    parser.add_argument(
        "--streams",
        type=int,
        nargs="+",
        default=[1, 2, 4],
        help="streams per server to compare (each its own connection)",
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="transport run length")
    parser.add_argument("--augment-images", type=int, default=300, help="images for the baseline")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON results path")
    args = parser.parse_args(argv)
    result = run(args)
    _print(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
