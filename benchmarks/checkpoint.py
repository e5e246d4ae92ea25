"""``python -m benchmarks checkpoint``: what a Spot stop and a periodic save cost the trainer.

The real ``Trainer`` in this process, ViT-B/16 (``vit_base_patch16_224``, 86 M parameters, fp32)
with its AdamW state (about 1 GB to save), on in-memory synthetic batches:

a. **Stop to durable**: SIGTERM is sent to this process during a step; at the next step boundary
   every rank agrees to stop, and the trainer saves. Measured from that boundary to the
   ``COMPLETE`` marker written (``summary.json``'s ``checkpoint.final_save_s``), into a local
   folder and into S3 emulated by a moto server in its own process on 127.0.0.1 (the upload
   goes through boto3 as on AWS; the marker is uploaded last). Target: at most 20 s, inside the
   two minutes of a Spot interruption notice with room for the step in flight.
b. **Stall per save**: the time the training loop spends on each periodic save, with the
   synchronous save and with ``job.checkpoint.async_save`` (the loop only waits for the copy of
   the state into host memory; the write runs on a thread). Target for async: at most 1 s.

Prints a table and writes ``benchmarks/results/checkpoint.json`` with the machine.
``--model vit-cpu-tiny --image-size 32`` is the smoke mode the tests run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.trainer_common import bench_spec, print_table, report, run_facts
from training.common import aws
from training.trainer.config import TrainerConfig
from training.trainer.train import Trainer

STOP_TARGET_S = 20.0
STALL_TARGET_S = 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def moto_s3() -> Iterator[str]:
    """A moto server in its own process on 127.0.0.1 with one bucket; yields ``s3://bucket``
    and points this process's boto3 at it."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    names = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        deadline = time.monotonic() + 60
        while True:
            try:
                aws.client().create_bucket(Bucket=bucket)
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the moto server did not start") from None
                time.sleep(0.2)
        yield f"s3://{bucket}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_trainer(
    args: argparse.Namespace,
    work: Path,
    *,
    steps: int,
    interval: int,
    async_save: bool = False,
    s3_uri: str | None = None,
    sigterm_at_step: int | None = None,
) -> dict[str, Any]:
    """One trainer run; with ``sigterm_at_step``, SIGTERM arrives during the step after it."""
    spec = bench_spec(
        model=args.model, image_size=args.image_size, batch_size=args.batch_size, steps=steps,
        precision="fp32", log_every=1, checkpoint={"dir": str(work / "checkpoints"),
        "interval_steps": interval, "async_save": async_save, "keep": 2},
    )  # fmt: skip
    config = TrainerConfig.from_spec(
        spec, run_dir=work / "run", synthetic=True, checkpoint_s3_uri=s3_uri
    )
    trainer = Trainer(config)
    ended = threading.Event()
    watcher = None
    if sigterm_at_step is not None:

        def stop_during_next_step() -> None:
            while trainer.step < sigterm_at_step and not ended.is_set():
                time.sleep(0.005)
            if not ended.is_set():
                os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler: a flag

        watcher = threading.Thread(target=stop_during_next_step, daemon=True)
        watcher.start()
    try:
        trainer.train()
    finally:
        ended.set()
        if watcher is not None:
            watcher.join(5)
        trainer.close()
    summary = dict(trainer.summary)
    memory = summary["memory_per_rank"][0]
    summary["state_bytes"] = memory.get("param_bytes", 0) + memory.get("optimizer_bytes", 0)
    saved = trainer.policy.checkpoint_step
    folder = work / "checkpoints" / f"step-{saved}"
    summary["checkpoint_bytes"] = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return summary


def stop_to_durable(args: argparse.Namespace, work: Path, s3_uri: str | None) -> dict[str, Any]:
    summary = run_trainer(
        args, work, steps=1_000_000, interval=1 << 30, s3_uri=s3_uri, sigterm_at_step=1
    )
    ckpt = summary["checkpoint"]
    assert summary["outcome"] == "stopped" and ckpt["checkpoint_step"] == summary["steps"]
    seconds = float(ckpt["final_save_s"])
    return {
        "target": "s3 (moto on 127.0.0.1, own process)" if s3_uri else "local folder",
        "stopped_at_step": summary["steps"],
        "seconds": seconds,
        "checkpoint_mb": summary["checkpoint_bytes"] / 1e6,
        "state_mb": summary["state_bytes"] / 1e6,
        "meets_target": seconds <= STOP_TARGET_S,
    }


def stalls(args: argparse.Namespace, work: Path, async_save: bool) -> dict[str, Any]:
    # One more interval after the last periodic save (less a step, so the run's own last save
    # is a separate one): the last background write has time to finish, as in a long run.
    summary = run_trainer(
        args, work, steps=(args.saves + 1) * args.interval - 1, interval=args.interval,
        async_save=async_save,
    )  # fmt: skip
    periodic = [r for r in summary["checkpoint"]["saves"] if r["reason"] == "interval"]
    assert all(r["saved"] for r in periodic), periodic
    per_save = [float(r["stall_s"]) for r in periodic]
    return {
        "mode": "async" if async_save else "sync",
        "saves": len(per_save),
        "stall_s": per_save,
        "stall_s_median": statistics.median(per_save),
        "stall_s_max": max(per_save),
        "step_time_s": summary["step_time_s"],
        "checkpoint_mb": summary["checkpoint_bytes"] / 1e6,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    result = run_facts(args)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        stops = [stop_to_durable(args, work / "stop-local", None)]
        print(f"stop to durable, local: {stops[-1]['seconds']:.2f}s", flush=True)
        if not args.skip_s3:
            with moto_s3() as bucket:
                stops.append(stop_to_durable(args, work / "stop-s3", f"{bucket}/ckpt"))
            print(f"stop to durable, S3: {stops[-1]['seconds']:.2f}s", flush=True)
        modes = []
        for async_save in (False, True):
            name = "async" if async_save else "sync"
            modes.append(stalls(args, work / f"stall-{name}", async_save))
            print(f"stall per save, {name}: {modes[-1]['stall_s']}", flush=True)
    async_row = modes[1]
    result.update(
        stop_to_durable=stops,
        stall_per_save=modes,
        targets={"stop_to_durable_s": STOP_TARGET_S, "async_stall_s": STALL_TARGET_S},
        meets_targets=all(s["meets_target"] for s in stops)
        and async_row["stall_s_max"] <= STALL_TARGET_S,
    )
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="vit_base_patch16_224", help="timm name or preset")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--saves", type=int, default=3, help="periodic saves per stall run")
    p.add_argument("--interval", type=int, default=3, help="steps between periodic saves")
    p.add_argument("--skip-s3", action="store_true", help="no moto server (local folder only)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks checkpoint")
    add_arguments(parser)
    args = parser.parse_args(argv)
    result = run(args)
    state_mb = result["stop_to_durable"][0]["state_mb"]
    stops = [
        (f"stop to durable, {s['target']}", f"{s['seconds']:.2f}", f"<= {STOP_TARGET_S:.0f}")
        for s in result["stop_to_durable"]
    ]
    saves = [
        (
            f"stall per save, {m['mode']} (median; max)",
            f"{m['stall_s_median']:.2f}; {m['stall_s_max']:.2f}",
            f"<= {STALL_TARGET_S:.0f}" if m["mode"] == "async" else "",
        )
        for m in result["stall_per_save"]
    ]
    title = f"checkpoints: {args.model}, {state_mb:.0f} MB of state"
    print_table(title, ("measure", "seconds", "target"), stops + saves, left=1)
    return report("checkpoint", result, {"meets_targets": result["meets_targets"]})


if __name__ == "__main__":
    raise SystemExit(main())
