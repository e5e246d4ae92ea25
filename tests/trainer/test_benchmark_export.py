"""The export benchmark runs end to end in its smoke mode (tiny ViT, 2 FSDP ranks, moto S3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_export_benchmark_smoke(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "benchmarks", "export", "--model", "vit-cpu-tiny",
        "--image-size", "32", "--num-classes", "10", "--repeats", "1", "--s3",
    ]  # fmt: skip
    env = {**os.environ, "BENCH_RESULTS_DIR": str(tmp_path)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "export.json").read_text())
    assert result["weights"] == "ema" and result["meets_target"] is True
    assert {"__0_0.distcp", "__1_0.distcp", "COMPLETE"} <= set(result["checkpoint_files"])
    assert len(result["runs"]) == 1 and 0 < result["seconds_median"] < 30
    assert result["cli"]["stdout"][0].startswith("exported EMA weights of step 1")
    assert result["s3"]["seconds"] > 0
    assert result["machine"]["cpu_cores"] >= 1
