"""``job.model.init = "timm:NAME.TAG"`` without the internet: a Hugging Face cache written by the
test (``tests/hub_cache.py``: timm's own ``save_for_hf``, random weights for the real name
``vit_tiny_patch16_224.augreg_in21k_ft_in1k``) with ``HF_HUB_OFFLINE=1``. ``hetero spec check``
accepts it and prints its size; an unknown name or tag, or one the cache lacks, is refused with
the fix; the trainer starts from the same tensors whether it reads the cache (``hetero local``),
the copy staged in S3 (``hetero job start``, ``sagemaker submit``) or the zip a deploy stages."""

from __future__ import annotations

import hashlib
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aws_calls
import pytest
import torch
from hub_cache import INIT, MODEL, HubCache, offline_hub, write_hub_cache

from training import cli
from training.common.names import ENV_INIT_URI
from training.common.timm_hub import human_size, resolve_timm_init, stage_timm_init
from training.spec import SpecError, load_spec
from training.trainer.config import ConfigError, TrainerConfig
from training.trainer.model import check_init, start_model

from .conftest import write_spec

FILES = ("config.json", "model.safetensors")


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HubCache:
    cache = write_hub_cache(tmp_path / "hf")
    offline_hub(monkeypatch, cache.root)
    return cache


def spec_file(tmp_path: Path, init: str = INIT) -> Path:
    """The tiny CPU ViT (``vit-cpu-tiny``: vit_tiny_patch16_224's shape of the cache's weights)
    on 10 classes, starting from ``init``."""
    return write_spec(tmp_path, model_keys=f'init = "{init}"')


def started(path: Path, environ: dict[str, str] | None = None) -> Any:
    config = TrainerConfig.from_spec(
        load_spec(path), run_dir=path.parent, synthetic=True, environ=environ or {}
    )
    return start_model(config.model, seed=0)


def test_spec_check_accepts_a_cached_init_and_prints_its_size(
    tmp_path: Path, hub: HubCache, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["spec", "check", "--spec", str(spec_file(tmp_path))]) == 0
    size = sum((hub.snapshot / name).stat().st_size for name in FILES)
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert (
        f"job.model.init {INIT}: {human_size(size)} (config.json, model.safetensors) from the "
        f"Hugging Face Hub repository timm/{MODEL}, in the cache at {hub.snapshot}; hetero job "
        "start and hetero sagemaker submit stage it into the checkpoint bucket "
        "(init/<sha256>/), cdk deploy as a CDK asset, for instances without internet; hetero "
        "local reads it from the cache"
    ) in out
    assert human_size(size) == f"{size / 1e3:.1f} kB"


def test_an_unknown_name_or_tag_or_one_the_cache_lacks_is_refused_with_the_fix(
    tmp_path: Path, hub: HubCache, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = {
        "timm:vit_tiny_patch16_224.in1k_nope": "timm has no pretrained tag 'in1k_nope' for "
        "vit_tiny_patch16_224; its tags: augreg_in21k, augreg_in21k_ft_in1k",
        "timm:vit_tinyy_patch16_224.augreg_in21k": "timm has no model 'vit_tinyy_patch16_224' "
        "(close: vit_tiny_patch16_224,",
        # A real name and tag, not in this cache, and offline.
        "timm:vit_tiny_patch16_224.augreg_in21k": "config.json of "
        "timm/vit_tiny_patch16_224.augreg_in21k is not in the Hugging Face cache "
        f"({hub.root}) and HF_HUB_OFFLINE is set; download it once where the Hub is reachable "
        "(hf download timm/vit_tiny_patch16_224.augreg_in21k config.json model.safetensors), "
        "or point HF_HUB_CACHE at a cache that has it",
    }
    for init, message in cases.items():
        with pytest.raises(SpecError) as refused:
            check_init(load_spec(spec_file(tmp_path, init)))
        (problem,) = refused.value.problems
        assert problem.startswith(f"job.model.init = {init!r}: {message}"), problem
    # Through the command: exit 2, the field and the fix on stderr.
    path = spec_file(tmp_path, "timm:vit_tiny_patch16_224.augreg_in21k")
    assert cli.main(["spec", "check", "--spec", str(path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "job.model.init = 'timm:vit_tiny_patch16_224.augreg_in21k': config.json of" in err
    assert "(hf download timm/vit_tiny_patch16_224.augreg_in21k config.json" in err


def test_weights_of_another_model_are_refused_like_any_hub_folders(
    tmp_path: Path, hub: HubCache
) -> None:
    """The cache's config.json and tensors are checked against the model as any folder's."""
    path = write_spec(tmp_path, model_keys=f'init = "{INIT}"\noverrides = {{ depth = 3 }}')
    with pytest.raises(SpecError) as refused:
        check_init(load_spec(path))
    assert refused.value.problems[0] == (
        f"job.model.init = {INIT!r} does not fit job.model ('vit-cpu-tiny': "
        "vit_tiny_patch16_224 with {'depth': 3}): its config.json has depth = 2, the model 3"
    )


def test_the_trainer_starts_from_the_cache_with_its_tensors_and_data_config(
    tmp_path: Path, hub: HubCache
) -> None:
    model = started(spec_file(tmp_path))
    assert model.weights is not None and model.weights.hub is not None
    assert model.weights.file == str(hub.snapshot / "model.safetensors")
    assert model.weights.data_from == "the weights' config.json"
    # timm's registry config of the tag, as timm's save_for_hf wrote it into config.json.
    assert dict(model.weights.data) == {
        "mean": [0.5] * 3, "std": [0.5] * 3, "interpolation": "bicubic", "crop_pct": 0.9,
    }  # fmt: skip
    state = model.model.state_dict()
    # The classifier of 1000 classes is re-initialised for the spec's 10; the rest is the file's.
    body = [k for k in hub.state_dict if not k.startswith("head.")]
    assert body and all(torch.equal(state[k], hub.state_dict[k]) for k in body)
    assert state["head.weight"].shape == (10, 32)


def test_its_staged_copy_in_s3_gives_the_same_weights(
    tmp_path: Path,
    hub: HubCache,
    mock_s3: Any,
    record_aws_calls: Callable[..., Path],
) -> None:
    """What ``hetero job start`` and ``sagemaker submit`` stage, read as the instance role and
    as the SageMaker execution role (their calls recorded for the IAM proof)."""
    mock_s3.create_bucket(Bucket="ckpt")
    staged = stage_timm_init(
        resolve_timm_init(INIT), s3=mock_s3, checkpoint_base_uri="s3://ckpt/checkpoints/"
    )
    digest = hashlib.sha256()
    for name in FILES:  # the content address: names, sizes and bytes, in name order
        data = (hub.snapshot / name).read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode() + data)
    assert staged.uri == f"s3://ckpt/checkpoints/init/{digest.hexdigest()}/"
    local = started(spec_file(tmp_path)).model.state_dict()
    record_aws_calls(
        aws_calls.Names(cluster="trainer-test", checkpoint_bucket="ckpt"), principal="instance"
    )
    from_s3 = started(spec_file(tmp_path), {ENV_INIT_URI: staged.uri})
    assert from_s3.weights is not None and from_s3.weights.hub is None  # the cache not asked
    assert from_s3.weights.uri == INIT
    assert from_s3.weights.file == f"{staged.uri}model.safetensors"
    state = from_s3.model.state_dict()
    assert state.keys() == local.keys() and all(torch.equal(state[k], local[k]) for k in local)
    record_aws_calls(
        aws_calls.Names(cluster="trainer-test", checkpoint_bucket="ckpt"), principal="sagemaker"
    )
    assert started(spec_file(tmp_path), {ENV_INIT_URI: staged.uri}).weights is not None


def test_the_zip_a_deploy_stages_gives_the_same_weights(
    tmp_path: Path, hub: HubCache, mock_s3: Any
) -> None:
    """``cdk deploy``'s asset: the two files zipped (infra/init_asset.py), in the asset bucket."""
    archive = tmp_path / "asset.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for name in FILES:
            z.write(hub.snapshot / name, name)
    mock_s3.create_bucket(Bucket="cdk-assets")
    mock_s3.upload_file(str(archive), "cdk-assets", "0123abcd.zip")
    local = started(spec_file(tmp_path)).model.state_dict()
    from_zip = started(spec_file(tmp_path), {ENV_INIT_URI: "s3://cdk-assets/0123abcd.zip"})
    assert from_zip.weights is not None
    assert from_zip.weights.file == "model.safetensors in s3://cdk-assets/0123abcd.zip"
    assert from_zip.weights.data_from == "the weights' config.json"
    state = from_zip.model.state_dict()
    assert all(torch.equal(state[k], local[k]) for k in local)
    with pytest.raises(ConfigError, match=r"cannot download 's3://cdk-assets/other\.zip'"):
        started(spec_file(tmp_path), {ENV_INIT_URI: "s3://cdk-assets/other.zip"})


def test_a_staged_copy_without_an_init_in_the_spec_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"{ENV_INIT_URI} = 's3://b/init/x/' names a staged"):
        TrainerConfig.from_spec(
            load_spec(write_spec(tmp_path)), run_dir=tmp_path, synthetic=True,
            environ={ENV_INIT_URI: "s3://b/init/x/"},
        )  # fmt: skip
