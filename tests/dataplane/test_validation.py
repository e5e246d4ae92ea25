"""The validation split through the data plane: servers serve both splits (training ranges never
hold a validation image, checked on the files), validation ranges in identity order with the
eval transform, refusals, and the client's ``split="val"``."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from training.data.augment import load_image
from training.data.batch import Unreadable
from training.data.datasets import FolderImages, ImageSource
from training.data.splits import SubsetImages, build_splits
from training.data.transforms import EvalTransform, build_transform, encode_recipe
from training.dataplane.client import DataPlaneClient, DataPlaneUnavailable
from training.dataplane.processes import start_server_process
from training.dataplane.server import create_server
from training.dataplane.sources import AugmentingBatchSource
from training.dataplane.v1 import dataplane_pb2 as pb
from training.dataplane.v1 import dataplane_pb2_grpc as pb_grpc
from training.dataplane.wire import decode_batch
from training.spec import DatasetSource, DatasetSpec

EVAL = EvalTransform(crop_pct=0.9)


def write_folder(root: Path, classes: int = 3, per_class: int = 8) -> Path:
    """An ImageFolder of 32-48 px PNGs, each distinct."""
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            rng = np.random.default_rng(100 * c + i)
            pixels = rng.integers(0, 256, (36, 44, 3), dtype=np.uint8)
            buf = io.BytesIO()
            Image.fromarray(pixels).save(buf, format="PNG")
            (root / f"c{c}" / f"{i}.png").write_bytes(buf.getvalue())
    return root


def folder_spec(root: Path) -> DatasetSpec:
    # 24 images: round(24 * 0.25) = 6 held out for validation, 18 trained on.
    return DatasetSpec(
        source=DatasetSource.FOLDER, path=str(root), image_size=32, val_fraction=0.25
    )


def files(split: ImageSource, ids: list[int]) -> list[str]:
    """The image file behind each of ``split``'s sample ``ids``."""
    assert isinstance(split, SubsetImages) and isinstance(split.source, FolderImages)
    return [split.source.samples[split.base_index(i)][0] for i in ids]


def eval_pixels(split: ImageSource, ids: list[int]) -> bytes:
    """What the local path makes of validation samples ``ids`` with the eval transform."""
    transform = build_transform(EVAL, 32)
    out = []
    for i in ids:
        image = load_image(split, i)
        assert not isinstance(image, Unreadable), image
        out.append(transform(image))
    return torch.stack(out).numpy().tobytes()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return write_folder(tmp_path / "images")


@pytest.fixture
def split_server(folder: Path) -> Iterator[str]:
    """An in-process server (augmenting in threads) with a validation split."""
    source = AugmentingBatchSource(
        folder_spec(folder), eval_recipe=EVAL, workers=1, processes=False
    )
    server, port = create_server(source, port=0)
    yield f"127.0.0.1:{port}"
    server.stop(0).wait()
    source.close()


def test_server_serves_both_splits_and_training_never_a_val_file(
    folder: Path, split_server: str
) -> None:
    train, val = build_splits(folder_spec(folder))
    assert val is not None
    with grpc.insecure_channel(split_server) as ch:
        stub = pb_grpc.DataPlaneStub(ch)
        info = stub.GetInfo(pb.GetInfoRequest(), timeout=5)
        assert (info.num_samples, info.num_val_samples) == (18, 6)
        epoch = list(stub.StreamBatches(pb.StreamBatchesRequest(seed=1, stop=18, batch_size=5)))
        # Without a recipe a val request gets the server's eval transform; seed and epoch
        # change nothing: position i is validation sample i.
        vals = [
            list(stub.StreamBatches(pb.StreamBatchesRequest(seed=s, epoch=e, stop=6, batch_size=4,
                                                            split="val")))
            for s, e in ((0, 0), (9, 3))
        ]  # fmt: skip
    train_ids = [i for b in epoch for i in b.sample_ids]
    assert sorted(train_ids) == list(range(18))
    train_files = files(train, train_ids)
    val_files = files(val, list(range(6)))
    assert not set(train_files) & set(val_files)
    assert len(set(train_files) | set(val_files)) == 24
    for batches in vals:
        assert [list(b.sample_ids) for b in batches] == [[0, 1, 2, 3], [4, 5]]
        assert [i for b in batches for i in b.labels] == [val.label(i) for i in range(6)]
        assert b"".join(b.pixels for b in batches) == eval_pixels(val, list(range(6)))
    assert [b.pixels for b in vals[0]] == [b.pixels for b in vals[1]]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"split": "test"}, "unknown split 'test'"),
        ({"split": "val", "stop": 7}, "stop (7) is beyond the validation set: it has 6 samples"),
        ({"split": "VAL"}, "unknown split 'VAL'"),
    ],
)
def test_bad_val_requests_are_invalid_argument(
    split_server: str, fields: dict[str, Any], message: str
) -> None:
    request: dict[str, Any] = {"stop": 4, "batch_size": 4, **fields}
    with grpc.insecure_channel(split_server) as ch:
        stub = pb_grpc.DataPlaneStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.StreamBatches(pb.StreamBatchesRequest(**request), timeout=10))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert message in str(err.value.details())
        good = pb.StreamBatchesRequest(stop=4, batch_size=4, split="val")
        assert len(list(stub.StreamBatches(good, timeout=10))) == 1


def test_val_request_to_a_server_without_validation_is_refused(channel: grpc.Channel) -> None:
    stub = pb_grpc.DataPlaneStub(channel)
    assert stub.GetInfo(pb.GetInfoRequest(), timeout=5).num_val_samples == 0
    with pytest.raises(grpc.RpcError) as err:
        list(stub.StreamBatches(pb.StreamBatchesRequest(stop=4, batch_size=4, split="val")))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "no validation set" in str(err.value.details())
    assert "job.dataset.val_fraction" in str(err.value.details())


def test_val_client_learns_the_val_size_and_passes_again_after_rewind(
    folder: Path, split_server: str
) -> None:
    _, val = build_splits(folder_spec(folder))
    assert val is not None
    with DataPlaneClient([split_server], batch_size=4) as training:
        assert training.num_samples == 18
    with DataPlaneClient(
        [split_server], batch_size=4, split="val", recipe=encode_recipe(EVAL), share=(1, 6)
    ) as client:
        assert client.num_samples == 6
        first = list(client.iter_epoch(0))
        assert list(client.iter_epoch(0)) == []  # the pass is consumed...
        client.rewind()  # ...until rewound
        second = list(client.iter_epoch(0))
    assert [b.sample_ids.tolist() for b in first] == [[1, 2, 3, 4], [5]]
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a.images, b.images) and torch.equal(a.sample_ids, b.sample_ids)
    assert torch.cat([b.images for b in first]).numpy().tobytes() == eval_pixels(
        val, [1, 2, 3, 4, 5]
    )


def test_val_client_admits_only_servers_with_its_val_set(
    server_address: str, split_server: str
) -> None:
    # The conftest's server has no validation set; the other has 6 samples, not 7.
    plain = DataPlaneClient([server_address], batch_size=4, split="val", wait_for_data_s=1)
    with plain, pytest.raises(DataPlaneUnavailable, match="has no validation set"):
        plain.num_samples  # noqa: B018
    client = DataPlaneClient(
        [split_server], batch_size=4, split="val", num_samples=7, wait_for_data_s=1
    )
    with client, pytest.raises(DataPlaneUnavailable, match="serves 6 validation samples"):
        list(client.iter_epoch(0))
    with pytest.raises(ValueError, match="unknown split 'test'"):
        DataPlaneClient([split_server], batch_size=4, split="test")


def test_hetero_serve_workers_build_the_same_splits(tmp_path: Path, folder: Path) -> None:
    """A real ``hetero serve`` process with a worker process: its training epoch holds no
    validation file, and its validation bytes equal the local eval transform's."""
    spec_path = tmp_path / "spec.toml"
    spec_path.write_text(f"""
name = "val-test"
[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge"]
count = 1
[[groups]]
name = "dataprep"
role = "dataprep"
instance_types = ["c6i.4xlarge"]
count = 1
[job]
batch_size = 4
[job.dataset]
source = "folder"
path = "{folder}"
image_size = 32
val_fraction = 0.25
[job.eval]
crop_pct = 0.9
[job.dataplane]
workers_per_server = 1
""")
    train, val = build_splits(folder_spec(folder))
    assert val is not None
    server = start_server_process(spec_path, workers=1)
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.DataPlaneStub(ch)
            epoch = list(stub.StreamBatches(pb.StreamBatchesRequest(stop=18, batch_size=9)))
            # No recipe: the server's eval transform is the spec's [job.eval].
            raw = list(stub.StreamBatches(pb.StreamBatchesRequest(stop=6, batch_size=6,
                                                                  split="val")))  # fmt: skip
            pb_grpc.DataPlaneStub(ch).Shutdown(pb.ShutdownRequest(grace_s=1), timeout=5)
    finally:
        assert server.stop() == 0
    train_files = files(train, [i for b in epoch for i in b.sample_ids])
    assert len(train_files) == 18 and not set(train_files) & set(files(val, list(range(6))))
    received = decode_batch(raw[0].SerializeToString())
    assert received.batch.sample_ids.tolist() == list(range(6))
    assert received.batch.images.numpy().tobytes() == eval_pixels(val, list(range(6)))
