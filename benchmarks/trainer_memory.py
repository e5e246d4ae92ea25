"""Memory per rank: ``hsdp`` (2x2 mesh) versus ``ddp`` on the same model, 4 CPU processes.

Each rank reports the bytes of parameters, gradients and optimizer state it holds, measured
from the tensors' local shards after the first optimizer step, and its peak RSS. Sharding
should cut the first three by about the shard degree (2 here). Usage:
``python -m benchmarks trainer_memory``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.trainer_common import print_table, report, spec_data, write_spec
from training.trainer.local_run import run_local

STATE_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes")


def run_strategy(args: argparse.Namespace, strategy: str, work: Path) -> list[dict[str, int]]:
    """Train a few steps on 4 local ranks; the per-rank memory report."""
    # The ranks load the spec from a file, as under torchrun.
    path = write_spec(work / f"{strategy}.toml", _spec(args, strategy, work))
    argv = ["--spec", str(path), "--run-dir", str(work / strategy), "--synthetic-data",
            "--checkpoint-dir", str(work / f"{strategy}-ckpt")]  # fmt: skip
    codes = run_local(argv, 4, env={"OMP_NUM_THREADS": "1"}, timeout=args.timeout)
    if codes != [0, 0, 0, 0]:
        raise RuntimeError(f"{strategy}: ranks exited with {codes}")
    summary = json.loads((work / strategy / "summary.json").read_text())
    return list(summary["memory_per_rank"])


def _spec(args: argparse.Namespace, strategy: str, work: Path) -> dict[str, Any]:
    """The spec the ranks load: 2 instances x 2 ranks, so HSDP's 2x2 mesh is the topology's."""
    par = {"shard_degree": 2, "replicate_degree": 2} if strategy == "hsdp" else {}
    return spec_data(
        name="bench-memory", model=args.model, overrides=json.loads(args.overrides),
        image_size=args.image_size, batch_size=args.batch_size, steps=args.steps,
        precision="fp32", log_every=1, trainer={"count": 2, "processes_per_instance": 2},
        dataset={"num_samples": 4096, "num_classes": 100},
        checkpoint={"interval_steps": 1000000, "dir": str(work / f"{strategy}-ckpt")},
        job={"parallelism": {"strategy": strategy, **par}},
    )  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"config": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in ("ddp", "hsdp"):
            ranks = run_strategy(args, strategy, Path(tmp))
            state = [sum(r[k] for k in STATE_KEYS) for r in ranks]
            out[strategy] = {
                "per_rank": ranks,
                "state_bytes_mean": statistics.mean(state),
                "peak_rss_bytes_mean": statistics.mean(r["peak_rss_bytes"] for r in ranks),
            }
    out["state_ratio_hsdp_over_ddp"] = (
        out["hsdp"]["state_bytes_mean"] / out["ddp"]["state_bytes_mean"]
    )
    out["rss_ratio_hsdp_over_ddp"] = (
        out["hsdp"]["peak_rss_bytes_mean"] / out["ddp"]["peak_rss_bytes_mean"]
    )
    out["shard_degree"] = 2
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="vit_small_patch16_224", help="timm name or preset")
    p.add_argument(
        "--overrides", default='{"patch_size": 8}', help="timm overrides as JSON (small tokens)"
    )
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=480)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks trainer_memory")
    add_arguments(parser)
    result = run(parser.parse_args(argv))
    mib = 2**20
    rows = [
        (
            s,
            *(f"{result[s]['per_rank'][0][k] / mib:.1f}" for k in STATE_KEYS),
            f"{result[s]['state_bytes_mean'] / mib:.1f}",
            f"{result[s]['peak_rss_bytes_mean'] / mib:.0f}",
        )
        for s in ("ddp", "hsdp")
    ]
    print_table(
        f"memory per rank, 4 CPU processes ({result['config']['model']})",
        ("strategy", "params MiB", "grads MiB", "optimizer MiB", "state MiB", "peak RSS MiB"),
        rows,
    )
    keys = ("state_ratio_hsdp_over_ddp", "rss_ratio_hsdp_over_ddp")
    return report("trainer_memory", result, {k: result[k] for k in keys})


if __name__ == "__main__":
    raise SystemExit(main())
