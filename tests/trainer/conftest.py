"""Helpers for the trainer tests: tiny specs (32 px, patch 8, depth 2, width 32) on the CPU."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
import torch.distributed.checkpoint as dcp

from training.common.steps import MARKER
from training.trainer.config import ModelConfig, TrainerConfig
from training.trainer.model import build_model
from training.trainer.train import Trainer

REPO = Path(__file__).resolve().parents[2]

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
    async_save: bool = False,
    job_keys: str = "",
    tables: str = "",
    model_keys: str = "",
) -> Path:
    """A spec for the tiny CPU ViT on in-memory synthetic data; ``job_keys`` go under
    ``[job]``, ``model_keys`` under ``[job.model]``, ``tables`` (e.g. ``[job.mixup]``) at the
    end."""
    text = f"""{GROUPS.format(count=instances, ranks=ranks_per_instance)}
[job]
batch_size = {batch_size}
grad_accum_steps = {grad_accum}
steps = {steps}
lr = 1e-3
precision = "fp32"
log_every_steps = 1
{job_keys}
[job.model]
name = "vit-cpu-tiny"
{model_keys}
[job.dataset]
num_samples = 512
num_classes = 10
image_size = 32
[job.checkpoint]
interval_steps = {interval}
dir = "{directory / "checkpoints"}"
keep = 3
async_save = {"true" if async_save else "false"}
[job.parallelism]
strategy = "{strategy}"
{extra_parallel}
{tables}
"""
    path = directory / name
    path.write_text(text)
    return path


@pytest.fixture
def tiny_spec(tmp_path: Path) -> Path:
    return write_spec(tmp_path)


@pytest.fixture
def mock_s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A boto3 S3 client on moto's in-memory S3 (no bucket yet), with no endpoint or profile
    from the environment in the way."""
    for key in ("AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # Imported here: the GPU check host (scripts/gpu_check.sh) runs this folder's CUDA tests
    # without the AWS test tools.
    from moto import mock_aws

    with mock_aws():
        yield boto3.client("s3")


def train_to_end(config: TrainerConfig) -> Trainer:
    """Train ``config`` in this process to its end (exit 0), the trainer closed after."""
    trainer = Trainer(config)
    try:
        assert trainer.train() == 0
    finally:
        trainer.close()
    return trainer


def load_params(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's full model weights, read without a process group (DCP reshards)."""
    assert (path / MARKER).is_file()
    model = build_model(ModelConfig("vit-cpu-tiny", {}, 32, 10), seed=123)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(path))
    return state["model"]


def sigterm_after_metrics(
    cmd: list[str], *, env: dict[str, str], run_dir: Path, lines: int
) -> subprocess.CompletedProcess[str]:
    """Run a trainer, send SIGTERM once its ``metrics.jsonl`` has ``lines`` lines, and return
    how it ended (its output and exit code)."""
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= lines:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, out)
