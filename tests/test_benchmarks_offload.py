"""The offload benchmark in smoke mode: real trainer processes, a real data server, results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]


def _offload(
    tmp_path: Path, *flags: str, timeout: float, mark: str = ""
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "benchmarks", "offload", *flags]
    env = {**os.environ, "BENCH_RESULTS_DIR": str(tmp_path), "OFFLOAD_TEST_MARK": mark}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_quick_run_measures_both_configurations_and_leaves_nothing(tmp_path: Path) -> None:
    # Every process the benchmark starts inherits this mark (trainers, DataLoader workers, the
    # data server, its forkserver and workers), so leftovers can be found even once reparented.
    mark = uuid.uuid4().hex
    done = _offload(tmp_path, "--quick", timeout=400, mark=mark)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "offload.json").read_text())
    local, offloaded = result["local"], result["offloaded"]
    for row in (local, offloaded):
        assert row["samples_per_s"] > 0 and row["measured_steps"] == 3
        assert 0.0 <= row["data_wait_share"] <= 1.0
    assert result["speedup"] == pytest.approx(offloaded["samples_per_s"] / local["samples_per_s"])
    assert result["meets_target"] == (result["speedup"] >= result["target"])
    assert result["regime"]["augment_batch_cpu_s"] > 0
    assert result["machine"]["cpu_cores"] >= 2
    assert "speedup" in done.stdout
    assert _marked(mark) == [], "processes left behind"


def _marked(mark: str) -> list[str]:
    left = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.environ().get("OFFLOAD_TEST_MARK") == mark:
                left.append(f"{proc.pid}: {' '.join(proc.info['cmdline'] or [])}")
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return left


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--overrides", "{depth: 2}"], "--overrides is not JSON"),
        (["--overrides", "[2]"], "--overrides must be a JSON object"),
        (["--steps", "-1"], "--steps must be at least 1"),
        (["--server-core", "0"], "--trainer-core 0 and --server-core 0 must be two different"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    message: str,
) -> None:
    """In this process (the command line's ``main``): refused before anything starts."""
    monkeypatch.syspath_prepend(str(REPO))  # benchmarks/ is not installed: the repo's
    from benchmarks import offload

    monkeypatch.setenv("BENCH_RESULTS_DIR", str(tmp_path))
    assert offload.main(["--quick", *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "offload.json").exists()
