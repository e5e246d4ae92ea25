"""GPU throughput: ViT-B/16 bf16 through our Trainer; samples/s and MFU.

MFU counts 105 GFLOP per training image at 224 px (forward + backward; torch's FlopCounterMode
gives 105.15e9 for vit_base_patch16_224) against the peak bf16 table in
``training.trainer.metrics``. Out of memory: retries with half the batch. ``--device cpu
--steps 2`` is a smoke mode that runs anywhere. Usage: ``python -m benchmarks trainer_gpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FLOPS_PER_IMAGE_224 = 105e9
TARGET_H100 = 3000.0


def measure(args: argparse.Namespace, batch_size: int, work: Path) -> dict[str, Any]:
    """One Trainer run; raises torch.OutOfMemoryError when the batch does not fit."""
    import torch

    from benchmarks.trainer_common import bench_spec
    from training.trainer.config import TrainerConfig
    from training.trainer.train import Trainer

    warmup = max(1, min(args.warmup, args.steps - 1)) if args.steps > 1 else 1
    spec = bench_spec(
        model=args.model, image_size=args.image_size, batch_size=batch_size,
        steps=warmup + args.steps, precision="bf16", compile=args.compile, log_every=warmup,
    )  # fmt: skip
    config = TrainerConfig.from_spec(
        spec, run_dir=work / "run", synthetic=True, checkpoint_dir=work / "ckpt"
    )
    trainer = Trainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return dict(trainer.summary)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from training.trainer.metrics import peak_flops

    batch = args.batch_size
    attempts = []
    with tempfile.TemporaryDirectory() as tmp:
        while True:
            try:
                summary = measure(args, batch, Path(tmp) / f"b{batch}")
                break
            except torch.OutOfMemoryError:
                attempts.append(batch)
                if batch == 1:
                    raise
                batch //= 2
                print(f"out of memory: retrying with batch {batch}", flush=True)
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = peak_flops(name) if cuda else None
    sps = float(summary["samples_per_s"])
    if (args.model, args.image_size) == ("vit_base_patch16_224", 224):
        flops = FLOPS_PER_IMAGE_224
    else:  # Another model or size: count it.
        from training.trainer.config import ModelConfig
        from training.trainer.model import training_flops_per_sample

        flops = training_flops_per_sample(ModelConfig(args.model, {}, args.image_size, 1000))
    return {
        "config": vars(args),
        "device": name,
        "batch_size": batch,
        "oom_batch_sizes": attempts,
        "samples_per_s": sps,
        "step_time_s": summary["step_time_s"],
        "flops_per_image": flops,
        "peak_flops": peak,
        "mfu": sps * flops / peak if peak else None,
        "mfu_trainer": summary.get("mfu"),
        "gpu_util_pct": summary.get("gpu_util_pct"),
        "memory": summary.get("memory_per_rank"),
        "target_images_per_s_h100": TARGET_H100,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks trainer_gpu")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # Before torch initialises CUDA.
    from rich.console import Console
    from rich.table import Table

    from benchmarks.trainer_common import write_result

    result = run(args)
    table = Table(title=f"{args.model} bf16 on {result['device']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    mfu = result["mfu"]
    for k, v in (
        ("batch size", str(result["batch_size"])),
        ("samples/s", f"{result['samples_per_s']:,.1f}"),
        ("step time", f"{result['step_time_s'] * 1e3:.1f} ms"),
        ("MFU", f"{mfu * 100:.1f}%" if mfu is not None else "-"),
        ("compile", str(args.compile)),
    ):
        table.add_row(k, v)
    Console().print(table)
    path = write_result("trainer_gpu" if args.device == "cuda" else "trainer_gpu_cpu_smoke", result)
    print(json.dumps({k: result[k] for k in ("samples_per_s", "mfu", "batch_size")}), f"-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
