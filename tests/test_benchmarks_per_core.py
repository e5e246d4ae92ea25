"""The per-core benchmark in smoke mode: the plain loop and a real data server on the same core,
over the photographs scikit-learn ships, and the result file the ratio is read from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from training.planner.results import load_measured

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_short_run_measures_the_loop_and_the_server_on_one_core(tmp_path: Path) -> None:
    flags = ["--recipes", "standard", "--images", "8", "--batches", "3", "--batch", "8"]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "per_core", *flags, "--rounds", "1",
         "--store", str(tmp_path / "throughput.json")],
        cwd=REPO, env={**os.environ, "BENCH_RESULTS_DIR": str(tmp_path)},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "per_core.json").read_text())
    assert result["settings"]["photos"] == ["china.jpg", "flower.jpg"]
    assert result["settings"]["source_bytes"] == 4 * (196653 + 142987)  # the two JPEGs, 4 each
    (round_,) = result["recipes"]["standard"]["rounds"]
    assert round_["loop"] > 0 and round_["server"] > 0 and round_["worker_code"] > 0
    assert round_["ratio"] == pytest.approx(round_["server"] / round_["loop"])
    assert round_["worker_code_ratio"] == pytest.approx(round_["worker_code"] / round_["loop"])
    assert result["meets_target"] == (round_["ratio"] >= 1.0)
    assert "server / loop" in done.stdout and "worker's code" in done.stdout
    assert result["machine"]["cpu_cores"] >= 2
    # The server's figure went into the results store, where the planner reads it at 224 px.
    measured = load_measured(tmp_path)
    rate, px, source = measured.augment_rate("standard", 224)
    assert (rate, px) == (round_["server"], 224)
    assert source.startswith("measured by python -m benchmarks per_core on ")
    (entry,) = json.loads((tmp_path / "throughput.json").read_text())["dataprep"]
    assert (entry["recipe"], entry["dataset"], entry["server_workers"]) == ("standard", "folder", 1)
    assert measured.receive_rate(224)[0] == entry["receive_images_per_s_per_vcpu"] > 0


def test_upscale_writes_the_photographs_enlarged_as_jpegs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(REPO))  # benchmarks/ is a folder of the repo, not installed
    from benchmarks.per_core import make_folder

    total = make_folder(tmp_path, 2, upscale=2)
    files = sorted(tmp_path.rglob("*.jpg"))
    assert [f.parent.name for f in files] == ["china", "flower"]
    sizes = []
    for f in files:
        with Image.open(f) as image:
            sizes.append((image.format, image.size))
    assert sizes == [("JPEG", (1280, 854)), ("JPEG", (1280, 854))]
    assert total == sum(f.stat().st_size for f in files)
