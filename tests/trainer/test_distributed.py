"""DDP, FSDP and HSDP in real processes with gloo: losses match a single-process reference,
resume equals an uninterrupted run, and SIGTERM leaves a loadable checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.common.outcome import EXIT_STOPPED, Outcome, read_rank_outcomes
from training.trainer.checkpoint import latest_complete
from training.trainer.local_run import run_local

from .conftest import load_params, sigterm_after_metrics, write_spec

REPO = Path(__file__).resolve().parents[2]
GLOBAL_BATCH = 8
STEPS = 4
# One thread per rank (as torchrun sets for several ranks): 2 shared cores, no oversubscription.
ENV = {"OMP_NUM_THREADS": "1"}


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def train(tmp: Path, strategy: str, world: int, *, interval: int = 100, **kw) -> Path:
    """Run ``world`` ranks on the same global batch; returns the run folder."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec = write_spec(
        tmp, strategy=strategy, batch_size=GLOBAL_BATCH // world, steps=STEPS,
        interval=interval, **kw,
    )  # fmt: skip
    argv = ["--spec", str(spec), "--run-dir", str(tmp / "run"), "--synthetic-data"]
    assert run_local(argv, world, env=ENV, timeout=240) == [0] * world
    return tmp / "run"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """Per-step losses of one process on the whole global batch."""
    return losses(train(tmp_path_factory.mktemp("reference"), "ddp", 1))


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == STEPS
    assert want[0] > 1.0  # Cross-entropy of 10 classes at init: the runs really trained.
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-4)


def test_ddp_under_torchrun_matches_single_process(tmp_path: Path, reference) -> None:
    spec = write_spec(tmp_path, strategy="ddp", batch_size=GLOBAL_BATCH // 2, steps=STEPS)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "training.trainer", "--spec", str(spec), "--run-dir", str(tmp_path / "run"),
        "--synthetic-data",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_close(losses(tmp_path / "run"), reference)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["mesh"] == [2, 1]
    assert summary["samples_per_s"] > 0 and summary["samples_per_usd"] > 0
    assert (tmp_path / "run" / "metrics.png").stat().st_size > 0


def test_fsdp_matches_single_process_and_resume_equals_uninterrupted(
    tmp_path: Path, reference
) -> None:
    whole = train(tmp_path / "whole", "fsdp", 2, interval=2)
    assert_close(losses(whole), reference)
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["strategy"] == "fsdp" and summary["mesh"] == [1, 2]

    # The same job cut after step 2 (a Spot stop), then restarted: it resumes from step-2.
    cut = tmp_path / "cut"
    spec = write_spec(
        cut.mkdir() or cut, strategy="fsdp", batch_size=GLOBAL_BATCH // 2, steps=STEPS, interval=2
    )
    argv = ["--spec", str(spec), "--run-dir", str(cut / "run"), "--synthetic-data"]
    assert run_local([*argv, "--steps", "2"], 2, env=ENV, timeout=240) == [0, 0]
    assert run_local(argv, 2, env=ENV, timeout=240) == [0, 0]
    resumed = json.loads((cut / "run" / "summary.json").read_text())
    assert resumed["start_step"] == 2 and resumed["resumed_from"].endswith("step-2")
    assert losses(cut / "run") == pytest.approx(losses(whole), abs=1e-6)

    a = load_params(whole.parent / "checkpoints" / f"step-{STEPS}")
    b = load_params(cut / "checkpoints" / f"step-{STEPS}")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)


def test_hsdp_on_a_2x2_mesh_matches_single_process(tmp_path: Path, reference) -> None:
    run = train(
        tmp_path, "hsdp", 4, extra_parallel="shard_degree = 2\nreplicate_degree = 2",
        instances=2, ranks_per_instance=2,
    )  # fmt: skip
    assert_close(losses(run), reference)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["strategy"] == "hsdp" and summary["mesh"] == [2, 2]


def test_sigterm_checkpoints_at_the_next_step_and_exits_stopped(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, steps=100_000, interval=100_000)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "training.trainer", "--spec", str(spec), "--run-dir",
           str(run_dir), "--synthetic-data"]  # fmt: skip
    cmd += ["--outcome-dir", str(tmp_path / "outcome")]
    ended = sigterm_after_metrics(cmd, env={**os.environ, **ENV}, run_dir=run_dir, lines=3)
    assert ended.returncode == EXIT_STOPPED, ended.stdout[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and summary["outcome"] == "stopped"
    found = latest_complete(tmp_path / "checkpoints")
    assert found is not None and found[0] == summary["steps"]
    newest = found[1]
    [outcome] = read_rank_outcomes(tmp_path / "outcome")
    assert (outcome.outcome, outcome.reason) == (Outcome.STOPPED, "SIGTERM")
    assert outcome.step == outcome.checkpoint_step == summary["steps"]
    params = load_params(newest)
    assert all(torch.isfinite(t).all() for t in params.values())
