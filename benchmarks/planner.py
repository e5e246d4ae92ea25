"""``python -m benchmarks planner``: the planner's predicted samples/s against real runs.

On two cores of this machine (trainer on ``--trainer-core``, data servers on ``--server-core``,
one torch thread each), for four configurations of two models and two recipes:

====  ==========================  ===========  =======  =============================
name  model (ViT, 64 px, fp32)    recipe       servers  regime
====  ==========================  ===========  =======  =============================
A     small: 4 blocks, width 96   standard     1        the trainer's step is the limit
B     tiny: 1 block, width 32     standard     1        the data server is the limit
C     tiny                        randaugment  1        the data server is the limit
D     tiny                        randaugment  2        two servers share one core
====  ==========================  ===========  =======  =============================

1. ``hetero bench``'s measurements (``training.planner.bench``): each model's trainer samples/s
   on the trainer core (synthetic batches), each recipe's data-server images/s per core and the
   receive cost, merged into the results store (``--store``, default
   ``benchmarks/results/throughput.json``, where ``hetero plan`` reads);
2. the planner's prediction from those figures (``training.planner.local.predict_local``);
3. the real thing: ``hetero serve`` processes and the trainer entry point, pinned the same way,
   steady-state samples/s from the trainer's ``summary.json``.

Target: every prediction within 15 % of its run. Prints a table and writes
``benchmarks/results/planner.json`` with the machine it ran on.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.offload import BenchmarkError, trainer_summary
from benchmarks.trainer_common import DEFAULT_RESULTS, print_table, report, spec_data
from benchmarks.trainer_common import write_spec as write_spec_file
from training.dataplane.processes import ServerProcess, start_server_process
from training.planner.bench import (
    common_fields,
    cpu_model,
    dataprep_record,
    measure_dataprep,
    measure_trainer,
    merge,
    pinned,
    thread_environ,
    trainer_record,
)
from training.planner.local import LocalTopology, predict_local
from training.planner.results import load_measured
from training.planner.workload import workload_from_spec
from training.spec import load_spec

log = logging.getLogger(__name__)

TARGET = 0.15
SOURCE = "python -m benchmarks planner"
IMAGE_SIZE = 64
BATCH = 32
MODELS: dict[str, dict[str, Any]] = {
    "small": {"patch_size": 8, "depth": 4, "embed_dim": 96, "num_heads": 3},
    "tiny": {"patch_size": 8, "depth": 1, "embed_dim": 32, "num_heads": 2},
}


# Ranges of 8 batches, 16 ahead: few RPC boundaries, at which one stream's server would idle.
DATAPLANE = {"prefetch_batches": 16, "chunk_batches": 8, "workers_per_server": 1}


@dataclass(frozen=True)
class Config:
    name: str
    model: str
    recipe: str
    servers: int


CONFIGS = (
    Config("A", "small", "standard", 1),
    Config("B", "tiny", "standard", 1),
    Config("C", "tiny", "randaugment", 1),
    Config("D", "tiny", "randaugment", 2),
)


def write_spec(path: Path, model: str, recipe: str, steps: int, warmup: int) -> Path:
    """A synthetic-data spec (JPEG bytes decoded per sample by the servers), one epoch long."""
    return write_spec_file(path, spec_data(
        name="bench-planner", model="vit_tiny_patch16_224",
        overrides={"img_size": IMAGE_SIZE, "num_classes": 10, **MODELS[model]},
        image_size=IMAGE_SIZE, batch_size=BATCH, steps=warmup + steps, precision="fp32",
        log_every=warmup, dataprep={"count": 1},
        dataset={"source": "synthetic", "num_samples": (warmup + steps + 4) * BATCH,
                 "num_classes": 10},
        checkpoint={"dir": str(path.parent / "checkpoints")},
        job={"augmentation": recipe, "dataplane": DATAPLANE},
    ))  # fmt: skip


def run_fed(
    spec: Path, run_dir: Path, servers: int, trainer_core: int, server_core: int, timeout_s: float
) -> dict[str, Any]:
    """``servers`` data servers on ``server_core`` feeding the trainer on ``trainer_core``."""
    started: list[ServerProcess] = []
    try:
        with pinned([server_core]), thread_environ(1):
            for _ in range(servers):
                started.append(start_server_process(spec, workers=1, timeout_s=timeout_s))
        addresses = ",".join(s.address for s in started)
        return trainer_summary(
            spec, run_dir, trainer_core, timeout_s, ["--data-servers", addresses]
        )
    finally:
        # The trainer sends Shutdown at job end; stop() waits (or, after a failure, kills).
        for s in started:
            s.stop(timeout_s=10.0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    store = Path(args.store)
    configs = [c for c in CONFIGS if not args.only or c.name in args.only]
    if not configs:
        raise BenchmarkError(f"--only {args.only}: choose from {[c.name for c in CONFIGS]}")
    cpu = cpu_model()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-planner-") as tmp:
        work = Path(tmp)
        specs = {
            (c.model, c.recipe): write_spec(
                work / f"{c.model}-{c.recipe}.toml", c.model, c.recipe, args.steps, args.warmup
            )
            for c in configs
        }
        # 1. hetero bench's figures: each model's trainer, each recipe's data server.
        trainer_entries, dataprep_entries = [], []
        for model in dict.fromkeys(c.model for c in configs):
            spec = load_spec(next(p for (m, _), p in specs.items() if m == model))
            print(f"bench: trainer, {model} model, core {args.trainer_core} ...", flush=True)
            t = measure_trainer(spec, [args.trainer_core], args.warmup, args.steps)
            print(f"  {t.samples_per_s:.1f} samples/s", flush=True)
            trainer_entries.append(trainer_record(spec, t, common_fields(spec, None, SOURCE)))
        for recipe in dict.fromkeys(c.recipe for c in configs):
            path = next(p for (_, r), p in specs.items() if r == recipe)
            spec = load_spec(path)
            print(f"bench: data server, {recipe}, core {args.server_core} ...", flush=True)
            cores = [args.server_core]
            d = measure_dataprep(path, spec, cores, args.batches, [args.trainer_core])
            print(
                f"  {d.images_per_s_per_vcpu:.1f} images/s per core, receive "
                f"{d.receive_images_per_s_per_vcpu:.0f}",
                flush=True,
            )
            common = common_fields(spec, None, SOURCE)
            dataprep_entries.append(dataprep_record(spec, d, cores, common))
        merge(store, trainer_entries, dataprep_entries)
        measured = load_measured(store.parent)
        # 2 and 3: each configuration predicted, then run.
        for c in configs:
            path = specs[(c.model, c.recipe)]
            topology = LocalTopology(1, c.servers, 1, 1)
            workload = workload_from_spec(load_spec(path))
            predicted = predict_local(topology, workload, measured, cpu)
            print(
                f"{c.name}: predicted {predicted.samples_per_s:.1f} samples/s "
                f"({predicted.bound}-bound); running ...",
                flush=True,
            )
            summary = run_fed(
                path,
                work / f"run-{c.name}",
                c.servers,
                args.trainer_core,
                args.server_core,
                args.timeout,
            )
            got = float(summary["samples_per_s"])
            error = (predicted.samples_per_s - got) / got
            print(f"   measured {got:.1f} samples/s: error {error:+.1%}", flush=True)
            rows.append(
                {
                    "config": c.name,
                    "model": c.model,
                    "recipe": c.recipe,
                    "servers": c.servers,
                    "topology": topology.label,
                    "predicted_samples_per_s": predicted.samples_per_s,
                    "bound": predicted.bound,
                    "trainer_side": predicted.trainer_side,
                    "supply": predicted.supply,
                    "measured_samples_per_s": got,
                    "measured_steps": int(summary["measured_steps"]),
                    "data_wait_share": summary.get("data_wait_share"),
                    "error": error,
                    "within_target": abs(error) <= TARGET,
                    "sources": list(predicted.sources),
                }
            )
    return {
        "settings": {
            "trainer_core": args.trainer_core,
            "server_core": args.server_core,
            "steps": args.steps,
            "warmup": args.warmup,
            "batches": args.batches,
            "image_size": IMAGE_SIZE,
            "batch_size": BATCH,
            "models": MODELS,
        },
        "store": str(store),
        "rows": rows,
        "target": TARGET,
        "meets_target": all(r["within_target"] for r in rows),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks planner", description=__doc__)
    parser.add_argument("--trainer-core", type=int, default=0)
    parser.add_argument("--server-core", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60, help="timed trainer steps per run")
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps first")
    parser.add_argument("--batches", type=int, default=80, help="timed data-server batches")
    parser.add_argument("--only", nargs="+", help="configurations to run (default: all)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per process")
    parser.add_argument(
        "--store", default=str(DEFAULT_RESULTS / "throughput.json"), help="results store"
    )
    args = parser.parse_args(argv)
    if args.trainer_core == args.server_core:
        print("planner benchmark: --trainer-core and --server-core must differ", file=sys.stderr)
        return 2
    try:
        result = run(args)
    except BenchmarkError as e:
        print(f"planner benchmark: {e}", file=sys.stderr)
        return 2
    print_table(
        "planner: predicted vs measured samples/s (trainer core / server core)",
        ("config", "model", "recipe", "servers", "predicted", "bound", "measured", "error"),
        [
            (
                r["config"],
                r["model"],
                r["recipe"],
                str(r["servers"]),
                f"{r['predicted_samples_per_s']:.1f}",
                r["bound"],
                f"{r['measured_samples_per_s']:.1f}",
                f"{r['error']:+.1%}",
            )
            for r in result["rows"]
        ],
    )
    return report("planner", result)


if __name__ == "__main__":
    raise SystemExit(main())
