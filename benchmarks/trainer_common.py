"""Shared by the trainer benchmarks: a spec for a given model, machine facts, result files."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

from training.spec import ClusterSpec, parse_spec

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"


def bench_spec(
    *,
    model: str,
    overrides: dict[str, Any] | None = None,
    image_size: int,
    batch_size: int,
    steps: int,
    precision: str = "bf16",
    compile: bool = False,
    strategy: str = "ddp",
    ranks: int = 1,
    log_every: int = 10,
    checkpoint_dir: str = "runs/bench/checkpoints",
    extra_parallel: dict[str, Any] | None = None,
    checkpoint: dict[str, Any] | None = None,
    job: dict[str, Any] | None = None,
) -> ClusterSpec:
    """A one-trainer spec (priced as one g5.xlarge) for benchmarking the trainer alone;
    ``checkpoint`` adds to (or overrides) ``job.checkpoint`` (default: no periodic save), ``job``
    to ``[job]`` (e.g. the recipe)."""
    return parse_spec(
        {
            "name": "bench",
            "groups": [
                {
                    "name": "trainer",
                    "role": "trainer",
                    "instance_types": ["g5.xlarge"],
                    "count": 1,
                    "processes_per_instance": ranks,
                }
            ],
            "job": {
                "batch_size": batch_size,
                "steps": steps,
                "precision": precision,
                "compile": compile,
                "log_every_steps": log_every,
                "model": {"name": model, "overrides": overrides or {}},
                "dataset": {"num_samples": 1 << 20, "num_classes": 1000, "image_size": image_size},
                "checkpoint": {
                    "interval_steps": 1 << 30,
                    "dir": checkpoint_dir,
                    **(checkpoint or {}),
                },
                "parallelism": {"strategy": strategy, **(extra_parallel or {})},
                **(job or {}),
            },
        },
        source="benchmark spec",
    )


def trainer_run(spec: ClusterSpec, work: Path, *, steps: int | None = None) -> dict[str, Any]:
    """Our Trainer in this process on in-memory synthetic batches (``steps``: stop there, as
    ``--steps`` does), run dir and checkpoints under ``work``; its summary."""
    from training.trainer.config import TrainerConfig
    from training.trainer.train import Trainer

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


def write_result(name: str, result: dict[str, Any]) -> Path:
    """``benchmarks/results/<name>.json`` (or under $BENCH_RESULTS_DIR) with the machine facts."""
    results = Path(os.environ.get("BENCH_RESULTS_DIR", DEFAULT_RESULTS))
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **result}, indent=2))
    return path
