"""The trainer benchmarks run end to end in their smoke modes and write their results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_benchmark_smoke_on_cpu(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "benchmarks", "trainer_gpu", "--device", "cpu", "--steps", "2",
        "--model", "vit-cpu-tiny", "--image-size", "32", "--batch-size", "4",
    ]  # fmt: skip
    env = {**os.environ, "BENCH_RESULTS_DIR": str(tmp_path)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "trainer_gpu_cpu_smoke.json").read_text())
    assert result["device"] == "cpu" and result["samples_per_s"] > 0
    assert result["mfu"] is None  # No peak-FLOPs figure for a CPU.
    assert result["machine"]["cpu_cores"] >= 1


def test_checkpoint_benchmark_smoke(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "benchmarks", "checkpoint", "--model", "vit-cpu-tiny",
        "--image-size", "32", "--saves", "2", "--interval", "2",
    ]  # fmt: skip
    env = {**os.environ, "BENCH_RESULTS_DIR": str(tmp_path)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "checkpoint.json").read_text())
    local, s3 = result["stop_to_durable"]
    assert local["target"] == "local folder" and s3["target"].startswith("s3")
    for stop in (local, s3):
        assert 0 < stop["seconds"] < 60 and stop["checkpoint_mb"] > 0
    sync, background = result["stall_per_save"]
    assert (sync["mode"], background["mode"]) == ("sync", "async")
    assert sync["saves"] == background["saves"] == 2
    assert all(s > 0 for s in sync["stall_s"] + background["stall_s"])
    assert result["machine"]["cpu_cores"] >= 1


def test_checkpoint_s3_clients_benchmark_smoke_or_names_the_missing_package(
    tmp_path: Path,
) -> None:
    """s3torchconnector is optional (not a dependency): without it the benchmark exits 2 saying
    how to install it; with it, the smoke mode compares both clients and writes its JSON."""
    import importlib.util

    cmd = [
        sys.executable, "-m", "benchmarks", "checkpoint_s3_clients", "--model", "vit-cpu-tiny",
        "--image-size", "32", "--repeats", "1",
    ]  # fmt: skip
    env = {**os.environ, "BENCH_RESULTS_DIR": str(tmp_path)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    if importlib.util.find_spec("s3torchconnector") is None:
        assert done.returncode == 2 and "s3torchconnector is not installed" in done.stderr
        assert not (tmp_path / "checkpoint_s3_clients.json").exists()
        return
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "checkpoint_s3_clients.json").read_text())
    assert [r["client"] for r in result["clients"]] == ["boto3", "s3torchconnector"]
    for row in result["clients"]:
        assert row["save_s_median"] > 0 and row["load_s_median"] > 0
        assert row["checkpoint_mb"] > 0
