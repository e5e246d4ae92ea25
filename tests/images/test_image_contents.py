"""What is inside the two built images: the tests' Python, the pinned torch, a record of what the
build found and left out, no CA bundle from the build in any layer, an entry point that maps
SageMaker's `train`, and each image's size (printed; the data server's also as it would be from
PyTorch's CPU index, measured by what only the CUDA build adds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import DATA_SERVER_IMAGE, TRAINER_IMAGE

pytestmark = pytest.mark.image
REPO = Path(__file__).resolve().parents[2]
IMAGES = {"trainer": TRAINER_IMAGE, "data-server": DATA_SERVER_IMAGE}
# What PyPI's CUDA build of torch brings that PyTorch's CPU build does not: the CUDA wheels
# (nvidia/, cuda/, triton/) and torch's own CUDA libraries.
CUDA_ONLY = (
    "site-packages/nvidia site-packages/triton site-packages/cuda "
    "site-packages/torch/lib/libtorch_cuda.so site-packages/torch/lib/libc10_cuda.so"
)


def run_in(docker: str, image: str, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [docker, "run", "--rm", "--network", "host", "--entrypoint", command[0], image,
         *command[1:]],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def record(docker: str, image: str) -> dict[str, object]:
    out = run_in(docker, image, "cat", "/opt/hetero/image.json")
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def pins() -> dict[str, str]:
    lines = (REPO / "containers" / "constraints.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if "==" in line and not line.startswith("#"))


@pytest.mark.parametrize("target", list(IMAGES))
def test_each_image_runs_the_tests_python_and_the_pinned_torch(docker: str, target: str) -> None:
    found = record(docker, IMAGES[target])
    assert found["target"] == target
    # The record's Python is the interpreter the image's venv runs, asked again here.
    python = run_in(docker, IMAGES[target], "python", "-c", "import platform, torch; "
                    "print(platform.python_version(), torch.__version__)")  # fmt: skip
    assert python.returncode == 0, python.stderr
    version, torch_version = python.stdout.split()
    assert version == found["python"]
    assert version.split(".")[:2] == [str(v) for v in sys.version_info[:2]]
    assert torch_version == found["torch"]
    assert str(torch_version).split("+")[0] == pins()["torch"]
    if target == "trainer":
        assert found["torch_cuda"] is not None
        # No EFA stack only where the build was told so by name, and the record says so.
        if found["efa"] is None:
            assert any("EFA_INSTALLER=none" in str(p) for p in found["left_out"]), found  # type: ignore[attr-defined]
    elif found["torch_cuda"] is not None:
        assert any("TORCH_FROM=pypi" in str(p) for p in found["left_out"]), found  # type: ignore[attr-defined]


@pytest.mark.parametrize("target", list(IMAGES))
def test_the_build_ca_bundle_is_in_no_layer(docker: str, target: str) -> None:
    """The CA bundle reached pip as a BuildKit secret: mounted for one RUN, never written."""
    look = "find / -xdev -name ca_bundle -print; ls /run/secrets 2>/dev/null; true"
    found = run_in(docker, IMAGES[target], "sh", "-c", look)
    assert found.returncode == 0 and found.stdout.strip() == "", found.stdout
    history = subprocess.run(
        [docker, "history", "--no-trunc", "--format", "{{.CreatedBy}}", IMAGES[target]],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "BEGIN CERTIFICATE" not in history.stdout


@pytest.mark.parametrize("target", list(IMAGES))
def test_the_entry_point_maps_train_and_needs_a_spec(docker: str, target: str) -> None:
    plain = subprocess.run(
        [docker, "run", "--rm", IMAGES[target]], capture_output=True, text=True, timeout=120
    )
    assert plain.returncode == 2
    assert "HETERO_SPEC is not set" in plain.stderr
    help_out = subprocess.run(
        [docker, "run", "--rm", IMAGES[target], "--help"], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert help_out.returncode == 0 and "rehearse" in help_out.stdout


def test_image_sizes(docker: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Printed for the docs: each image as built here, and the data server as PyTorch's CPU
    index would make it (this build's size less what only the CUDA build of torch adds)."""
    rows = []
    for target, image in IMAGES.items():
        size = subprocess.run(
            [docker, "image", "inspect", "--format", "{{.Size}}", image],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout.strip()  # fmt: skip
        found = record(docker, image)
        rows.append((target, int(size), found))
    data_size, data_record = rows[1][1], rows[1][2]
    cuda_only = 0
    if data_record["torch_cuda"] is not None:
        du = run_in(docker, DATA_SERVER_IMAGE, "sh", "-c",
                    f"cd /opt/venv/lib/python3*/ && du -scb {CUDA_ONLY} | tail -1")  # fmt: skip
        assert du.returncode == 0, du.stderr
        cuda_only = int(du.stdout.split()[0])
        assert cuda_only > 1e9  # the CUDA wheels are several GB
    with capsys.disabled():
        print("\nimage sizes (docker image inspect):")
        for target, size, found in rows:
            left = "; ".join(str(p) for p in found["left_out"]) or "nothing"  # type: ignore[attr-defined]
            print(f"  {target:12s} {size / 1e9:6.2f} GB  python {found['python']}, torch "
                  f"{found['torch']}; left out: {left}")  # fmt: skip
        if cuda_only:
            cpu = (data_size - cuda_only) / 1e9
            print(f"  data-server without the CUDA-only files ({cuda_only / 1e9:.2f} GB): "
                  f"{cpu:.2f} GB (about what PyTorch's CPU index gives: the same packages "
                  "without the CUDA wheels and torch's CUDA libraries)")  # fmt: skip
    assert all(size > 0 for _, size, _ in rows)
