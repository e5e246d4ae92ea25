"""Shared by the trainer benchmarks: a spec for a given model, machine facts, result files."""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from training.planner.specfile import dumps
from training.spec import ClusterSpec, load_spec, parse_spec
from training.trainer.config import TrainerConfig
from training.trainer.train import Trainer

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"


def spec_data(
    *,
    model: str,
    image_size: int,
    batch_size: int,
    steps: int,
    name: str = "bench",
    overrides: dict[str, Any] | None = None,
    precision: str = "bf16",
    log_every: int = 10,
    trainer: dict[str, Any] | None = None,
    dataprep: dict[str, Any] | None = None,
    dataset: dict[str, Any] | None = None,
    checkpoint: dict[str, Any] | None = None,
    job: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A benchmark's spec as data: one g5.xlarge trainer (``trainer``: more keys of its group),
    a c6i.4xlarge dataprep group of the keys ``dataprep`` (None: no group), ``dataset``'s keys
    besides the image size (default: 2**20 synthetic samples of 1000 classes), ``checkpoint``
    over no periodic save into ``runs/bench/checkpoints``, ``job`` added to ``[job]``."""
    groups = [
        {"name": "trainer", "role": "trainer", "instance_types": ["g5.xlarge"], "count": 1}
        | (trainer or {})
    ]
    if dataprep is not None:
        groups.append(
            {"name": "dataprep", "role": "dataprep", "instance_types": ["c6i.4xlarge"], **dataprep}
        )
    return {
        "name": name,
        "groups": groups,
        "job": {
            "batch_size": batch_size,
            "steps": steps,
            "precision": precision,
            "log_every_steps": log_every,
            "model": {"name": model, "overrides": overrides or {}},
            "dataset": (dataset or {"num_samples": 1 << 20, "num_classes": 1000})
            | {"image_size": image_size},
            "checkpoint": {"interval_steps": 1 << 30, "dir": "runs/bench/checkpoints"}
            | (checkpoint or {}),
            **(job or {}),
        },
    }


def bench_spec(**kwargs: Any) -> ClusterSpec:
    """``spec_data(**kwargs)`` parsed, for benchmarks that run the trainer in this process."""
    return parse_spec(spec_data(**kwargs), source="benchmark spec")


def write_spec(path: Path, data: dict[str, Any]) -> Path:
    """``data`` (``spec_data``) as a spec file, for benchmarks that start processes; validated by
    ``load_spec`` before any run."""
    path.write_text(dumps(data))
    load_spec(path)
    return path


def trainer_run(spec: ClusterSpec, work: Path, *, steps: int | None = None) -> dict[str, Any]:
    """Our Trainer in this process on in-memory synthetic batches (``steps``: stop there, as
    ``--steps`` does), run dir and checkpoints under ``work``; its summary."""
    config = TrainerConfig.from_spec(
        spec, run_dir=work / "run", synthetic=True, checkpoint_dir=work / "ckpt", steps=steps,
        emf=False,
    )  # fmt: skip
    trainer = Trainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    return dict(trainer.summary)


def machine() -> dict[str, Any]:
    """Where the figures come from."""
    import torch

    info: dict[str, Any] = {
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def print_table(
    title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], *, left: int = 0
) -> None:
    """A table on the console; its first ``left`` columns aligned left, the others right."""
    table = Table(title=title)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i < left else "right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def run_facts(args: argparse.Namespace) -> dict[str, Any]:
    """Sets torch's CPU threads to ``args.threads`` (0: its default); the run's flags and
    threads, the start of its result."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    return {"config": config, "threads": torch.get_num_threads()}


def report(name: str, result: dict[str, Any], summary: dict[str, Any] | None = None) -> int:
    """Writes the result file (``write_result``), then prints ``summary`` (default: whether the
    target is met) as JSON and where the file is; 0, ``main``'s exit code."""
    path = write_result(name, result)
    summary = {"meets_target": result["meets_target"]} if summary is None else summary
    print(json.dumps(summary), f"-> {path}")
    return 0


def write_result(name: str, result: dict[str, Any]) -> Path:
    """``benchmarks/results/<name>.json`` (or under $BENCH_RESULTS_DIR) with the machine facts."""
    results = Path(os.environ.get("BENCH_RESULTS_DIR", DEFAULT_RESULTS))
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **result}, indent=2))
    return path
