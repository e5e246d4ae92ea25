"""The data-plane benchmark in a short run: a real server process, the real client with its
reorder window over 1 and 2 streams, the socket and augmentation baselines, the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_short_run_compares_stream_counts_and_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "dataplane.json"
    cmd = [sys.executable, "-m", "benchmarks", "dataplane", "--seconds", "1", "--size", "32"]
    cmd += ["--batch", "8", "--streams", "1", "2", "--augment-images", "10", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [row["streams"] for row in result["sweep"]] == [1, 2]
    for row in result["sweep"]:
        assert row["images"] > 0 and row["images_per_s"] > 0
        assert row["gb_per_s_per_stream"] * row["streams"] == row["gb_per_s"]
    best = max(result["sweep"], key=lambda row: row["images_per_s"])
    assert result["transport"] == best
    assert result["settings"]["reorder_window_batches"] == 16
    assert result["settings"]["message_mb"] == 8 * 3 * 32 * 32 / 1e6
    assert "streams  images/s" in done.stdout and f"wrote {out}" in done.stdout
