"""The planner benchmark, shortened: hetero bench's figures, the prediction from exactly those
figures, and a real fed run (two data servers on one core), with nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from test_benchmarks_offload import REPO, _marked


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_short_run_predicts_from_the_stored_figures_and_runs_the_configuration(
    tmp_path: Path,
) -> None:
    mark = uuid.uuid4().hex
    store = tmp_path / "store" / "throughput.json"
    cmd = [sys.executable, "-m", "benchmarks", "planner", "--only", "D", "--steps", "3"]
    cmd += ["--warmup", "1", "--batches", "4", "--store", str(store)]
    env = {**os.environ, "BENCH_RESULTS_DIR": str(tmp_path), "OFFLOAD_TEST_MARK": mark}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]

    data = json.loads(store.read_text())
    (trainer,) = data["results"]
    (prep,) = data["dataprep"]
    assert (trainer["image_size"], trainer["batch_size"], trainer["precision"]) == (64, 32, "fp32")
    assert (trainer["threads"], trainer["measured_steps"]) == (1, 3)
    assert (prep["recipe"], prep["server_workers"], prep["images"]) == ("randaugment", 1, 4 * 32)
    (row,) = json.loads((tmp_path / "planner.json").read_text())["rows"]
    assert (row["config"], row["model"], row["recipe"], row["servers"]) == (
        "D",
        "tiny",
        "randaugment",
        2,
    )
    # The prediction is the local model applied to exactly the stored figures (all at 64 px):
    # trainer side 1 / (1/R + 1/receive); two one-worker servers on one core supply
    # min(1 core x augmentation, 2 x what one server delivered).
    r = trainer["samples_per_s_per_device"]
    trainer_side = 1 / (1 / r + 1 / prep["receive_images_per_s_per_vcpu"])
    supply = min(prep["images_per_s_per_vcpu"], 2 * prep["images_per_s_per_server"])
    assert row["trainer_side"] == pytest.approx(trainer_side)
    assert row["supply"] == pytest.approx(supply)
    assert row["predicted_samples_per_s"] == pytest.approx(min(trainer_side, supply))
    assert row["bound"] == ("trainer" if trainer_side <= supply else "data")
    got = row["measured_samples_per_s"]
    assert got > 0 and row["measured_steps"] == 3
    assert row["error"] == pytest.approx((row["predicted_samples_per_s"] - got) / got)
    assert row["within_target"] == (abs(row["error"]) <= 0.15)
    assert _marked(mark) == [], "processes left behind"
