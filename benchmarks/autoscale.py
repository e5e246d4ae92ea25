"""``python -m benchmarks autoscale``: the elastic data tier against fixed counts, on this machine.

The same job run with ``hetero local`` several times: with an elastic dataprep group (starting
at 1 server, between 1 and ``--max-count``) and with each fixed count from 1 to ``--max-count``.
Every data server is throttled to ``--rate`` images/s (``HETERO_SERVE_MAX_IMAGES_PER_S``: on 2
cores more processes add no CPU, so the throttle makes each server a fixed amount of capacity,
as an instance is) and the trainer is paced (``HETERO_MIN_STEP_S``: a GPU of a fixed speed)
with two phases: fast first (it needs several servers), then slower (it needs fewer), as when a
larger model is switched in.

For each run: wall time of training, the median data-wait share of each phase (its first
intervals left out), server-seconds (the servers serving, integrated over the training time),
trainer-seconds, and USD at the spec's prices (one g5.xlarge trainer, c6i.4xlarge servers,
Spot). For the elastic run also: the decisions, and the time from the start of training to
steady state (the first interval served by the count the controller settled on in phase 1).
Writes ``benchmarks/results/autoscale.json`` with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.trainer_common import print_table, spec_data, write_result, write_spec
from training.spec import Market, PricesSpec


def run_once(
    args: argparse.Namespace, work: Path, name: str, counts: dict[str, int]
) -> dict[str, Any]:
    run = work / name
    tiny = {"img_size": 32, "patch_size": 8, "depth": 1, "embed_dim": 32, "num_heads": 2}
    data = spec_data(
        name="autoscale-bench", model="vit_tiny_patch16_224", overrides=tiny | {"num_classes": 10},
        image_size=32, batch_size=16, steps=args.switch_step + args.slow_steps, precision="fp32",
        log_every=5, dataprep=counts,
        dataset={"source": "synthetic", "num_samples": 1600, "num_classes": 10},
        checkpoint={"interval_steps": 100000, "dir": f"{run}/checkpoints"},
        job={"lr": 1e-3, "augmentation": "standard", "dataplane": {
            "port": 50400, "refresh_s": 1.0, "workers_per_server": 1,
            "autoscale_target_wait": args.target, "autoscale_window": 3,
            "autoscale_cooldown_s": 3.0,
        }},
    )  # fmt: skip
    spec = write_spec(work / f"{name}.toml", data)
    env = {
        **os.environ,
        "HETERO_SERVE_MAX_IMAGES_PER_S": str(args.rate),
        "HETERO_MIN_STEP_S": f"{args.fast_s},{args.switch_step}:{args.slow_s}",
        "OMP_NUM_THREADS": "1",
    }
    print(f"{name}: running", flush=True)
    proc = subprocess.run(
        [sys.executable, "-m", "training.cli", "local", "--spec", str(spec), "--run-dir",
         str(run), "--nproc", "1"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "samples_per_s" in r]
    decisions_path = run / "autoscale.jsonl"
    decisions = (
        [json.loads(line) for line in decisions_path.read_text().splitlines()]
        if decisions_path.exists()
        else []
    )
    return summarise(args, name, train, decisions)


def summarise(
    args: argparse.Namespace,
    name: str,
    train: list[dict[str, Any]],
    decisions: list[dict[str, Any]],
) -> dict[str, Any]:
    fixed = None if name == "elastic" else int(name.split("-")[1])
    # Each record covers the steps since the one before: step_time_s x steps seconds.
    start = train[0]["time"] - train[0]["step_time_s"] * train[0]["steps"]
    server_s = trainer_s = 0.0
    previous = start
    for r in train:
        span = r["time"] - previous
        previous = r["time"]
        trainer_s += span
        server_s += span * (fixed if fixed is not None else r["data_servers"])
    skip = 3  # a phase's first intervals: the pipeline filling, the pace changing

    def wait(low: int, high: int) -> float:
        phase = [r for r in train if low < r["step"] <= high]
        return statistics.median(r["data_wait_share"] for r in phase[skip:])

    prices = PricesSpec()
    usd = (
        trainer_s * prices.hourly("g5.xlarge", Market.SPOT)
        + server_s * prices.hourly("c6i.4xlarge", Market.SPOT)
    ) / 3600
    row: dict[str, Any] = {
        "run": name,
        "training_s": round(trainer_s, 1),
        "server_s": round(server_s, 1),
        "wait_fast": wait(0, args.switch_step),
        "wait_slow": wait(args.switch_step, args.switch_step + args.slow_steps),
        "usd": usd,
        "decisions": [
            {k: d[k] for k in ("step", "from_count", "to_count", "acted", "reason")}
            for d in decisions
        ],
    }
    if fixed is None:
        grown = [d for d in decisions if d["acted"] and d["step"] <= args.switch_step]
        if grown:
            count = grown[-1]["to_count"]
            steady = next(
                (r for r in train if r["step"] > grown[-1]["step"] and r["data_servers"] == count),
                None,
            )
            row["steady_after_s"] = round(steady["time"] - start, 1) if steady else None
            first = grown[0]["step"]
            before = [r for r in train if r["step"] <= first]
            row["wait_before"] = statistics.median(r["data_wait_share"] for r in before)
    return row


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, default=60.0, help="images/s per data server")
    p.add_argument("--fast-s", type=float, default=0.1, help="seconds per step, first phase")
    p.add_argument("--slow-s", type=float, default=0.6, help="seconds per step, second phase")
    p.add_argument("--switch-step", type=int, default=300, help="where the second phase starts")
    p.add_argument("--slow-steps", type=int, default=60, help="steps of the second phase")
    p.add_argument("--max-count", type=int, default=4)
    p.add_argument("--target", type=float, default=0.05, help="target data-wait share")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks autoscale")
    add_arguments(parser)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        elastic = {"count": 1, "min_count": 1, "max_count": args.max_count}
        rows.append(run_once(args, work, "elastic", elastic))
        for n in range(1, args.max_count + 1):
            rows.append(run_once(args, work, f"fixed-{n}", {"count": n}))
    under = [r for r in rows[1:] if r["wait_fast"] < args.target and r["wait_slow"] < args.target]
    smallest = under[0]["run"] if under else None
    print_table(
        f"data tier: elastic vs fixed ({args.rate:g} images/s a server; steps at "
        f"{args.fast_s:g} s, then {args.slow_s:g} s from step {args.switch_step})",
        ("run", "training s", "server-s", "wait fast", "wait slow", "USD"),
        [
            (
                r["run"] + (" (smallest under target)" if r["run"] == smallest else ""),
                f"{r['training_s']:.1f}",
                f"{r['server_s']:.0f}",
                f"{r['wait_fast']:.1%}",
                f"{r['wait_slow']:.1%}",
                f"{r['usd']:.5f}",
            )
            for r in rows
        ],
        left=1,
    )
    for d in rows[0]["decisions"]:
        print(f"  step {d['step']}: {d['from_count']} -> {d['to_count']}: {d['reason']}")
    result = {
        "config": vars(args),
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "smallest_fixed_under_target": smallest,
        "runs": rows,
    }
    path = write_result("autoscale", result)
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
