"""Helpers for the trainer tests: tiny specs (32 px, patch 8, depth 2, width 32) on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

GROUPS = """
name = "trainer-test"
[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge"]
count = {count}
processes_per_instance = {ranks}
[[groups]]
name = "dataprep"
role = "dataprep"
instance_types = ["c6i.4xlarge"]
count = 2
"""


def write_spec(
    directory: Path,
    *,
    strategy: str = "ddp",
    batch_size: int = 8,
    steps: int = 4,
    interval: int = 100,
    grad_accum: int = 1,
    extra_parallel: str = "",
    name: str = "spec.toml",
    instances: int = 1,
    ranks_per_instance: int = 1,
) -> Path:
    """A spec for the tiny CPU ViT on in-memory synthetic data."""
    text = f"""{GROUPS.format(count=instances, ranks=ranks_per_instance)}
[job]
batch_size = {batch_size}
grad_accum_steps = {grad_accum}
steps = {steps}
lr = 1e-3
precision = "fp32"
log_every_steps = 1
[job.model]
name = "vit-cpu-tiny"
[job.dataset]
num_samples = 512
num_classes = 10
image_size = 32
[job.checkpoint]
interval_steps = {interval}
dir = "{directory / "checkpoints"}"
keep = 3
[job.parallelism]
strategy = "{strategy}"
{extra_parallel}
"""
    path = directory / name
    path.write_text(text)
    return path


@pytest.fixture
def tiny_spec(tmp_path: Path) -> Path:
    return write_spec(tmp_path)
