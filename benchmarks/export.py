"""``python -m benchmarks export``: how long ``hetero export`` takes for ViT-B/16.

A checkpoint as a real job writes it: ``vit_base_patch16_224`` (86 M parameters, 1000 classes,
fp32) trained one AdamW step by 2 gloo ranks with FSDP2 (the trainer's ``parallelize``), with
a weight EMA beside it (full tensors on every rank, as the trainer keeps it), saved by the
project's ``Checkpointer`` into ``step-1/``: the model as 2 ranks' shards, the EMA, the AdamW
state (about 1.4 GB in all). Then, in this process (no process group), ``export_checkpoint``
reads the EMA weights (DCP reshards the 2 ranks' files) and writes ``model.safetensors`` +
``config.json``: one warm-up, then ``--repeats`` timed runs (the median is the figure). Also
timed once: ``hetero export`` as a fresh process (Python, torch and timm imports included),
and with ``--s3`` an S3-to-S3 export through a moto server in its own process on 127.0.0.1.

Target: under 30 s. Prints a table and writes ``benchmarks/results/export.json`` with the
machine. ``--model vit-cpu-tiny --image-size 32 --num-classes 10`` is a smoke mode.
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.checkpoint import moto_s3
from benchmarks.trainer_common import print_table, report, run_facts, spec_data, write_spec
from training.common.steps import MARKER
from training.spec import load_spec
from training.trainer.checkpoint import Checkpointer
from training.trainer.checkpoint_s3 import S3CheckpointStore
from training.trainer.config import TrainerConfig
from training.trainer.export import export_checkpoint
from training.trainer.local_run import FORKSERVER_PRELOAD, free_port
from training.trainer.model import build_model
from training.trainer.parallel_dims import ParallelDims
from training.trainer.parallelize import parallelize

TARGET_S = 30.0
REPO = Path(__file__).resolve().parents[1]


def spec_file(args: argparse.Namespace, work: Path) -> Path:
    """The spec the checkpoint is written and exported with (``hetero export --spec`` too)."""
    data = spec_data(
        model=args.model, image_size=args.image_size, batch_size=1, steps=1, precision="fp32",
        trainer={"processes_per_instance": args.ranks},
        dataset={"num_samples": 1 << 20, "num_classes": args.num_classes},
        checkpoint={"dir": str(work / "checkpoints")},
        job={"parallelism": {"strategy": args.strategy}},
    )  # fmt: skip
    return write_spec(work / "spec.toml", data)


def _rank(rank: int, port: int, args: argparse.Namespace, work: Path) -> None:
    """One of the ranks that train one step and save ``step-1`` with an EMA beside the model."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    world = args.ranks
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    torch.set_num_threads(1)
    config = TrainerConfig.from_spec(
        load_spec(work / "spec.toml"), run_dir=work / "run", synthetic=True
    )
    model = build_model(config.model, seed=0)
    ema = copy.deepcopy(model) if args.ema else None
    dims = ParallelDims.resolve(config.parallel, world_size=world, local_world_size=world)
    model = parallelize(model, dims, dims.build_mesh("cpu"), torch.device("cpu"), bf16=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    size = args.image_size
    x = torch.randn(1, 3, size, size, generator=g)
    y = torch.randint(0, args.num_classes, (1,), generator=g)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    ckpt = Checkpointer(config.checkpoint.dir, keep=1, rank=rank, world_size=world)
    if ema is not None:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        with torch.no_grad():
            for key, value in ema.state_dict().items():
                value.lerp_(full[key], 0.5)
        del full
        ckpt.extra["ema"] = ema
    ckpt.save(1, model, opt, {"rank": rank})
    dist.destroy_process_group()


def write_checkpoint(args: argparse.Namespace, work: Path) -> Path:
    import torch.multiprocessing as torch_mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    torch_mp.start_processes(
        _rank, args=(free_port(), args, work), nprocs=args.ranks, start_method="forkserver"
    )
    return work / "checkpoints" / "step-1"


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run(args: argparse.Namespace) -> dict[str, Any]:
    result = run_facts(args) | {"load_average_at_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        work = Path(tmp)
        spec_path = spec_file(args, work)
        spec = load_spec(spec_path)
        t0 = time.perf_counter()
        step = write_checkpoint(args, work)
        result["checkpoint_write_s"] = time.perf_counter() - t0
        print(
            f"checkpoint written by {args.ranks} {args.strategy} ranks in "
            f"{time.perf_counter() - t0:.1f}s: {_size(step) / 1e6:.0f} MB",
            flush=True,
        )
        runs = []
        for i in range(args.repeats + 1):  # the first is the warm-up
            out = work / f"out-{i}"
            r = export_checkpoint(str(work / "checkpoints"), spec=spec, out=str(out))
            runs.append({"seconds": r.seconds, "read_s": r.read_s, "write_s": r.write_s})
            print(
                f"export {'warm-up' if i == 0 else i}: {r.seconds:.2f}s "
                f"(read {r.read_s:.2f}s, write {r.write_s:.2f}s)",
                flush=True,
            )
        timed = runs[1:]
        cli = _cli(spec_path, work)
        print(f"hetero export as a new process: {cli['seconds']:.2f}s", flush=True)
        result.update(
            parameters=r.parameters,
            weights=r.weights,
            checkpoint_mb=_size(step) / 1e6,
            checkpoint_files=sorted(p.name for p in step.iterdir()),
            model_mb=r.bytes / 1e6,
            runs=timed,
            warmup=runs[0],
            seconds_median=statistics.median(x["seconds"] for x in timed),
            read_s_median=statistics.median(x["read_s"] for x in timed),
            write_s_median=statistics.median(x["write_s"] for x in timed),
            cli=cli,
        )
        if args.s3:
            result["s3"] = _s3(args, work, step, spec)
            print(f"export S3 -> S3: {result['s3']['seconds']:.2f}s", flush=True)
    result["target_s"] = TARGET_S
    result["meets_target"] = result["seconds_median"] < TARGET_S and cli["seconds"] < TARGET_S
    return result


def _cli(spec_path: Path, work: Path) -> dict[str, Any]:
    """``hetero export`` in a new process, timed from its start to its exit."""
    cmd = [
        sys.executable,
        "-m",
        "training.cli",
        "--log-level",
        "WARNING",
        "export",
        "--spec",
        str(spec_path),
        "--checkpoint",
        str(work / "checkpoints"),
        "--out",
        str(work / "out-cli"),
    ]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"hetero export failed: {done.stderr[-2000:]}")
    return {"seconds": seconds, "stdout": done.stdout.splitlines()}


def _s3(args: argparse.Namespace, work: Path, step: Path, spec: Any) -> dict[str, Any]:
    """Upload the checkpoint to a moto server, then export it from S3 to S3."""
    with moto_s3() as bucket:
        store = S3CheckpointStore(f"{bucket}/ckpt")
        store.upload_files(step, 1)
        store.upload_marker(step / MARKER, 1)
        r = export_checkpoint(f"{bucket}/ckpt", spec=spec, out=f"{bucket}/model")
    return {
        "seconds": r.seconds,
        "read_s": r.read_s,
        "write_s": r.write_s,
        "target": "s3 (moto on 127.0.0.1, own process)",
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="vit_base_patch16_224", help="timm name or preset")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks that write the checkpoint")
    p.add_argument("--strategy", default="fsdp", choices=("fsdp", "ddp"))
    p.add_argument("--no-ema", dest="ema", action="store_false", help="no EMA in the checkpoint")
    p.add_argument("--repeats", type=int, default=3, help="timed exports after one warm-up")
    p.add_argument("--s3", action="store_true", help="also S3 -> S3 through a moto server")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks export")
    add_arguments(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = run(args)
    r, target = result, f"< {TARGET_S:.0f}"
    rows = [
        (
            f"export_checkpoint, median of {args.repeats} (read; write)",
            f"{r['seconds_median']:.2f} ({r['read_s_median']:.2f}; {r['write_s_median']:.2f})",
            target,
        ),
        ("hetero export, a new process", f"{r['cli']['seconds']:.2f}", target),
    ]
    if "s3" in r:
        rows.append(("S3 -> S3 (moto)", f"{r['s3']['seconds']:.2f}", ""))
    title = (
        f"export: {args.model}, {r['parameters'] / 1e6:.1f}M parameters, {r['weights']} weights "
        f"of a {r['checkpoint_mb']:.0f} MB checkpoint ({args.ranks} {args.strategy} ranks)"
    )
    print_table(title, ("measure", "seconds", "target"), rows, left=1)
    return report("export", result)


if __name__ == "__main__":
    sys.exit(main())
