"""A model file out: ``model.safetensors`` + ``config.json`` from a checkpoint (local or S3, one
rank or two FSDP ranks), loaded back with plain timm only (no project code in the loading path)
to the trained model's logits; EMA weights preferred; incomplete checkpoints refused; the
``config.json`` fields exactly; ``hetero export`` end to end."""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import aws_calls
import boto3
import numpy as np
import pytest
import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
import torch.nn.functional as F
from moto import mock_aws
from PIL import Image
from safetensors.torch import load_file
from timm.data import create_transform, resolve_data_config
from timm.utils import ModelEmaV3
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from training.common import call_log
from training.common.steps import MARKER
from training.data.transforms import EvalTransform, build_eval_transform
from training.spec import Interpolation, load_spec
from training.trainer import export
from training.trainer.checkpoint import Checkpointer
from training.trainer.checkpoint_s3 import S3CheckpointStore
from training.trainer.config import TrainerConfig
from training.trainer.data_config import DataConfig
from training.trainer.export import export_checkpoint, export_trained, write_model
from training.trainer.local_run import FORKSERVER_PRELOAD, free_port
from training.trainer.model import build_model
from training.trainer.model_config import ExportError
from training.trainer.parallel_dims import ParallelDims
from training.trainer.parallelize import parallelize

from .conftest import REPO, write_spec

CLASSES = ["cat", "dog", "fox"]
EVAL = '\n[job.eval]\ncrop_pct = 0.9\ninterpolation = "bicubic"\n'


def folder_spec(tmp: Path, **kwargs: Any) -> Path:
    """The tiny ViT spec on a three-class image folder (its class names go into config.json),
    with a non-default eval transform."""
    images = tmp / "images"
    for i, name in enumerate(CLASSES):
        (images / name).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (40, 40), (60 * i, 90, 200)).save(images / name / "0.png")
    spec = write_spec(tmp, **kwargs)
    text = spec.read_text().replace(
        "num_samples = 512\nnum_classes = 10",
        f'source = "folder"\npath = "{images}"\nval_fraction = 0.5\nnum_classes = 3',
    )
    spec.write_text(text + EVAL)
    return spec


def config_of(spec: Path, tmp: Path) -> TrainerConfig:
    return TrainerConfig.from_spec(load_spec(spec), run_dir=tmp / "run", synthetic=True)


def train(model: nn.Module, steps: int, ema: ModelEmaV3 | None = None, seed: int = 0) -> Any:
    """A few AdamW steps on random images (so the weights are not the initial ones)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 3, 32, 32, generator=g)
        y = torch.randint(0, 3, (4,), generator=g)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if ema is not None:
            ema.update(model)
    return opt


def saved_checkpoint(
    tmp: Path, *, with_ema: bool, store: S3CheckpointStore | None = None
) -> tuple[TrainerConfig, nn.Module, nn.Module | None]:
    """One rank trains 3 steps and saves step 3 with the project's Checkpointer (with the EMA
    under "ema", as the trainer saves it)."""
    config = config_of(folder_spec(tmp), tmp)
    model = build_model(config.model, seed=0)
    ema = ModelEmaV3(model, decay=0.5) if with_ema else None
    opt = train(model, 3, ema)
    ckpt = Checkpointer(config.checkpoint.dir, keep=2, rank=0, world_size=1, store=store)
    if ema is not None:
        ckpt.extra["ema"] = ema.module
    ckpt.save(3, model, opt, {"epoch": 0})
    return config, model, ema.module if ema is not None else None


def fixed_input() -> torch.Tensor:
    return torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(123))


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(x)


def load_with_timm(folder: Path) -> nn.Module:
    """Plain timm only: the architecture and its arguments from config.json, the weights from
    model.safetensors, config.json's pretrained_cfg as the overlay (its num_classes, or timm
    drops a non-1000-class head; its custom_load false, or timm < 1.0.31 hands the file to the
    ViT's .npz loader; its mean/std for resolve_data_config(model=...))."""
    config = json.loads((folder / "config.json").read_text())
    return timm.create_model(
        config["architecture"],
        pretrained=True,
        pretrained_cfg_overlay={
            **config["pretrained_cfg"],
            "file": str(folder / "model.safetensors"),
        },
        **config["model_args"],
    )


def test_an_export_loads_in_plain_timm_with_the_trained_logits(tmp_path: Path) -> None:
    config, model, _ = saved_checkpoint(tmp_path, with_ema=False)
    out = tmp_path / "exported"
    result = export_checkpoint(str(config.checkpoint.dir), spec=config.spec, out=str(out))
    assert (result.weights, result.step, result.out) == ("model", 3, str(out))
    assert result.source == str(config.checkpoint.dir / "step-3")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    x = fixed_input()
    expected = logits(model, x)
    assert torch.equal(logits(load_with_timm(out), x), expected)
    # timm's own folder loader reads config.json alone.
    assert torch.equal(logits(timm.create_model(f"local-dir:{out}", pretrained=True), x), expected)
    saved = load_file(str(out / "model.safetensors"))
    assert saved.keys() == model.state_dict().keys()
    assert all(v.dtype == torch.float32 and v.is_contiguous() for v in saved.values())
    assert result.parameters == sum(p.numel() for p in model.parameters())
    assert result.bytes == (out / "model.safetensors").stat().st_size


def test_the_ema_weights_are_exported_when_the_checkpoint_has_them(tmp_path: Path, caplog) -> None:
    config, model, ema = saved_checkpoint(tmp_path, with_ema=True)
    assert ema is not None
    root = str(config.checkpoint.dir)
    with caplog.at_level("INFO", logger="training.trainer.export"):
        result = export_checkpoint(root, spec=config.spec, out=str(tmp_path / "ema"))
    assert result.weights == "ema" and "EMA weights of step 3" in result.describe()
    assert "read the ema weights of step 3" in caplog.text
    saved = load_file(str(tmp_path / "ema" / "model.safetensors"))
    for key, value in ema.state_dict().items():
        assert torch.equal(saved[key], value), key
    assert not torch.equal(saved["cls_token"], model.state_dict()["cls_token"])  # not the raw
    x = fixed_input()
    assert torch.equal(logits(load_with_timm(tmp_path / "ema"), x), logits(ema, x))
    # The raw weights on request.
    raw = export_checkpoint(root, spec=config.spec, out=str(tmp_path / "raw"), weights="model")
    assert raw.weights == "model"
    assert torch.equal(logits(load_with_timm(tmp_path / "raw"), x), logits(model, x))


def test_config_json_holds_exactly_what_timm_needs(tmp_path: Path) -> None:
    config, _, _ = saved_checkpoint(tmp_path, with_ema=True)
    export_checkpoint(str(config.checkpoint.dir), spec=config.spec, out=str(tmp_path / "o"))
    written = json.loads((tmp_path / "o" / "config.json").read_text())
    assert written == {
        "architecture": "vit_tiny_patch16_224",
        "num_classes": 3,
        "num_features": 32,
        "global_pool": "token",
        "model_args": {
            "patch_size": 8,
            "depth": 2,
            "embed_dim": 32,
            "num_heads": 2,
            "img_size": 32,
            "num_classes": 3,
        },
        "label_names": CLASSES,
        "pretrained_cfg": {
            "custom_load": False,
            "input_size": [3, 32, 32],
            "fixed_input_size": True,
            "interpolation": "bicubic",
            "crop_pct": 0.9,
            "crop_mode": "center",
            "mean": [0.485, 0.456, 0.406],
            "std": [0.229, 0.224, 0.225],
            "num_classes": 3,
            "pool_size": None,
            "first_conv": "patch_embed.proj",
            "classifier": "head",
        },
        "hetero": {
            "source": str(config.checkpoint.dir / "step-3"),
            "step": 3,
            "weights": "ema",
            "timm": timm.__version__,
            "torch": torch.__version__.split("+")[0],
        },
    }
    # Plain timm turns it into the trainer's eval preprocessing: same pixels, normalised.
    model = timm.create_model(f"local-dir:{tmp_path / 'o'}", pretrained=True)
    assert getattr(model, "pretrained_cfg")["label_names"] == CLASSES  # noqa: B009
    data = resolve_data_config(model=model)
    assert data == {
        "input_size": (3, 32, 32),
        "interpolation": "bicubic",
        "crop_pct": 0.9,
        "crop_mode": "center",
        "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225],
    }
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (50, 70, 3), dtype=np.uint8))
    theirs = create_transform(**data)(image)
    ours = build_eval_transform(EvalTransform(0.9, Interpolation.BICUBIC), 32)(image)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    torch.testing.assert_close(theirs, (ours.float() / 255 - mean) / std, atol=1e-6, rtol=0)


def test_an_incomplete_checkpoint_is_refused(tmp_path: Path) -> None:
    config, _, _ = saved_checkpoint(tmp_path, with_ema=False)
    root = config.checkpoint.dir
    spec, out = config.spec, str(tmp_path / "out")
    # A newer step without its marker: the root still means the newest complete step.
    (root / "step-5").mkdir()
    (root / "step-5" / ".metadata").write_bytes(b"cut off")
    assert export_checkpoint(str(root), spec=spec, out=out).step == 3
    with pytest.raises(ExportError, match=r"step-5 is not a complete checkpoint \(no COMPLETE"):
        export_checkpoint(str(root / "step-5"), spec=spec, out=out)
    (root / "step-3" / MARKER).unlink()
    with pytest.raises(ExportError, match=r"holds no complete step-N checkpoint \(step-3, step-5"):
        export_checkpoint(str(root), spec=spec, out=out)
    (root / "step-7.partial").mkdir()
    with pytest.raises(ExportError, match=r"step-7\.partial is a save in progress or cut off"):
        export_checkpoint(str(root / "step-7.partial"), spec=spec, out=out)
    with pytest.raises(ExportError, match="is not a folder"):
        export_checkpoint(str(root / "step-9"), spec=spec, out=out)


def test_a_checkpoint_of_another_model_is_refused_naming_the_spec(tmp_path: Path) -> None:
    config, _, _ = saved_checkpoint(tmp_path, with_ema=False)
    other = tmp_path / "other.toml"
    other.write_text(
        folder_spec(tmp_path / "b")
        .read_text()
        .replace('name = "vit-cpu-tiny"', 'name = "vit-cpu-tiny"\noverrides = { depth = 3 }')
    )
    with pytest.raises(ExportError, match=r"do not match the spec's job\.model: missing blocks\.2"):
        export_checkpoint(str(config.checkpoint.dir), spec=load_spec(other), out=str(tmp_path))


def test_write_model_refuses_a_partial_state_dict_and_never_leaves_half_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = config_of(folder_spec(tmp_path), tmp_path)
    model = build_model(config.model, seed=0)
    common: dict[str, Any] = dict(model_config=config.model, classes=CLASSES, data=DataConfig())
    partial = {k: v for k, v in model.state_dict().items() if k != "head.bias"}
    with pytest.raises(ExportError, match=r"missing head\.bias"):
        write_model(partial, out_dir=tmp_path / "m", **common)
    assert not (tmp_path / "m").exists()
    write_model(model.state_dict(), out_dir=tmp_path / "m", **common)
    before = (tmp_path / "m" / "model.safetensors").read_bytes()

    def cut_off(tensors: Any, path: str, metadata: Any = None) -> None:
        Path(path).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", cut_off)
    with pytest.raises(OSError, match="disk full"):
        write_model(model.state_dict(), out_dir=tmp_path / "m", **common)
    # The previous export is whole, and no temporary file is left.
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]


# -- S3 ----------------------------------------------------------------------------------------


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    for key in ("AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        client = boto3.client("s3")
        client.create_bucket(Bucket="bucket")
        yield client


def test_s3_checkpoint_in_and_s3_model_out(
    tmp_path: Path, s3: Any, record_aws_calls: Callable[..., Path]
) -> None:
    # What `hetero export` asks of S3, as the user runs it.
    record_aws_calls(aws_calls.Names(cluster="vit", checkpoint_bucket="bucket"))
    call_log.attach(s3)
    store = S3CheckpointStore("s3://bucket/ckpt", client=s3)
    config, _, ema = saved_checkpoint(tmp_path, with_ema=True, store=store)
    assert ema is not None
    uploads: list[str] = []
    s3.meta.events.register(
        "before-parameter-build.s3.PutObject", lambda params, **_: uploads.append(params["Key"])
    )
    s3.meta.events.register(
        "before-parameter-build.s3.CreateMultipartUpload",
        lambda params, **_: uploads.append(params["Key"]),
    )
    downloads: list[str] = []
    s3.meta.events.register(
        "before-parameter-build.s3.GetObject",
        lambda params, **_: downloads.append(f"{params['Key']} {params.get('Range')}"),
    )
    result = export_checkpoint(
        "s3://bucket/ckpt", spec=config.spec, out="s3://bucket/models/run-1/", client=s3
    )
    # Only the EMA's bytes of the shard file came down (no optimizer state), and the metadata.
    assert downloads[0].startswith("ckpt/step-3/.metadata ")
    assert all(d.startswith("ckpt/step-3/__0_0.distcp bytes=") for d in downloads[1:]), downloads
    fetched = sum(
        1 + int(b) - int(a) for a, b in (d.rsplit("=", 1)[1].split("-") for d in downloads[1:])
    )
    assert fetched < (config.checkpoint.dir / "step-3" / "__0_0.distcp").stat().st_size / 3
    assert result.weights == "ema" and result.source == "s3://bucket/ckpt/step-3/"
    assert result.model_file == "s3://bucket/models/run-1/model.safetensors"
    assert result.config_file == "s3://bucket/models/run-1/config.json"
    assert uploads == ["models/run-1/model.safetensors", "models/run-1/config.json"]
    got = tmp_path / "downloaded"
    got.mkdir()
    for name in ("model.safetensors", "config.json"):
        s3.download_file("bucket", f"models/run-1/{name}", str(got / name))
    x = fixed_input()
    assert torch.equal(logits(load_with_timm(got), x), logits(ema, x))
    # A named S3 step works too; one without its marker is refused.
    named = export_checkpoint(
        "s3://bucket/ckpt/step-3", spec=config.spec, out=str(tmp_path / "local"), client=s3
    )
    assert named.step == 3
    s3.delete_object(Bucket="bucket", Key="ckpt/step-3/COMPLETE")
    with pytest.raises(ExportError, match=r"s3://bucket/ckpt/step-3/ is not a complete"):
        export_checkpoint("s3://bucket/ckpt/step-3", spec=config.spec, out="x", client=s3)
    with pytest.raises(ExportError, match=r"s3://bucket/ckpt holds no complete step-N"):
        export_checkpoint("s3://bucket/ckpt", spec=config.spec, out="x", client=s3)


# -- two FSDP ranks ----------------------------------------------------------------------------


def _fsdp_rank(rank: int, port: int, tmp: Path) -> None:
    """Rank ``rank`` of 2: FSDP2 (the trainer's parallelize), two AdamW steps on its own data,
    an EMA beside it, a checkpoint at step 2 from both ranks, then the logits of the trained
    model (a collective forward) and the end-of-job export (``export_trained``). The model is
    saved as FSDP shards, the EMA as full tensors replicated on both ranks (DDP's layout, which
    DCP writes once): both layouts in one checkpoint."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    torch.set_num_threads(1)
    config = config_of(tmp / "spec.toml", tmp)
    model = build_model(config.model, seed=0)
    ema = copy.deepcopy(model)
    dims = ParallelDims.resolve(config.parallel, world_size=2, local_world_size=2)
    model = parallelize(model, dims, dims.build_mesh("cpu"), torch.device("cpu"), bf16=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x = torch.randn(4, 3, 32, 32, generator=g)
        F.cross_entropy(model(x), torch.randint(0, 3, (4,), generator=g)).backward()
        opt.step()
        opt.zero_grad()
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        with torch.no_grad():
            for key, value in ema.state_dict().items():
                value.lerp_(full[key], 0.5)
    ckpt = Checkpointer(config.checkpoint.dir, keep=2, rank=rank, world_size=2)
    ckpt.extra["ema"] = ema
    ckpt.save(2, model, opt, {"rank": rank})
    x = fixed_input()
    trained, averaged = logits(model, x), logits(ema, x)
    result = export_trained(model, ema, config=config, step=2, rank=rank)
    if rank == 0:
        assert result is not None and result.weights == "ema"
        torch.save({"model": trained, "ema": averaged}, tmp / "logits.pt")
    else:
        assert result is None
    # Rank 0 cannot write (a file where the folder should be): every rank raises alike.
    (tmp / "blocked").write_text("not a folder")
    try:
        export_trained(model, ema, config=config, step=2, rank=rank, out=str(tmp / "blocked/m"))
        seen = "exported"
    except ExportError as e:
        seen = str(e)
    (tmp / f"blocked-{rank}.txt").write_text(seen)
    dist.barrier()  # the ranks are still in step: nobody waits for a rank that raised
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_a_checkpoint_of_two_fsdp_ranks_exports_in_one_process(tmp_path: Path, s3: Any) -> None:
    spec = folder_spec(tmp_path, strategy="fsdp")
    multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    torch_mp.start_processes(
        _fsdp_rank, args=(free_port(), tmp_path), nprocs=2, start_method="forkserver"
    )
    ckpts = tmp_path / "checkpoints"
    step = ckpts / "step-2"
    assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in step.iterdir()}
    expected = torch.load(tmp_path / "logits.pt")
    spec_ = load_spec(spec)
    x = fixed_input()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks computed theirs
    try:
        for weights in ("ema", "model"):
            out = tmp_path / f"out-{weights}"
            result = export_checkpoint(str(step), spec=spec_, out=str(out), weights=weights)
            assert result.weights == weights
            assert torch.equal(logits(load_with_timm(out), x), expected[weights]), weights
    finally:
        torch.set_num_threads(threads)
    # The end-of-job export (gathered from the live FSDP model) wrote the same tensors, beside
    # the checkpoints.
    live = load_file(str(ckpts / "model" / "model.safetensors"))
    exported = load_file(str(tmp_path / "out-ema" / "model.safetensors"))
    assert live.keys() == exported.keys()
    assert all(torch.equal(live[k], exported[k]) for k in live)
    meta = json.loads((ckpts / "model" / "config.json").read_text())["hetero"]
    assert meta["source"] == str(step) and meta["weights"] == "ema"
    for rank in (0, 1):
        seen = (tmp_path / f"blocked-{rank}.txt").read_text()
        assert seen.startswith(f"exporting the model to {tmp_path / 'blocked/m'} failed:"), seen
    # From S3: only the EMA's byte ranges of both ranks' files are fetched; the same tensors.
    store = S3CheckpointStore("s3://bucket/fsdp", client=s3)
    store.upload_files(step, 2)
    store.upload_marker(step / MARKER, 2)
    export_checkpoint("s3://bucket/fsdp", spec=spec_, out=str(tmp_path / "from-s3"), client=s3)
    from_s3 = load_file(str(tmp_path / "from-s3" / "model.safetensors"))
    assert all(torch.equal(from_s3[k], exported[k]) for k in exported)


# -- hetero export -----------------------------------------------------------------------------


def test_hetero_export_end_to_end(tmp_path: Path) -> None:
    config, _, ema = saved_checkpoint(tmp_path, with_ema=True)
    assert ema is not None
    spec = tmp_path / "spec.toml"
    cmd = [
        sys.executable,
        "-m",
        "training.cli",
        "export",
        "--spec",
        str(spec),
        "--checkpoint",
        str(config.checkpoint.dir),
        "--out",
        str(tmp_path / "cli"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"exported EMA weights of step 3 from {config.checkpoint.dir}")
    assert lines[1].startswith(f"wrote {tmp_path / 'cli' / 'model.safetensors'} (")
    assert lines[2] == f"wrote {tmp_path / 'cli' / 'config.json'}"
    assert lines[3].startswith("in ") and "s (read " in lines[3]
    x = fixed_input()
    assert torch.equal(logits(load_with_timm(tmp_path / "cli"), x), logits(ema, x))
    # An incomplete step: exit 2 and why, on stderr.
    (config.checkpoint.dir / "step-3" / MARKER).unlink()
    cmd[cmd.index("--checkpoint") + 1] = str(config.checkpoint.dir / "step-3")
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "step-3 is not a complete checkpoint (no COMPLETE marker" in done.stderr


def test_export_trained_in_one_process_writes_beside_the_checkpoints(tmp_path: Path) -> None:
    config = config_of(folder_spec(tmp_path), tmp_path)
    model = build_model(config.model, seed=0)
    result = export_trained(model, None, config=config, step=7, rank=0, classes=["a", "b", "c"])
    assert result is not None and result.weights == "model" and result.step == 7
    assert result.out == str(config.checkpoint.dir / "model")
    written = json.loads((config.checkpoint.dir / "model" / "config.json").read_text())
    assert written["label_names"] == ["a", "b", "c"]  # as given: the dataset is not listed
    assert written["hetero"]["source"] == str(config.checkpoint.dir / "step-7")
    x = fixed_input()
    loaded = load_with_timm(config.checkpoint.dir / "model")
    assert torch.equal(logits(loaded, x), logits(model, x))


def test_model_location_is_beside_the_checkpoints(tmp_path: Path) -> None:
    config = config_of(folder_spec(tmp_path), tmp_path)
    assert export.model_location(config.checkpoint) == str(config.checkpoint.dir / "model")
    s3 = TrainerConfig.from_spec(
        config.spec, run_dir=tmp_path, synthetic=True, checkpoint_s3_uri="s3://b/run/"
    )
    assert export.model_location(s3.checkpoint) == "s3://b/run/model"
