"""Loop overhead: our Trainer on in-memory synthetic batches versus a bare timm + torch loop.

Same model, batch, precision and device, in the same process, runs interleaved (bare, trainer,
bare, trainer, ...) so drifting machine load hits both alike. Target: the trainer reaches at
least 0.97 of the bare loop's samples/s with the recipe's extras off. Usage: ``python -m
benchmarks trainer_overhead [--recipe on]`` (``on``: the cost of the full recipe, recorded in
``trainer_overhead_recipe.json``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.trainer_common import bench_spec, print_table, report, trainer_run
from training.trainer.config import TrainerConfig
from training.trainer.model import build_model

TARGET = 0.97
# ``--recipe off``: the plain loop's work only (constant learning rate, no clipping, no device-side
# augmentation, no EMA). ``--recipe on``: Mixup + CutMix, random erasing, label smoothing,
# clipping, the cosine schedule and a weight EMA, as a full recipe would run.
RECIPES: dict[str, dict[str, Any]] = {
    "off": {"schedule": "constant"},
    "on": {
        "schedule": "cosine",
        "warmup_steps": 2,
        "clip_grad_norm": 1.0,
        "label_smoothing": 0.1,
        "augmentation": {"preset": "standard", "re_prob": 0.25},
        "mixup": {"mixup_alpha": 0.8, "cutmix_alpha": 1.0},
        "ema": {"decay": 0.9998},
    },
}


def bare_loop(spec: Any, steps: int, warmup: int, *, pinned: bool = False) -> float:
    """samples/s of the plainest loop: one uint8 batch, normalised on the device each step;
    ``pinned``: the batch sits in page-locked memory (on a GPU; a bare loop's best case), else
    in ordinary pageable memory. With ``job.compile`` each block is compiled, as the Trainer
    does, so the two compare like for like."""
    import timm.data
    import torch
    import torch.nn.functional as F

    config = TrainerConfig.from_spec(spec, run_dir=".", synthetic=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = config.bf16 and device.type == "cuda"
    model = build_model(config.model, seed=0).to(device)
    if config.compile:
        for block in model.blocks:  # timm's ViT blocks, compiled one by one
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=config.spec.job.lr)
    s, b = config.model.image_size, config.batch_size
    images = torch.randint(0, 256, (b, 3, s, s), dtype=torch.uint8)
    labels = torch.randint(0, config.model.num_classes, (b,))
    if pinned and device.type == "cuda":
        images, labels = images.pin_memory(), labels.pin_memory()
    mean = torch.tensor(timm.data.IMAGENET_DEFAULT_MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(timm.data.IMAGENET_DEFAULT_STD, device=device).view(1, 3, 1, 1)
    started = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
        x = images.to(device, non_blocking=True).float().div_(255).sub_(mean).div_(std)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), labels.to(device, non_blocking=True))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return b * steps / (time.perf_counter() - started)


def trainer_loop(spec: Any, steps: int, warmup: int, work: Path) -> float:
    """samples/s of our Trainer (steady state: its first ``warmup``-step interval left out)."""
    return float(trainer_run(spec, work, steps=warmup + steps)["samples_per_s"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = bench_spec(
        model=args.model, image_size=args.image_size, batch_size=args.batch_size,
        steps=args.steps, precision=args.precision, log_every=args.warmup,
        job={**RECIPES[args.recipe], "compile": args.compile},
    )  # fmt: skip
    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            bare = bare_loop(spec, args.steps, args.warmup)
            ours = trainer_loop(spec, args.steps, args.warmup, Path(tmp) / f"r{i}")
            rounds.append({"bare": bare, "trainer": ours, "ratio": ours / bare})
            print(f"round {i + 1}: bare {bare:.1f}, trainer {ours:.1f} samples/s", flush=True)
    ratio = statistics.median(r["ratio"] for r in rounds)
    return {
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
        "rounds": rounds,
        "bare_samples_per_s": statistics.median(r["bare"] for r in rounds),
        "trainer_samples_per_s": statistics.median(r["trainer"] for r in rounds),
        "ratio_median": ratio,
        "target": TARGET,
        "meets_target": ratio >= TARGET,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="vit-cpu-small", help="timm name or trainer preset")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=40, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--compile", action="store_true")
    p.add_argument(
        "--recipe", choices=sorted(RECIPES), default="off",
        help="off: the trainer's loop against the bare loop; on: with Mixup/CutMix, erasing, "
        "clipping and EMA (the bare loop stays plain)",
    )  # fmt: skip
    # One thread by default: on a shared CPU, intra-op threads spinning against other work
    # make both loops noisy; the comparison is about loop overhead, not CPU scaling.
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: default)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks trainer_overhead")
    add_arguments(parser)
    result = run(parser.parse_args(argv))
    rows = [
        (str(i), f"{r['bare']:.1f}", f"{r['trainer']:.1f}", f"{r['ratio']:.3f}")
        for i, r in enumerate(result["rounds"], 1)
    ]
    bare, ours = result["bare_samples_per_s"], result["trainer_samples_per_s"]
    rows.append(("median", f"{bare:.1f}", f"{ours:.1f}", f"{result['ratio_median']:.3f}"))
    columns = ("round", "bare samples/s", "trainer samples/s", "ratio")
    print_table(f"trainer loop overhead ({result['device']})", columns, rows)
    name = "trainer_overhead" if result["config"]["recipe"] == "off" else "trainer_overhead_recipe"
    return report(name, result, {k: result[k] for k in ("ratio_median", "meets_target")})


if __name__ == "__main__":
    raise SystemExit(main())
