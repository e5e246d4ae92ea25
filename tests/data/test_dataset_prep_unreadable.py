"""``hetero dataset prep`` and ``verify`` on a dataset as it comes: a file name that is not
UTF-8, a zero-byte ``.jpg``, a truncated PNG, a text file named ``.jpg`` and a decompression bomb
among valid images of every mode the data servers convert (CMYK, RGBA, 16-bit, palette, 1-bit,
1x1), and files that cannot be read at all (a dangling symlink, a symlink loop; in S3 an archived
object, one deleted after the listing). Prep leaves out exactly the bad ones, names each with its
reason (console and manifest), packs every valid one, refuses the lot with ``--strict``, and
still stops, to be resumed, on a read error that is not the file's own; verify flags a sample
that no longer decodes; the same from an S3 source. And a job over the same files unprepared (a
folder, an S3 prefix) names exactly the files prep leaves out, with the same kinds, in its
summary."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws
from PIL import Image

from training.cli import main
from training.data import decode
from training.data.decode import (
    CANNOT_READ,
    CORRUPT,
    EMPTY,
    NOT_AN_IMAGE,
    TOO_MANY_PIXELS,
    decode_image,
    image_problem,
)
from training.data.manifest import Manifest, load_manifest
from training.data.prep import PrepRequest, prep
from training.data.prep_inputs import UnreadableImages, read_problem, shuffle_order
from training.data.tar_format import ShardRecord, ShardWriter

CAFE = b"caf\xe9.png"  # Latin-1, as an archive made elsewhere names it: not UTF-8
NOTES = b"notes\xff.jpg"


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Files:
    valid: dict[bytes, bytes]
    """Every image the data servers decode, by its path (bytes) under the root."""
    bad: dict[bytes, tuple[bytes, str]]
    """Every file they do not, by path: (its bytes, the kind of reason prep gives)."""


@pytest.fixture(scope="module")
def files() -> Files:
    good = encoded(Image.new("RGB", (48, 40), (200, 30, 90)))
    bomb = encoded(Image.new("1", (20_000, 20_000)))  # 400 Mpx declared, a few KB on disk
    assert len(bomb) < 100_000
    valid = {
        b"a/cmyk.jpg": encoded(Image.new("CMYK", (16, 12), (10, 200, 30, 5)), "JPEG"),
        b"a/rgba.png": encoded(Image.new("RGBA", (9, 7), (1, 2, 3, 128))),
        b"a/sixteen.png": encoded(Image.new("I;16", (8, 8), 40_000)),
        b"a/palette.png": encoded(Image.new("P", (10, 10), 3)),
        b"a/one-pixel.png": encoded(Image.new("RGB", (1, 1), (5, 6, 7))),
        b"b/" + CAFE: good,
        b"b/bilevel.png": encoded(Image.new("1", (31, 17), 1)),
        b"c/plain.jpg": encoded(Image.new("RGB", (20, 20), (90, 90, 10)), "JPEG"),
    }
    bad = {
        b"b/empty.jpg": (b"", EMPTY),
        b"b/truncated.png": (good[: len(good) // 2], CORRUPT),
        b"b/" + NOTES: (b"shopping list: eggs, milk\n", NOT_AN_IMAGE),
        b"c/bomb.png": (bomb, TOO_MANY_PIXELS),
    }
    return Files(valid, bad)


def write_folder(root: Path, files: Files) -> Path:
    """The files under ``root``, written through bytes paths (names that are not UTF-8 too)."""
    for rel, data in [*files.valid.items(), *((p, d) for p, (d, _) in files.bad.items())]:
        path = os.fsencode(root) + b"/" + rel
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return root


@pytest.fixture
def src(tmp_path: Path, files: Files) -> Path:
    return write_folder(tmp_path / "src", files)


GONE = b"a/gone.png"
LOOP = b"c/loop.jpg"


def add_unreadable_links(root: Path) -> dict[bytes, str]:
    """Two files under ``root`` that cannot be read, even by root: a symlink to a file that is
    not there, and one to itself; their reason kind by path."""
    os.symlink("missing.png", root / os.fsdecode(GONE))
    os.symlink("loop.jpg", root / os.fsdecode(LOOP))
    return {GONE: CANNOT_READ, LOOP: CANNOT_READ}


def shown(root: Path, rel: bytes) -> str:
    """A path as prep shows it: its absolute path, bytes that are not UTF-8 as ``\\xNN``."""
    return (os.fsencode(root.resolve()) + b"/" + rel).decode("utf-8", "backslashreplace")


KINDS = (EMPTY, NOT_AN_IMAGE, TOO_MANY_PIXELS, CORRUPT, CANNOT_READ)


def kind(reason: str) -> str:
    return next(k for k in KINDS if reason.startswith(k))


def expected_excluded(
    root: Path, files: Files, unreadable: dict[bytes, str] | None = None
) -> list[tuple[str, str]]:
    kinds = {**{rel: k for rel, (_, k) in files.bad.items()}, **(unreadable or {})}
    return sorted((shown(root, rel), k) for rel, k in kinds.items())


def packed(root: Path, manifest: Manifest) -> list[tuple[str, str, str]]:
    """(key, image sha256, class name) of every sample in the train shards, in shard order."""
    found = []
    for shard in manifest.splits["train"].shards:
        with tarfile.open(root / shard.name) as tar:
            members = tar.getmembers()
            for image, cls in zip(members[::2], members[1::2], strict=True):
                data, label = (tar.extractfile(m).read() for m in (image, cls))  # type: ignore[union-attr]
                found.append((image.name, sha(data), manifest.classes[int(label)]))
    return found


def expected_packed(files: Files, unreadable: tuple[bytes, ...] = ()) -> list[tuple[str, str, str]]:
    """The valid images in prep's order: the trainer's listing (classes, then file names, as
    str sorts them) in the seeded shuffle, the bad ones (and ``unreadable``) then taken out;
    keys numbered on."""
    every = {**files.valid, **{p: d for p, (d, _) in files.bad.items()}}
    every.update((p, b"") for p in unreadable)
    listed = sorted(every, key=lambda p: tuple(os.fsdecode(part) for part in p.split(b"/")))
    order = [listed[i] for i in shuffle_order(len(listed), 0)]
    kept = [p for p in order if p in files.valid]
    return [
        (f"{i:08d}.{os.fsdecode(p).rsplit('.', 1)[1]}", sha(every[p]), p.split(b"/")[0].decode())
        for i, p in enumerate(kept)
    ]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_every_mode_the_data_servers_convert_is_readable(files: Files) -> None:
    for path, data in files.valid.items():
        assert image_problem(data) is None, path
        assert decode_image(data).mode == "RGB"
    for path, (data, want) in files.bad.items():
        problem = image_problem(data)
        assert problem is not None and kind(problem) == want, (path, problem)


def test_the_bomb_limit_is_ours_whatever_pils_global_says(
    files: Files, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The data servers and prep apply ``decode.MAX_PIXELS`` even when PIL's own check is off."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    bomb = files.bad[b"c/bomb.png"][0]
    with pytest.raises(Image.DecompressionBombError, match="400000000 pixels"):
        decode_image(bomb)
    assert image_problem(bomb) == (
        f"{TOO_MANY_PIXELS}: 20000x20000 is 400000000 pixels, more than the "
        f"{decode.MAX_PIXELS} a data server decodes"
    )


def test_prep_leaves_out_each_unreadable_image_and_names_it(
    src: Path, files: Files, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    rc, stdout, stderr = run_cli(capsys, "dataset", "prep", "--src", str(src), "--out", str(out))
    assert (rc, stderr) == (0, "")
    manifest, _, digest = load_manifest(str(out))
    assert [(e.path, kind(e.reason)) for e in manifest.excluded] == expected_excluded(src, files)
    assert packed(out, manifest) == expected_packed(files)
    assert len(manifest.splits["train"]) == len(files.valid) == 8
    listing = "".join(f"    {e.path}: {e.reason}\n" for e in manifest.excluded)
    assert stdout == (
        f"wrote {out}/manifest.json\n"
        "  train: 8 samples in 1 shards\n"
        "  classes: 3\n"
        "  left out 4 image(s) that cannot be read or decoded (the manifest's excluded):\n"
        f"{listing}"
        f"manifest sha256 {digest}\n"
        "pin it under [job.dataset]:\n"
        f'  manifest_sha256 = "{digest}"\n'
    )
    # The name that is not UTF-8 is shown escaped, in the console and in the manifest.
    assert f"{src.resolve()}/b/notes\\xff.jpg: {NOT_AN_IMAGE}: " in stdout
    raw = json.loads((out / "manifest.json").read_bytes())
    paths = [e["path"] for e in raw["excluded"]]
    assert f"{src.resolve()}/b/notes\\xff.jpg" in paths
    # Same input, same bytes.
    again = tmp_path / "again"
    assert run_cli(capsys, "dataset", "prep", "--src", str(src), "--out", str(again))[0] == 0
    for name in sorted(p.name for p in out.iterdir()):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name
    assert run_cli(capsys, "dataset", "verify", str(out))[0] == 0


def test_strict_refuses_the_dataset_listing_every_bad_file(
    src: Path, files: Files, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["dataset", "prep", "--src", str(src), "--out", str(out), "--strict"]
    rc, stdout, stderr = run_cli(capsys, *argv, "--shard-mb", "0.000001")  # a shard per image
    assert (rc, stdout) == (2, "")
    head, *lines = stderr.splitlines()
    assert head == (
        "hetero dataset prep: --strict: 4 image(s) cannot be read or decoded, so nothing is "
        "prepared (the shards this run wrote are removed); fix or remove them, or leave out "
        "--strict to prepare the dataset without them:"
    )
    assert sorted((line.split(": ", 1)[0], kind(line.split(": ", 1)[1])) for line in lines) == [
        (f"  {path}", k) for path, k in expected_excluded(src, files)
    ]
    assert list(out.iterdir()) == []  # no shard, no state, no manifest


def test_a_file_that_cannot_be_read_is_left_out_like_one_that_does_not_decode(
    src: Path, files: Files, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dangling symlink and a symlink loop: listed, left out with ``cannot read it``, the
    rest packed; ``--strict`` refuses them with the others (not "rerun to resume": a rerun
    meets them again)."""
    links = add_unreadable_links(src)
    out = tmp_path / "out"
    rc, stdout, stderr = run_cli(capsys, "dataset", "prep", "--src", str(src), "--out", str(out))
    assert (rc, stderr) == (0, "")
    manifest, _, _ = load_manifest(str(out))
    assert [(e.path, kind(e.reason)) for e in manifest.excluded] == expected_excluded(
        src, files, links
    )
    assert packed(out, manifest) == expected_packed(files, tuple(links))
    reasons = {e.path: e.reason for e in manifest.excluded}
    assert reasons[shown(src, GONE)] == (
        f"{CANNOT_READ}: No such file or directory (a symbolic link to missing.png, which is "
        "not there)"
    )
    assert reasons[shown(src, LOOP)] == f"{CANNOT_READ}: Too many levels of symbolic links"
    assert "  left out 6 image(s) that cannot be read or decoded" in stdout
    assert f"    {shown(src, GONE)}: {CANNOT_READ}: No such file" in stdout

    strict = tmp_path / "strict"
    argv = ["dataset", "prep", "--src", str(src), "--out", str(strict), "--strict"]
    rc, stdout, stderr = run_cli(capsys, *argv)
    assert (rc, stdout) == (2, "")
    assert stderr.startswith("hetero dataset prep: --strict: 6 image(s) cannot be read or ")
    assert f"\n  {shown(src, LOOP)}: {CANNOT_READ}: " in stderr
    assert list(strict.iterdir()) == []


def s3_error(code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code}}, "GetObject")


@pytest.mark.parametrize(
    ("error", "unreadable"),
    [
        (s3_error("AccessDenied"), True),
        (s3_error("NoSuchKey"), True),
        (s3_error("InvalidObjectState"), True),  # archived (Glacier), not restored
        (s3_error("SlowDown"), False),
        (s3_error("InternalError"), False),
        (s3_error("RequestTimeout"), False),
        (PermissionError(13, "Permission denied"), True),
        (FileNotFoundError(2, "No such file or directory"), True),
        (OSError(24, "Too many open files"), False),
        (OSError(5, "Input/output error"), False),
        (ConnectionResetError(104, "Connection reset by peer"), False),
        (RuntimeError("a bug"), False),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else str(v),
)
def test_only_a_files_own_lasting_error_makes_it_unreadable(
    error: Exception, unreadable: bool
) -> None:
    problem = read_problem("/nowhere/a/x.png", error)
    assert (problem is not None) is unreadable
    assert problem is None or problem.startswith(f"{CANNOT_READ}: ")


def test_a_read_error_that_is_not_the_files_own_still_stops_to_be_resumed(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Too many open files is this machine's state, not the file's: prep stops (exit 1) and a
    rerun resumes, rather than leaving a good image out of the dataset for good."""
    real = Path.read_bytes

    def read_bytes(path: Path) -> bytes:
        if path.name == "plain.jpg":
            raise OSError(24, "Too many open files")
        return real(path)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    out = tmp_path / "out"
    rc, stdout, stderr = run_cli(capsys, "dataset", "prep", "--src", str(src), "--out", str(out))
    assert (rc, stdout) == (1, "")
    assert stderr == (
        "hetero dataset prep: [Errno 24] Too many open files; the finished shards are kept: "
        "rerun the same command to resume\n"
    )
    monkeypatch.undo()
    assert run_cli(capsys, "dataset", "prep", "--src", str(src), "--out", str(out))[0] == 0
    assert len(load_manifest(str(out))[0].splits["train"]) == 8


def test_a_resume_after_left_out_images_gives_the_same_bytes(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state records the images each shard left out, so a resume starts where it stopped."""
    request = PrepRequest(src=str(src), out=str(tmp_path / "out"), shard_bytes=1)
    real_close, calls = ShardWriter.close, []

    def close(writer: ShardWriter) -> ShardRecord:
        calls.append(writer.name)
        if len(calls) == 5:
            raise RuntimeError("interrupted")
        return real_close(writer)

    monkeypatch.setattr(ShardWriter, "close", close)
    with pytest.raises(RuntimeError):
        prep(request)
    monkeypatch.undo()
    state = json.loads((tmp_path / "out" / "prep-state.json").read_bytes())
    assert len(state["shards"]) == 4 and any("excluded" in s for s in state["shards"])
    # --strict now: the kept shards left images out, so the dataset is refused, nothing written.
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    with pytest.raises(UnreadableImages) as e:
        prep(replace(request, strict=True))
    assert len(e.value.images) == 4
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    resumed = prep(request)
    assert len(resumed.kept) == 4
    fresh = prep(PrepRequest(src=str(src), out=str(tmp_path / "fresh"), shard_bytes=1))
    assert resumed.sha256 == fresh.sha256 and len(resumed.manifest.excluded) == 4


def test_a_class_folder_name_that_is_not_utf8_is_refused_before_any_work(
    tmp_path: Path, files: Files, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    image = files.valid[b"b/" + CAFE]
    write_folder(src, Files({b"a/x.png": image, b"f\xe9tes/y.png": image}, {}))
    out = tmp_path / "out"
    rc, stdout, stderr = run_cli(capsys, "dataset", "prep", "--src", str(src), "--out", str(out))
    assert (rc, stdout) == (2, "")
    assert stderr == (
        f"hetero dataset prep: --src: the names of class folder(s) {src}/f\\xe9tes are not UTF-8, "
        "and class names are kept as text (the manifest's classes, the model's labels); rename "
        f"them in UTF-8 (e.g. `convmv -f <their encoding> -t utf8 --notest -r {src}`)\n"
    )
    assert not out.exists()


def test_a_split_with_no_readable_image_is_refused(src: Path, files: Files, tmp_path: Path) -> None:
    bad = {b"c/z.png": (b"", EMPTY), b"a/e.jpg": (b"", EMPTY), b"b/t.jpg": (b"x", NOT_AN_IMAGE)}
    val = write_folder(tmp_path / "val", Files({}, bad))
    with pytest.raises(UnreadableImages) as e:
        prep(PrepRequest(src=str(src), val_src=str(val), out=str(tmp_path / "out")))
    assert str(e.value).startswith("no image of the val split reads and decodes:\n")
    assert [i.path for i in e.value.images] == [shown(val, p) for p in sorted(bad)]


def test_verify_flags_a_sample_that_no_longer_decodes(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    prep(PrepRequest(src=str(src), out=str(out)))
    manifest, _, _ = load_manifest(str(out))
    train = manifest.splits["train"]
    shard = out / train.shards[0].name
    data = bytearray(shard.read_bytes())
    data[train.offset[2] : train.offset[2] + train.size[2]] = bytes(train.size[2])  # zeros
    shard.write_bytes(bytes(data))
    # The manifest is made to agree with the shard's new bytes: only the decode can tell.
    value = json.loads((out / "manifest.json").read_bytes())
    value["splits"]["train"]["shards"][0]["sha256"] = sha(bytes(data))
    (out / "manifest.json").write_text(json.dumps(value))
    rc, stdout, _ = run_cli(capsys, "dataset", "verify", str(out))
    key = packed(out, manifest)[2][0]
    assert (rc, stdout) == (
        1,
        f"{out}/manifest.json: 1 problem(s)\n"
        f"  train/{shard.name}: sample 2: {key} does not decode ({NOT_AN_IMAGE}: no image "
        "format recognises its bytes)\n",
    )


# --- S3 ----------------------------------------------------------------------------------------


def upload(s3: object, files: Files, prefix: str) -> list[tuple[str, str]]:
    """The files (S3 keys are UTF-8: the Latin-1 names spelt in UTF-8) under ``prefix``; the
    bad ones' (URI, reason kind), sorted."""
    put: Callable[..., object] = s3.put_object  # type: ignore[attr-defined]
    bad = []
    for rel, data in files.valid.items():
        put(Bucket="images", Key=prefix + rel.decode("latin-1"), Body=data)
    for rel, (data, k) in files.bad.items():
        key = prefix + rel.decode("latin-1")
        put(Bucket="images", Key=key, Body=data)
        bad.append((f"s3://images/{key}", k))
    return sorted(bad)


@mock_aws
def test_prep_from_s3_leaves_out_the_same_files(files: Files, tmp_path: Path) -> None:
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="images")
    bad = upload(s3, files, "raw/")
    result = prep(PrepRequest(src="s3://images/raw/", out="s3://images/prepared/"), client=s3)
    assert [(e.path, kind(e.reason)) for e in result.manifest.excluded] == bad
    index = result.manifest.splits["train"]
    assert len(index) == len(files.valid)
    body = s3.get_object(Bucket="images", Key="prepared/train-000000.tar")["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body)) as shard:
        images = [m for m in shard.getmembers() if not m.name.endswith(".cls")]
        found = sorted(sha(shard.extractfile(m).read()) for m in images)  # type: ignore[union-attr]
    assert found == sorted(sha(d) for d in files.valid.values())
    assert [m.name.split(".")[0] for m in images] == [f"{i:08d}" for i in range(len(index))]
    # A folder of the same names (in UTF-8) gives the same shards.
    utf8 = Files(
        {p.decode("latin-1").encode(): d for p, d in files.valid.items()},
        {p.decode("latin-1").encode(): v for p, v in files.bad.items()},
    )
    local = prep(PrepRequest(src=str(write_folder(tmp_path / "src", utf8)), out=str(tmp_path)))
    assert local.manifest.splits["train"].to_json() == index.to_json()
    assert body == (tmp_path / "train-000000.tar").read_bytes()

    with pytest.raises(UnreadableImages) as e:
        strict = PrepRequest(src="s3://images/raw/", out="s3://images/strict/", strict=True)
        prep(strict, client=s3)
    assert sorted((i.path, kind(i.reason)) for i in e.value.images) == bad
    assert s3.list_objects_v2(Bucket="images", Prefix="strict/").get("KeyCount") == 0


ARCHIVED_KEY, DELETED_KEY = "raw/a/archived.jpg", "raw/c/deleted.jpg"
ARCHIVED, DELETED = f"s3://images/{ARCHIVED_KEY}", f"s3://images/{DELETED_KEY}"


def put_unreadable_objects(s3: Any, image: bytes) -> dict[str, str]:
    """An object archived to Glacier (GetObject: InvalidObjectState until it is restored) and
    one that ``DeletesOnRead`` takes away after the listing; their reason kind by URI."""
    s3.put_object(Bucket="images", Key=ARCHIVED_KEY, Body=image, StorageClass="GLACIER")
    s3.put_object(Bucket="images", Key=DELETED_KEY, Body=image)
    return {ARCHIVED: CANNOT_READ, DELETED: CANNOT_READ}


class DeletesOnRead:
    """moto's S3 client, but ``DELETED`` is deleted just before it is read (someone removed it
    while prep ran: GetObject answers NoSuchKey), and a read of ``fails`` is throttled."""

    def __init__(self, client: Any, fails: str = "") -> None:
        self._client, self.fails = client, fails

    def get_object(self, **kw: Any) -> Any:
        uri = f"s3://{kw['Bucket']}/{kw['Key']}"
        if uri == DELETED:
            self._client.delete_object(**kw)
        if uri == self.fails:
            raise ClientError({"Error": {"Code": "SlowDown", "Message": "Slow down"}}, "GetObject")
        return self._client.get_object(**kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@mock_aws
def test_an_s3_object_that_cannot_be_read_is_left_out(files: Files) -> None:
    """Archived, or deleted after the listing: left out with ``cannot read it`` and S3's error;
    a throttled read still stops the prep (a rerun resumes it)."""
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="images")
    bad = upload(s3, files, "raw/")
    unreadable = put_unreadable_objects(s3, files.valid[b"c/plain.jpg"])
    request = PrepRequest(src="s3://images/raw/", out="s3://images/prepared/")
    result = prep(request, client=DeletesOnRead(s3))
    excluded = result.manifest.excluded
    assert [(e.path, kind(e.reason)) for e in excluded] == sorted([*bad, *unreadable.items()])
    reasons = {e.path: e.reason for e in excluded}
    assert reasons[ARCHIVED] == (
        f"{CANNOT_READ}: An error occurred (InvalidObjectState) when calling the GetObject "
        "operation: The operation is not valid for the object's storage class"
    )
    assert reasons[DELETED].startswith(f"{CANNOT_READ}: An error occurred (NoSuchKey) ")
    assert len(result.manifest.splits["train"]) == len(files.valid)

    throttled = DeletesOnRead(s3, fails="s3://images/raw/c/plain.jpg")
    with pytest.raises(ClientError, match="SlowDown"):
        prep(replace(request, out="s3://images/throttled/"), client=throttled)


# ---- a job over the same files, unprepared --------------------------------------------------

JOB_SPEC = """
name = "bad-files-job"
[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge"]
count = 1
[job]
batch_size = 4
epochs = 1
precision = "fp32"
[job.model]
name = "vit-cpu-tiny"
[job.dataset]
source = "{source}"
path = "{path}"
num_classes = 3
image_size = 32
max_unreadable = 0.5
[job.checkpoint]
interval_steps = 100
dir = "{checkpoints}"
"""


def job_unreadable(tmp_path: Path, source: str, path: str) -> list[tuple[str, str]]:
    """One epoch of the trainer over ``path`` (its local loader, in this process); the
    summary's unreadable samples as (name, reason kind), sorted."""
    from training.spec import load_spec
    from training.trainer.config import TrainerConfig
    from training.trainer.train import Trainer

    tmp_path.mkdir(parents=True, exist_ok=True)
    spec = tmp_path / "job.toml"
    spec.write_text(JOB_SPEC.format(source=source, path=path, checkpoints=tmp_path / "ckpt"))
    config = TrainerConfig.from_spec(load_spec(spec), run_dir=tmp_path / "run", environ={})
    trainer = Trainer(config)
    try:
        assert trainer.train() == 0
    finally:
        trainer.close()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    found = summary["unreadable"]["samples"]
    assert summary["unreadable"]["count"] == len(found)
    return sorted((u["name"], job_kind(u["reason"])) for u in found)


def job_kind(reason: str) -> str:
    """The kind of a data path's reason: ``not a readable image: <prep's kind>: ...`` for a file
    that does not decode, ``cannot read it: ...`` for one that cannot be read."""
    decoded = "not a readable image: "
    if reason.startswith(decoded):
        return kind(reason[len(decoded) :])
    assert reason.startswith(f"{CANNOT_READ}: "), reason
    return CANNOT_READ


def test_a_job_over_the_unprepared_folder_names_the_files_prep_leaves_out(
    files: Files, src: Path, tmp_path: Path
) -> None:
    """The same 6 bad files (4 that do not decode, 2 links that cannot be read) by the same
    names and kinds as prep's ``excluded``; the 8 valid ones of every mode (CMYK, RGBA, 16-bit,
    palette, 1-bit, 1x1) trained on without a word."""
    links = add_unreadable_links(src)
    result = prep(PrepRequest(src=str(src), out=str(tmp_path / "prepared")))
    excluded = [(e.path, kind(e.reason)) for e in result.manifest.excluded]
    assert excluded == expected_excluded(src, files, links)
    assert job_unreadable(tmp_path / "job", "folder", str(src)) == excluded


@mock_aws
def test_a_job_over_the_unprepared_s3_prefix_names_the_same_files(
    files: Files, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From an S3 source: each bad object by its ``s3://`` URI, with prep's kinds, the
    archived one too."""
    monkeypatch.setenv("HETERO_LOADER_WORKERS", "0")  # load in this process, inside moto's mock
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="images")
    bad = upload(s3, files, "raw/")
    s3.put_object(
        Bucket="images", Key=ARCHIVED_KEY, Body=files.valid[b"c/plain.jpg"], StorageClass="GLACIER"
    )
    result = prep(PrepRequest(src="s3://images/raw/", out="s3://images/prepared/"), client=s3)
    excluded = [(e.path, kind(e.reason)) for e in result.manifest.excluded]
    assert excluded == sorted([*bad, (ARCHIVED, CANNOT_READ)])
    assert job_unreadable(tmp_path, "s3", "s3://images/raw/") == excluded
