"""The prep benchmark in a short run: real JPEGs, prep from a folder at two read-thread counts
and from a moto S3 server with the faster one, the ImageNet-1k estimate from the best rate, the
JSON with the machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_short_run_measures_folder_and_s3_and_estimates_imagenet(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "benchmarks", "prep", "--images", "24", "--classes", "3"]
    cmd += ["--width", "96", "--height", "72", "--threads", "1", "2", "--instance", "c6i.4xlarge"]
    cmd += ["--estimate-read-threads", "64", "--s3-latency-ms", "40"]
    env = {**os.environ, "BENCH_RESULTS_DIR": str(tmp_path)}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "prep.json").read_text())
    assert result["benchmark"] == "prep" and result["machine"]["cpu_cores"] >= 1
    runs = result["runs"]
    assert [(r["source"], r["read_threads"]) for r in runs[:2]] == [("folder", 1), ("folder", 2)]
    best = max(runs[:2], key=lambda r: r["images_per_s"])
    assert (runs[2]["source"], runs[2]["read_threads"]) == ("s3 (moto)", best["read_threads"])
    for r in runs:
        assert r["images_per_s"] == pytest.approx(24 / r["seconds"])
        assert r["mb_per_s"] == pytest.approx(result["image_kb_mean"] * 24 / 1e3 / r["seconds"])
    estimate = result["imagenet_1k"]
    per_core = best["images_per_s"] / result["machine"]["cpu_cores"]
    assert estimate["images_per_s_per_core_here"] == pytest.approx(per_core)
    # c6i.4xlarge: 16 vCPUs, 6.25 Gbps baseline, 0.68 USD/h On-Demand.
    cpu_hours = 1_281_167 / (per_core * 16) / 3600
    network_hours = 2 * 140 * 8 / 6.25 / 3600
    assert estimate["cpu_bound_hours"] == pytest.approx(cpu_hours)
    assert estimate["network_bound_hours"] == pytest.approx(network_hours)
    request_hours = 1_281_167 * 0.040 / 64 / 3600
    assert estimate["request_bound_hours"] == pytest.approx(request_hours)
    assert estimate["hours"] == pytest.approx(max(cpu_hours, network_hours, request_hours))
    assert estimate["usd"] == pytest.approx(estimate["hours"] * 0.68)
    assert "hetero dataset prep: 24 JPEGs of 96x72" in done.stdout
