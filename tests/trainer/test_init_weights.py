"""``job.model.init`` in the forms users have: a hub-form folder written by timm's own
``save_for_hf`` (``model.safetensors`` or ``pytorch_model.bin``, local or in S3), a checkpoint
of timm's ``train.py`` written by timm's own ``CheckpointSaver`` (EMA weights taken unless
``init_ema = false``), a bare file; the data config each carries (timm's
``resolve_data_config``), the spec's values over it; and what is refused, by the trainer and by
``check_init`` before anything is deployed. (The step-0 score on real images:
``test_finetune_real_images.py``.)"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from timm.models import save_for_hf
from timm.utils import CheckpointSaver, ModelEmaV3
from torch import nn

from training.spec import Interpolation, SpecError, load_spec
from training.trainer.config import ConfigError, ModelConfig
from training.trainer.data_config import DataConfig, job_data_config
from training.trainer.init_weights import InitWeights
from training.trainer.model import check_init, inspect_init, start_model

from .conftest import write_spec

TINY = {"patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2}
# What the source weights were trained with: not the trainer's defaults, not timm's registry's.
DATA = {
    "mean": (0.5, 0.5, 0.5),
    "std": (0.5, 0.5, 0.5),
    "interpolation": "bicubic",
    "crop_pct": 0.95,
}


def timm_model(*, seed: int = 7, num_classes: int = 10, **overrides: int) -> nn.Module:
    torch.manual_seed(seed)
    kwargs: dict[str, Any] = {**TINY, **overrides}
    return timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=num_classes, **kwargs)


def hub_folder(folder: Path, model: nn.Module, *, safetensors: bool = True) -> Path:
    """The folder timm's own hub writer makes (what ``push_to_hf_hub`` uploads)."""
    save_for_hf(model, folder, safe_serialization=safetensors, data_config=dict(DATA))
    return folder


def train_py_checkpoint(
    folder: Path, model: nn.Module, *, ema: bool = True, arch: str = "vit_tiny_patch16_224"
) -> tuple[Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """timm ``train.py``'s ``model_best.pth.tar`` as its ``CheckpointSaver`` writes it (with
    ``--model-ema``: ``state_dict_ema`` beside ``state_dict``); (path, raw, EMA weights)."""
    model_ema = ModelEmaV3(model, decay=0.5) if ema else None
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    if model_ema is not None:
        model_ema.update(model)  # decay 0.5: halfway between the two
    args = argparse.Namespace(
        model=arch, img_size=32, mean=list(DATA["mean"]), std=list(DATA["std"]),
        interpolation=DATA["interpolation"], crop_pct=DATA["crop_pct"], model_ema=ema,
    )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    saver = CheckpointSaver(
        model, torch.optim.AdamW(model.parameters()), args=args, model_ema=model_ema,
        checkpoint_dir=str(folder), recovery_dir=str(folder),
    )  # fmt: skip
    saver.save_checkpoint(0, metric=0.5)
    raw = {k: v.clone() for k, v in model.state_dict().items()}
    ema_sd = {
        k: v.clone() for k, v in (model_ema.module if model_ema else model).state_dict().items()
    }
    return folder / "model_best.pth.tar", raw, ema_sd


def tiny(init: str | Path, *, init_ema: bool = True, num_classes: int = 10) -> ModelConfig:
    return ModelConfig("vit-cpu-tiny", {}, 32, num_classes, init=str(init), init_ema=init_ema)


def loaded(init: str | Path, **kwargs: Any) -> tuple[dict[str, torch.Tensor], InitWeights]:
    started = start_model(tiny(init, **kwargs), seed=0)
    assert started.weights is not None
    return started.model.state_dict(), started.weights


def equal(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("safetensors", [True, False])
def test_a_hub_folder_loads_with_its_own_data_config(tmp_path: Path, safetensors: bool) -> None:
    model = timm_model()
    folder = hub_folder(tmp_path / "hub", model, safetensors=safetensors)
    state, weights = loaded(folder)
    assert equal(state, model.state_dict())
    name = "model.safetensors" if safetensors else "pytorch_model.bin"
    assert weights.file == str(folder / name) and weights.entry == ""
    assert weights.architecture == "vit_tiny_patch16_224"
    assert dict(weights.data) == {**DATA, "mean": [0.5] * 3, "std": [0.5] * 3}
    assert weights.data_from == "the weights' config.json"
    data = job_data_config(load_spec(write_spec(tmp_path)).job, weights.data, weights.data_from)
    assert data == DataConfig(
        mean=DATA["mean"], std=DATA["std"], interpolation=Interpolation.BICUBIC, crop_pct=0.95,
        origin=dict.fromkeys(DATA, "the weights' config.json"),
    )  # fmt: skip


def test_a_train_py_checkpoint_gives_its_ema_weights_unless_told_not_to(tmp_path: Path) -> None:
    path, raw, ema = train_py_checkpoint(tmp_path / "output", timm_model())
    assert not equal(raw, ema)
    state, weights = loaded(path)
    assert equal(state, ema) and weights.entry == "state_dict_ema"
    assert weights.architecture == "vit_tiny_patch16_224"
    assert weights.data == {"mean": (0.5,) * 3, "std": (0.5,) * 3, "interpolation": "bicubic",
                            "crop_pct": 0.95}  # fmt: skip
    assert weights.data_from.startswith("the checkpoint's train.py arguments")
    state, weights = loaded(path, init_ema=False)
    assert equal(state, raw) and weights.entry == "state_dict"
    # A checkpoint trained without --model-ema has its raw weights only.
    path, raw, _ = train_py_checkpoint(tmp_path / "no-ema", timm_model(), ema=False)
    state, weights = loaded(path)
    assert equal(state, raw) and weights.entry == "state_dict"


def test_a_bare_file_takes_the_architectures_data_config_from_timm(tmp_path: Path) -> None:
    model = timm_model()
    path = tmp_path / "weights.safetensors"
    save_file(model.state_dict(), str(path))
    state, weights = loaded(path)
    assert equal(state, model.state_dict())
    # What timm's train.py --pretrained-path would assume: the architecture's registry config.
    registry = timm.models.get_pretrained_cfg("vit_tiny_patch16_224")
    assert registry is not None
    assert weights.data == {"mean": registry.mean, "std": registry.std,
                            "interpolation": registry.interpolation,
                            "crop_pct": registry.crop_pct}  # fmt: skip
    assert "vit_tiny_patch16_224.augreg_in21k_ft_in1k" in weights.data_from


def test_the_spec_wins_over_the_weights_and_a_value_the_trainer_cannot_use_names_its_field(
    tmp_path: Path,
) -> None:
    spec = write_spec(tmp_path, tables="[job.eval]\ncrop_pct = 0.8\n")
    text = spec.read_text().replace(
        'name = "vit-cpu-tiny"', 'name = "vit-cpu-tiny"\nmean = [0.4, 0.4, 0.4]'
    )
    spec.write_text(text.replace("num_samples = 512", "num_samples = 512\nval_fraction = 0.1"))
    job = load_spec(spec).job
    data = job_data_config(job, {**DATA, "crop_pct": 0.9}, "its config.json")
    assert (data.mean, data.std, data.crop_pct) == ((0.4,) * 3, DATA["std"], 0.8)
    assert data.origin == {"mean": "spec", "std": "its config.json",
                           "interpolation": "its config.json", "crop_pct": "spec"}  # fmt: skip
    assert job_data_config(job).origin["std"] == "default"
    with pytest.raises(
        ConfigError, match=r"interpolation = 'lanczos'.*set job\.eval\.interpolation"
    ):
        job_data_config(job, {**DATA, "interpolation": "lanczos"}, "its config.json")


def test_what_timm_cannot_read_or_another_architecture_is_refused_with_the_fix(
    tmp_path: Path,
) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"is a folder without model\.safetensors or pytorch_"):
        inspect_init(tiny(tmp_path / "empty"))
    (tmp_path / "bad.pth").write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match=r"torch\.load\(weights_only=True\) and timm's"):
        inspect_init(tiny(tmp_path / "bad.pth"))
    # A pickled model needs its code to load: weights_only refuses it, nothing runs.
    torch.save(timm_model(), tmp_path / "pickled.pth")
    with pytest.raises(ConfigError, match=r"WeightsUnpickler|weights_only|Unsupported global"):
        inspect_init(tiny(tmp_path / "pickled.pth"))
    path, _, _ = train_py_checkpoint(tmp_path / "deit", timm_model(), arch="deit_tiny_patch16_224")
    with pytest.raises(
        ConfigError, match=r"its train\.py args\.model says architecture 'deit_tiny_patch16_224'"
    ):
        inspect_init(tiny(path))


def test_check_init_refuses_a_bad_init_before_anything_is_deployed(tmp_path: Path) -> None:
    def spec_with(init: Path) -> Any:
        spec = write_spec(tmp_path)
        text = spec.read_text()
        spec.write_text(
            text.replace('name = "vit-cpu-tiny"', f'name = "vit-cpu-tiny"\ninit = "{init}"')
        )
        return load_spec(spec)

    assert check_init(load_spec(write_spec(tmp_path))) is None  # no init, nothing read
    good = hub_folder(tmp_path / "hub", timm_model())
    checked = check_init(spec_with(good))
    assert checked is not None and checked.state_dict == {}  # shapes only
    hub_folder(tmp_path / "deeper", timm_model(depth=3))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    cases = {
        tmp_path / "missing": r"is not a file or folder; give a hub-form folder",
        tmp_path / "deeper": r"its config\.json has depth = 3, the model 2",
        tmp_path / "other.safetensors": r"the model has tensors the file lacks",
    }
    for init, message in cases.items():
        with pytest.raises(SpecError, match=rf"job\.model\.init = '{init}'.*{message}"):
            check_init(spec_with(init))


@pytest.fixture
def s3(mock_s3: Any) -> Any:
    mock_s3.create_bucket(Bucket="weights")
    return mock_s3


def test_an_s3_hub_folder_is_downloaded_with_its_config(tmp_path: Path, s3: Any) -> None:
    model = timm_model()
    folder = hub_folder(tmp_path / "hub", model, safetensors=False)
    for f in folder.iterdir():
        s3.upload_file(str(f), "weights", f"vit/{f.name}")
    state, weights = loaded("s3://weights/vit/")
    assert equal(state, model.state_dict())
    assert weights.file == "s3://weights/vit/pytorch_model.bin"
    assert weights.data["crop_pct"] == 0.95
    path, _, ema = train_py_checkpoint(tmp_path / "out", timm_model())
    s3.upload_file(str(path), "weights", "runs/model_best.pth.tar")
    state, weights = loaded("s3://weights/runs/model_best.pth.tar")
    assert equal(state, ema) and weights.data_from.startswith("the checkpoint's")
    with pytest.raises(ConfigError, match=r"the folder has neither model\.safetensors nor"):
        loaded("s3://weights/nothing/")


def test_the_model_keeps_no_copy_of_the_loaded_tensors(tmp_path: Path) -> None:
    started = start_model(tiny(hub_folder(tmp_path / "hub", timm_model())), seed=0)
    assert getattr(started.model, "pretrained_cfg")["state_dict"] is None  # noqa: B009
    assert started.weights is not None and started.weights.state_dict == {}
    assert load_file(str(tmp_path / "hub" / "model.safetensors")).keys() == set(
        started.weights.shapes
    )
