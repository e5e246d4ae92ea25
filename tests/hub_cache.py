"""A Hugging Face cache written into a test's folder, so ``job.model.init = "timm:NAME.TAG"`` is
tested without the internet.

``write_hub_cache`` lays out what ``huggingface_hub.hf_hub_download`` finds offline for the Hub
repository ``timm/NAME.TAG``: ``models--timm--NAME.TAG/refs/main`` (a commit hash),
``blobs/<sha256>``, and ``snapshots/<commit>/config.json`` and ``model.safetensors`` as relative
symlinks to the blobs, the files written by timm's own ``save_for_hf`` from a seeded random model
(small, by default: the ``vit-cpu-tiny`` preset's shape). ``offline_hub`` points huggingface_hub
at such a cache with ``HF_HUB_OFFLINE=1``.

A plain module beside the tests (like ``realdata``).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import timm
import torch
from timm.models import save_for_hf

MODEL = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
"""A real timm name and tag (timm's registry names its Hub repository, timm/MODEL)."""
INIT = f"timm:{MODEL}"
SMALL = {"patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2, "img_size": 32}
"""The shape of the trainer's ``vit-cpu-tiny`` preset at 32 px (``training.trainer.model``)."""
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass(frozen=True)
class HubCache:
    root: Path
    """The cache folder (``HF_HUB_CACHE``)."""
    snapshot: Path
    """``models--timm--MODEL/snapshots/<commit>/``."""
    state_dict: dict[str, torch.Tensor]
    """The weights in its ``model.safetensors``."""


def write_hub_cache(
    root: Path, model: str = MODEL, *, seed: int = 3, num_classes: int = 1000, **overrides: Any
) -> HubCache:
    """The cache with ``timm/<model>``'s ``config.json`` and ``model.safetensors`` (a random
    ``model`` of ``SMALL`` shape unless ``overrides`` say otherwise)."""
    arch = model.split(".", 1)[0]
    torch.manual_seed(seed)
    net = timm.create_model(arch, num_classes=num_classes, **(overrides or SMALL))
    repo = root / f"models--timm--{model}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    with tempfile.TemporaryDirectory() as tmp:
        save_for_hf(net, tmp, safe_serialization=True)
        for path in sorted(Path(tmp).iterdir()):
            blob = hashlib.sha256(path.read_bytes()).hexdigest()
            shutil.copyfile(path, repo / "blobs" / blob)
            (snapshot / path.name).symlink_to(Path("..", "..", "blobs", blob))
    state = {k: v.clone() for k, v in net.state_dict().items()}
    return HubCache(root=root, snapshot=snapshot, state_dict=state)


def offline_hub(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """huggingface_hub reads the cache at ``cache`` and never the network: ``HF_HUB_CACHE`` and
    ``HF_HUB_OFFLINE=1`` in the environment (for processes a test starts) and in
    ``huggingface_hub.constants`` (this process: huggingface_hub reads them at import)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
