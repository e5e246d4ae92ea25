"""The trainer benchmarks run end to end in their smoke modes and write their results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_gpu_benchmark_smoke_on_cpu(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "benchmarks", "trainer_gpu", "--device", "cpu", "--steps", "2",
        "--warmup", "1", "--model", "vit-cpu-tiny", "--image-size", "32", "--batch-size", "4",
        "--compile", "off", "--rounds", "2", "--eval-batches", "2",
    ]  # fmt: skip
    env = {**os.environ, "BENCH_RESULTS_DIR": str(tmp_path)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "trainer_gpu_cpu_smoke.json").read_text())
    assert result["device"] == "cpu" and result["samples_per_s"] > 0
    assert result["mfu"] is None  # No peak-FLOPs figure for a CPU.
    assert result["machine"]["cpu_cores"] >= 1
    # One configuration (no largest batch on a CPU): two interleaved bare/trainer rounds, the
    # ratio their median, the pageable bare loop once, validation timed.
    [config] = result["configurations"]
    assert (config["batch_size"], config["compile"]) == (4, False)
    ratios = sorted(r["trainer"]["samples_per_s"] / r["bare"] for r in config["rounds"])
    assert len(ratios) == 2 and config["ratio"] == pytest.approx(sum(ratios) / 2)
    assert [r["bare_pageable"] is not None for r in config["rounds"]] == [True, False]
    assert result["eval_images_per_s"] > 0
    assert not (tmp_path / "throughput.json").exists()  # the planner's store: GPU runs only


def test_gpu_input_benchmark_smoke_on_cpu(tmp_path: Path) -> None:
    """Every kind of row runs: in memory, pre-made batches, two augmenting servers, and two
    servers importing ``training`` from ``--before`` (here a copy of this checkout's); the
    quick mode leaves out the row of more servers (the same code with other counts)."""
    before = tmp_path / "before"
    shutil.copytree(REPO / "training", before / "training")
    cmd = [sys.executable, "-m", "benchmarks", "gpu_input", "--device", "cpu", "--quick",
           "--before", str(before)]  # fmt: skip
    env = {**os.environ, "BENCH_RESULTS_DIR": str(tmp_path)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_input_cpu_smoke.json").read_text())
    rows = result["rows"]
    assert list(rows) == ["memory", "receive", "fed_2_big", "fed_2_big_before"]
    assert rows["fed_2_big_before"]["package"] == str(before / "training" / "__init__.py")
    # The trainer's Shutdown ended every server.
    assert [rows[k]["exit_codes"] for k in list(rows)[1:]] == [[0], [0, 0], [0, 0]]
    assert [(rows[k]["servers"], rows[k]["workers_per_server"]) for k in list(rows)[1:]] == [
        (1, 0),
        (2, 1),
        (2, 1),
    ]
    assert (
        rows["receive"]["dataplane"] == {"prefetch_batches": 8}
        and rows["fed_2_big"]["dataplane"] == {}
    )
    assert result["images_per_run"] == (1 + 3) * 8
    for name, row in rows.items():
        assert row["samples_per_s"] > 0 and row["trainer_cpu_s"] > 0 and row["measured_steps"] == 3
        per_image = row["trainer_cpu_s"] / result["images_per_run"] * 1e3
        assert row["trainer_cpu_ms_per_image"] == pytest.approx(per_image)
        over = row["samples_per_s"] / rows["memory"]["samples_per_s"]
        assert result["over_memory"][name] == pytest.approx(over)


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


def test_the_largest_batch_is_predicted_from_one_runs_peak_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(REPO))  # benchmarks/ is a folder of the repo, not installed
    from benchmarks.trainer_gpu import predicted_largest

    gib = 2**30
    # 1 GiB of weights, gradients and optimizer state; 256 images took 16 GiB more at the peak
    # (1/16 GiB each); 80 GiB x 0.88 leaves 69.4 GiB for activations: 1,110 images, so 1,088.
    run = {"state_bytes": gib, "trainer_peak_bytes": 17 * gib}
    assert predicted_largest(run, 80 * gib, 256) == 1088
    # Never below the batch that ran.
    assert predicted_largest(run, 18 * gib, 256) == 256


def test_the_gpu_rate_goes_where_the_planner_calibrates_its_mfu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default configuration's rate becomes the store's entry for the GPU model; hetero
    plan then estimates another GPU from that run's MFU and names the calibration."""
    import argparse

    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks.trainer_gpu import FLOPS_PER_IMAGE_224, add_arguments, store_default
    from training.planner.facts import Facts
    from training.planner.results import load_measured
    from training.planner.throughput import gpu_throughput
    from training.planner.workload import workload_from_spec
    from training.spec import load_spec

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    rate = 2500.0
    config = {"batch_size": 256, "compile": False, "trainer_samples_per_s": rate,
              "step_time_s": 0.1024, "mfu": rate * FLOPS_PER_IMAGE_224 / 989e12}  # fmt: skip
    result = {"device": "NVIDIA H100 80GB HBM3", "configurations": [config]}
    store = store_default(result, args, tmp_path)
    [entry] = json.loads(store.read_text())["results"]
    assert (entry["device"], entry["model"], entry["image_size"], entry["precision"]) == (
        "H100", "vit_base_patch16_224", 224, "bf16",
    )  # fmt: skip
    assert entry["samples_per_s_per_device"] == rate and entry["batch_size"] == 256

    spec = load_spec(REPO / "cluster.toml")  # ViT-B/16 at 224 px, bf16
    facts, measured = Facts(), load_measured(tmp_path)
    workload = workload_from_spec(spec)
    h100 = gpu_throughput("p5.48xlarge", workload, facts, measured)
    assert h100.measured and h100.samples_per_s == rate
    a10g = gpu_throughput("g5.xlarge", workload, facts, measured)
    mfu = rate * workload.train_flops_per_sample / facts.gpu_peaks["H100"].bf16
    assert not a10g.measured
    assert a10g.samples_per_s == pytest.approx(
        facts.gpu_peaks["A10G"].bf16 * mfu / workload.train_flops_per_sample
    )
    assert f"MFU {mfu:.3g} calibrated on 1 measured GPU run(s)" in a10g.source
