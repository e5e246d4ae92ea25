"""``job.model.init``: fine-tuning starts from a ``model.safetensors`` (local or S3). Every tensor
but the classifier comes from the file; the classifier is re-initialised, seeded, when the class
count differs; another image size resamples ``pos_embed`` (another patch size or channel count:
``test_finetune_recipe.py``); anything else that differs is refused, naming the field. (The
other forms users have, hub-form folders and timm ``train.py`` checkpoints, and the data config
of the weights: ``test_init_weights.py``.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file

from training.spec import load_spec
from training.trainer.config import ConfigError, ModelConfig, TrainerConfig
from training.trainer.model import build_model, inspect_init, plan_init

from .conftest import write_spec

TINY = {"patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2}


def source_file(folder: Path, *, num_classes: int = 10, seed: int = 7, **overrides: int) -> Path:
    """A timm-format weights file written by plain timm (as one from the hub would be)."""
    torch.manual_seed(seed)
    kwargs: dict[str, Any] = {**TINY, **overrides}
    model = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, num_classes=num_classes, **kwargs
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def tiny(init: str | None, num_classes: int = 5, image_size: int = 32) -> ModelConfig:
    return ModelConfig("vit-cpu-tiny", {}, image_size, num_classes, init=init)


def test_a_ten_class_file_into_five_classes_reinitialises_only_the_head(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = source_file(tmp_path / "src")
    saved = load_file(str(path))
    with caplog.at_level(logging.INFO, logger="training.trainer.model"):
        first = build_model(tiny(str(path)), seed=3).state_dict()
    again = build_model(tiny(str(path)), seed=3).state_dict()
    other_seed = build_model(tiny(str(path)), seed=4).state_dict()
    assert first.keys() == saved.keys()
    for key, value in first.items():
        if key.startswith("head."):
            assert value.shape[0] == 5 and saved[key].shape[0] == 10
            assert torch.equal(value, again[key]), key  # one seed: identical on every rank
            if key == "head.weight":  # (timm starts the bias at zero)
                assert not torch.equal(value, other_seed[key])
        else:
            assert torch.equal(value, saved[key]), key
    # Without a file, the same seed gives the same head: the classifier is the seeded init.
    fresh = build_model(tiny(None), seed=3).state_dict()
    assert torch.equal(fresh["head.weight"], first["head.weight"])
    assert not torch.equal(fresh["cls_token"], first["cls_token"])
    assert "re-initialised head.weight, head.bias (seed 3)" in caplog.text
    assert "the file has 10 classes, the model 5" in caplog.text
    assert f"loaded {len(saved) - 2} tensors from {path} (10 classes)" in caplog.text


def test_the_same_class_count_loads_every_tensor_including_the_head(tmp_path: Path) -> None:
    path = source_file(tmp_path / "src", num_classes=5)
    saved = load_file(str(path))
    model = build_model(tiny(str(path)), seed=0).state_dict()
    assert all(torch.equal(model[k], saved[k]) for k in saved)
    assert plan_init(tiny(str(path)), inspect_init(tiny(str(path)))).reinit == ()


def test_another_image_size_resamples_pos_embed_with_timm(tmp_path: Path) -> None:
    path = source_file(tmp_path / "src")  # 32 px: a 4 x 4 grid
    model = build_model(tiny(str(path), image_size=64), seed=0)  # 8 x 8
    state = model.state_dict()
    assert state["pos_embed"].shape == (1, 65, 32)
    assert torch.equal(state["cls_token"], load_file(str(path))["cls_token"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"depth": 3}, r"the file has tensors the model lacks: blocks\.2\.attn"),
        ({"depth": 1}, r"the model has tensors the file lacks: blocks\.1\.attn"),
        (
            {"embed_dim": 48, "num_heads": 3},
            r"shapes differ \(file vs model\): blocks\.0\.attn\.proj\.bias \[48\] vs \[32\]",
        ),
    ],
)
def test_a_file_of_another_architecture_is_refused(
    tmp_path: Path, overrides: dict[str, int], message: str
) -> None:
    path = source_file(tmp_path / "src", **overrides)
    with pytest.raises(
        ConfigError,
        match=r"job\.model\.init = '.*model\.safetensors' does not "
        rf"fit job\.model \('vit-cpu-tiny'.*{message}",
    ):
        build_model(tiny(str(path)), seed=0)


def test_a_config_json_beside_the_file_must_name_the_same_architecture(tmp_path: Path) -> None:
    path = source_file(tmp_path / "src")
    (path.parent / "config.json").write_text(
        json.dumps({"architecture": "deit_tiny_patch16_224", "model_args": {"num_heads": 4}})
    )
    with pytest.raises(ConfigError) as e:
        build_model(tiny(str(path)), seed=0)
    text = str(e.value)
    assert "its config.json says architecture 'deit_tiny_patch16_224'" in text
    assert "its config.json has num_heads = 4, the model 2" in text
    # A hub-style name with a tag and the same arguments is the same architecture.
    (path.parent / "config.json").write_text(
        json.dumps({"architecture": "vit_tiny_patch16_224.augreg", "model_args": TINY})
    )
    build_model(tiny(str(path)), seed=0)


def test_a_missing_or_unreadable_file_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"job\.model\.init = '.*nothing' is not a file or folder"
    ):
        build_model(tiny(str(tmp_path / "nothing")), seed=0)
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match=r"job\.model\.init = .* is not a safetensors file"):
        build_model(tiny(str(tmp_path / "bad.safetensors")), seed=0)


def test_the_spec_field_reaches_the_model_config(tmp_path: Path) -> None:
    spec = write_spec(tmp_path)
    text = spec.read_text().replace('name = "vit-cpu-tiny"', 'name = "vit-cpu-tiny"\ninit = "x"')
    spec.write_text(text)
    config = TrainerConfig.from_spec(load_spec(spec), run_dir=tmp_path, synthetic=True)
    assert config.model.init == "x"


@pytest.fixture
def s3(mock_s3: Any) -> Any:
    mock_s3.create_bucket(Bucket="weights")
    return mock_s3


def test_an_s3_file_is_downloaded_and_loaded(tmp_path: Path, s3: object) -> None:
    path = source_file(tmp_path / "src")
    s3.upload_file(str(path), "weights", "vit/model.safetensors")  # type: ignore[attr-defined]
    model = build_model(tiny("s3://weights/vit/model.safetensors"), seed=3).state_dict()
    local = build_model(tiny(str(path)), seed=3).state_dict()
    assert all(torch.equal(model[k], local[k]) for k in local)
    with pytest.raises(
        ConfigError, match=r"job\.model\.init = 's3://weights/none.*cannot download"
    ):
        build_model(tiny("s3://weights/none/model.safetensors"), seed=3)
    # A config.json beside it in S3 is checked too.
    s3.put_object(  # type: ignore[attr-defined]
        Bucket="weights", Key="vit/config.json", Body=b'{"architecture": "resnet50"}'
    )
    with pytest.raises(ConfigError, match="architecture 'resnet50'"):
        build_model(tiny("s3://weights/vit/model.safetensors"), seed=3)
