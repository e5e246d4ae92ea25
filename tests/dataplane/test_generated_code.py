"""The checked-in generated code must match the .proto (the CI gate) and the check must notice."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gen_proto.py"


def _check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--check", "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_checked_in_generated_code_is_current() -> None:
    result = _check(REPO)
    assert result.returncode == 0, result.stderr


def test_stale_generated_code_is_detected(tmp_path: Path) -> None:
    shutil.copytree(REPO / "proto", tmp_path / "proto")
    shutil.copytree(REPO / "training" / "dataplane" / "v1", tmp_path / "training/dataplane/v1")
    proto = tmp_path / "proto/training/dataplane/v1/dataplane.proto"
    proto.write_text(proto.read_text() + "\nmessage AddedLater { string note = 1; }\n")
    result = _check(tmp_path)
    assert result.returncode == 1
    assert "dataplane_pb2.py (differs)" in result.stderr
    assert "dataplane_pb2.pyi (differs)" in result.stderr

    (tmp_path / "training/dataplane/v1/dataplane_pb2_grpc.py").unlink()
    assert "dataplane_pb2_grpc.py (missing)" in _check(tmp_path).stderr
