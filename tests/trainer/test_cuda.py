"""The trainer on a CUDA GPU: what only a GPU exercises (bf16 autocast, page-locked copies, MFU
and GPU memory in the summary, NVML, determinism of a resume). Skipped, with the reason, where
torch sees no CUDA device; run them on a GPU host with ``pytest tests/trainer/test_cuda.py``."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from training.common.outcome import Outcome
from training.dataplane.client import DataPlaneClient
from training.dataplane.server import create_server
from training.dataplane.sources import PremadeBatchSource
from training.spec import parse_spec
from training.trainer.config import TrainerConfig
from training.trainer.stream import to_device
from training.trainer.train import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MEAN = (0.485, 0.456, 0.406)  # timm's IMAGENET_DEFAULT_MEAN / _STD, restated
STD = (0.229, 0.224, 0.225)


def _spec(steps: int, tmp: Path, **job: Any) -> Any:
    return parse_spec(
        {
            "name": "cuda-test",
            "groups": [
                {
                    "name": "trainer",
                    "role": "trainer",
                    "instance_types": ["p5.48xlarge"],
                    "count": 1,
                },
            ],
            "job": {
                "batch_size": 16,
                "steps": steps,
                "lr": 1e-3,
                "precision": "bf16",
                "log_every_steps": 2,
                "model": {
                    "name": "vit_tiny_patch16_224",
                    "overrides": {
                        "img_size": 32,
                        "patch_size": 8,
                        "depth": 2,
                        "embed_dim": 64,
                        "num_heads": 2,
                    },
                },
                "dataset": {"num_samples": 4096, "num_classes": 10, "image_size": 32},
                "checkpoint": {"interval_steps": 3, "dir": str(tmp / "ckpt")},
                **job,
            },
        },
        source="test_cuda",
    )


def _train(tmp: Path, steps: int, *, run_steps: int | None = None) -> Trainer:
    config = TrainerConfig.from_spec(
        _spec(steps, tmp), run_dir=tmp / "run", synthetic=True, steps=run_steps, emf=False
    )
    trainer = Trainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


def test_a_bf16_run_on_the_gpu_finishes_with_mfu_gpu_memory_and_a_finite_loss(
    tmp_path: Path,
) -> None:
    trainer = _train(tmp_path, steps=6)
    assert trainer.outcome is not None and trainer.outcome.outcome is Outcome.FINISHED
    assert trainer.device.type == "cuda" and trainer.autocast
    s = trainer.summary
    assert math.isfinite(s["final_loss"])
    assert s["mfu"] is not None and 0 < s["mfu"] < 1  # the GPU is in the peak-FLOPs table
    assert s["memory_per_rank"][0]["gpu_peak_allocated_bytes"] > 0
    # bf16 is autocast: the weights the optimizer updates stay fp32, on the GPU.
    assert {(p.device.type, p.dtype) for p in trainer.model.parameters()} == {
        ("cuda", torch.float32)
    }
    # Normalised on the device exactly as on the host (float32 arithmetic either way).
    images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    expected = (images.float() / 255 - mean) / std
    torch.testing.assert_close(trainer.normalise(images).cpu(), expected, rtol=1e-6, atol=1e-6)


def test_batches_go_to_the_gpu_through_page_locked_memory_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pinned: list[tuple[int, ...]] = []
    real = torch.Tensor.pin_memory

    def recording(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        pinned.append(tuple(self.shape))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", recording)
    device = torch.device("cuda", torch.cuda.current_device())
    pageable = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    out = to_device(pageable, device)
    assert pinned == [(8, 3, 32, 32)]
    already = real(torch.arange(5))
    assert to_device(already, device).tolist() == [0, 1, 2, 3, 4]
    assert pinned == [(8, 3, 32, 32)]  # a pinned tensor is copied as it is
    torch.cuda.synchronize()
    assert out.device == device and torch.equal(out.cpu(), pageable)


def test_data_plane_batches_arrive_page_locked_from_the_stream_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trainer on a GPU receives its batches already page-locked: the copy into page-locked
    memory runs on the client's stream threads, not on the training thread."""
    pinned_by: list[str] = []
    real = torch.Tensor.pin_memory

    def recording(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        pinned_by.append(threading.current_thread().name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", recording)
    source = PremadeBatchSource(64, image_size=32)
    server, port = create_server(source, port=0)
    try:
        with (
            DataPlaneClient([f"127.0.0.1:{port}"], batch_size=16, pin_memory=True) as pinned,
            DataPlaneClient([f"127.0.0.1:{port}"], batch_size=16) as pageable,
        ):
            got = list(pinned.iter_epoch(0))
            plain = list(pageable.iter_epoch(0))
    finally:
        server.stop(0).wait()
    assert len(got) == 4 and all(b.images.is_pinned() for b in got)
    assert not any(b.images.is_pinned() for b in plain)
    assert [b.sample_ids.tolist() for b in got] == [b.sample_ids.tolist() for b in plain]
    assert all(torch.equal(a.images, b.images) for a, b in zip(got, plain, strict=True))
    assert len(pinned_by) == 4 and all(n.startswith("dataplane-") for n in pinned_by)


def test_a_resumed_run_on_the_gpu_ends_with_the_uninterrupted_runs_weights(
    tmp_path: Path,
) -> None:
    """Stop at step 3 (a checkpoint), resume to 6: the weights equal a run of 6 straight."""
    straight = _train(tmp_path / "straight", steps=6)
    _train(tmp_path / "resumed", steps=6, run_steps=3)
    resumed = _train(tmp_path / "resumed", steps=6)
    assert resumed.restored is not None and resumed.restored.step == 3
    a = {k: v.detach().cpu() for k, v in straight.model.state_dict().items()}
    b = {k: v.detach().cpu() for k, v in resumed.model.state_dict().items()}
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert different == [], f"weights differ after resume: {different[:5]}"
