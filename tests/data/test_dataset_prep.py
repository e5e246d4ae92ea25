"""``hetero dataset prep`` and ``verify`` on real images (scikit-learn's scanned digits as PNG
ImageFolders): every image lands once with its label, the split is the trainer's, the shards are
WebDataset tars, the output is byte-identical run to run, an interrupted prep resumes to the same
bytes, verify catches each kind of damage, and S3 in and out gives the same shards."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import IO, TypeVar

import aws_calls
import boto3
import pytest
from moto import mock_aws
from realdata import DigitsFolders, write_digits

from training.cli import main
from training.common import call_log
from training.data import prep as prep_module
from training.data.datasets import FolderImages
from training.data.manifest import Manifest, ManifestError, load_manifest
from training.data.prep import PrepRequest, prep
from training.data.prep_inputs import PrepError, read_ordered, shuffle_order
from training.data.prep_output import LocalOutput
from training.data.splits import SubsetImages, split_indices
from training.data.tar_format import ShardRecord, ShardWriter
from training.data.verify import verify

SHARD = 512 * 1024  # small shards: the 1,437 training digits take 9, the 360 validation ones 3
CLASSES = [str(i) for i in range(10)]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> DigitsFolders:
    return write_digits(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="module")
def prepared(digits: DigitsFolders, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted prep with --val-src, the reference the other tests compare with."""
    out = tmp_path_factory.mktemp("prepared")
    prep(PrepRequest(src=str(digits.train_dir), val_src=str(digits.val_dir), out=str(out),
                     shard_bytes=SHARD))  # fmt: skip
    return out


T = TypeVar("T")


def source_images(root: Path, shuffle_seed: int | None = 0) -> list[tuple[str, str]]:
    """(sha256, class name) of every image under ``root``, in class order then file order
    (sorted names, as ImageFolder lists them), then in the seeded order prep promises."""
    listed = [
        (sha(path.read_bytes()), cls.name)
        for cls in sorted(root.iterdir())
        for path in sorted(cls.iterdir(), key=lambda p: p.name)
    ]
    return shuffled(listed, shuffle_seed)


def shuffled(items: list[T], seed: int | None) -> list[T]:
    """``items`` in prep's seeded order (``prep_inputs.shuffle_order``; None: as they are)."""
    return items if seed is None else [items[i] for i in shuffle_order(len(items), seed)]


def tar_samples(shard: Path) -> Iterator[tuple[str, dict[str, bytes]]]:
    """A shard read the way WebDataset reads one: members grouped by key (the name up to its
    first dot), in order."""
    with tarfile.open(shard) as tar:
        key, sample = None, {}
        for m in tar:
            k, _, ext = m.name.partition(".")
            if k != key and key is not None:
                yield key, sample
                sample = {}
            key = k
            f = tar.extractfile(m)
            assert f is not None
            sample[ext] = f.read()
        if key is not None:
            yield key, sample


def split_images(root: Path, manifest: Manifest, split: str) -> list[tuple[str, str]]:
    """(sha256, class name) of the split's samples, read from its shards by key; asserts the keys
    are its split indices 0..n-1 in shard order and that each sample is one image plus .cls."""
    found, expected_key = [], 0
    for shard in manifest.splits[split].shards:
        for key, sample in tar_samples(root / shard.name):
            assert key == f"{expected_key:08d}"
            assert sorted(sample) == ["cls", "png"]
            found.append((sha(sample["png"]), manifest.classes[int(sample["cls"].decode())]))
            expected_key += 1
    return found


def test_prep_lands_every_image_once_with_its_label(
    digits: DigitsFolders, prepared: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest, uri, digest = load_manifest(str(prepared))
    assert manifest.classes == tuple(CLASSES)
    assert manifest.source == str(digits.train_dir.resolve())
    assert manifest.split == {"shuffle_seed": 0, "val_path": str(digits.val_dir.resolve())}
    assert split_images(prepared, manifest, "train") == source_images(digits.train_dir)
    assert split_images(prepared, manifest, "val") == source_images(digits.val_dir)
    for split, count in (("train", 1437), ("val", 360)):
        index = manifest.splits[split]
        assert len(index) == count
        assert [s.name for s in index.shards] == [
            f"{split}-{i:06d}.tar" for i in range(len(index.shards))
        ]
        assert len(index.shards) >= 3
        for shard in index.shards:
            data = (prepared / shard.name).read_bytes()
            assert len(data) == shard.bytes <= SHARD and sha(data) == shard.sha256
            # The manifest's byte range of each sample is exactly its image in the tar.
            samples = dict(tar_samples(prepared / shard.name))
            for i in range(shard.first, shard.first + shard.count):
                image = data[index.offset[i] : index.offset[i] + index.size[i]]
                assert image == samples[f"{i:08d}"]["png"]
                assert int(samples[f"{i:08d}"]["cls"]) == index.label[i]
    # The tar headers are fixed: no time, owner or permissions of the machine that wrote them.
    with tarfile.open(prepared / "train-000000.tar") as tar:
        infos = {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in tar}
    assert infos == {(0, 0, 0, "", "", 0o644)}

    assert main(["dataset", "verify", str(prepared)]) == 0
    assert capsys.readouterr().out == (
        f"{uri}: ok (sizes, sha256s, sample offsets and image decodes checked)\n"
        f"  train: 1437 samples in {len(manifest.splits['train'].shards)} shards\n"
        f"  val: 360 samples in {len(manifest.splits['val'].shards)} shards\n"
        f"manifest sha256 {digest}\n"
        "pin it under [job.dataset]:\n"
        f'  manifest_sha256 = "{digest}"\n'
    )


def test_prep_is_byte_identical_run_to_run(
    digits: DigitsFolders, prepared: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "again"
    argv = ["dataset", "prep", "--src", str(digits.train_dir), "--val-src", str(digits.val_dir)]
    assert main([*argv, "--out", str(out), "--shard-mb", "0.5"]) == 0
    names = sorted(p.name for p in prepared.iterdir())
    assert sorted(p.name for p in out.iterdir()) == names
    for name in names:
        assert (out / name).read_bytes() == (prepared / name).read_bytes(), name
    manifest, _, digest = load_manifest(str(out))
    train, val = len(manifest.splits["train"].shards), len(manifest.splits["val"].shards)
    summary = (
        f"  train: 1437 samples in {train} shards\n"
        f"  val: 360 samples in {val} shards\n"
        "  classes: 10\n"
        f"manifest sha256 {digest}\n"
        "pin it under [job.dataset]:\n"
        f'  manifest_sha256 = "{digest}"\n'
    )
    assert capsys.readouterr().out == f"wrote {out}/manifest.json\n" + summary
    # Run again: every shard is kept, nothing is written, the same manifest.
    assert main([*argv, "--out", str(out), "--shard-mb", "0.5"]) == 0
    assert capsys.readouterr().out == (
        f"wrote {out}/manifest.json\n"
        f"  kept {train + val} finished shards of an earlier run, wrote 0\n" + summary
    )


def test_val_fraction_is_the_trainers_split(digits: DigitsFolders, tmp_path: Path) -> None:
    out = tmp_path / "fraction"
    prep(PrepRequest(src=str(digits.train_dir), out=str(out), val_fraction=0.2, split_seed=7,
                     shard_bytes=SHARD))  # fmt: skip
    manifest, _, _ = load_manifest(str(out))
    assert manifest.split == {"shuffle_seed": 0, "val_fraction": 0.2, "split_seed": 7}
    # The trainer's split of the same folder for the same fraction and seed.
    whole = FolderImages(digits.train_dir)
    train_idx, val_idx = split_indices(len(whole), 0.2, 7)
    for split, idx in (("train", train_idx), ("val", val_idx)):
        subset = SubsetImages(whole, idx)
        expected = [
            (sha(subset.read(i)), whole.classes[subset.label(i)]) for i in range(len(subset))
        ]
        assert split_images(out, manifest, split) == shuffled(expected, 0)
    assert (len(manifest.splits["train"]), len(manifest.splits["val"])) == (1150, 287)
    assert verify(str(out)).problems == []


def test_train_only_prep_has_no_val_split(digits: DigitsFolders, tmp_path: Path) -> None:
    result = prep(PrepRequest(src=str(digits.val_dir), out=str(tmp_path), shard_bytes=SHARD))
    assert list(result.manifest.splits) == ["train"]
    assert result.manifest.split == {"shuffle_seed": 0}
    assert split_images(tmp_path, result.manifest, "train") == source_images(digits.val_dir)


def test_the_shuffle_spreads_the_classes_over_the_shards_and_can_be_turned_off(
    digits: DigitsFolders, tmp_path: Path
) -> None:
    """The shard-aware epoch order mixes a few shards at a time: each shard must hold a random
    sample of the classes, not one or two of them."""
    mixed = prep(PrepRequest(src=str(digits.train_dir), out=str(tmp_path / "a"), shard_bytes=SHARD))
    index = mixed.manifest.splits["train"]
    for shard in index.shards:
        labels = index.label[shard.first : shard.first + shard.count]
        assert len(set(labels)) == len(CLASSES), f"{shard.name}: classes {sorted(set(labels))}"
    other = prep(PrepRequest(src=str(digits.train_dir), out=str(tmp_path / "b"),
                             shard_bytes=SHARD, shuffle_seed=1))  # fmt: skip
    assert other.manifest.splits["train"].label != index.label
    listed = prep(PrepRequest(src=str(digits.train_dir), out=str(tmp_path / "c"),
                              shard_bytes=SHARD, shuffle_seed=None))  # fmt: skip
    assert list(listed.manifest.splits["train"].label) == sorted(index.label)
    assert split_images(tmp_path / "c", listed.manifest, "train") == source_images(
        digits.train_dir, None
    )


def test_an_image_bigger_than_a_shard_gets_one_to_itself(
    digits: DigitsFolders, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    for cls in ("a", "b"):
        (src / cls).mkdir(parents=True)
        for i, path in enumerate(sorted((digits.val_dir / "1").iterdir())[:2]):
            # Extensions are kept, lower-cased: WebDataset's decoders match them by name.
            shutil.copy(path, src / cls / f"{i}.{'PNG' if cls == 'b' else 'png'}")
    result = prep(PrepRequest(src=str(src), out=str(tmp_path / "out"), shard_bytes=1))
    index = result.manifest.splits["train"]
    assert [(s.name, s.first, s.count) for s in index.shards] == [
        (f"train-00000{i}.tar", i, 1) for i in range(4)
    ]
    with tarfile.open(tmp_path / "out" / "train-000003.tar") as tar:
        assert tar.getnames() == ["00000003.png", "00000003.cls"]
    assert sorted(index.label) == [0, 0, 1, 1]


def test_val_src_needs_the_same_class_names(
    digits: DigitsFolders, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    val = tmp_path / "val"
    shutil.copytree(digits.val_dir, val)
    (val / "3").rename(val / "three")
    argv = ["dataset", "prep", "--src", str(digits.train_dir), "--val-src", str(val)]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == (
        f"hetero dataset prep: --val-src {str(val)!r} must have the same class names as --src "
        f"{str(digits.train_dir)!r}; missing there: ['3']; only there: ['three']\n"
    )


def test_an_io_error_exits_1_and_says_to_rerun(
    digits: DigitsFolders,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def disk_full(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(ShardWriter, "add", disk_full)
    assert main(["dataset", "prep", "--src", str(digits.val_dir), "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (
        "hetero dataset prep: disk full; the finished shards are kept: rerun the same command "
        "to resume\n"
    )
    # Not on a terminal (as here), no progress bar is drawn.
    assert prep_module._progress(1).disable


def test_webdataset_reads_the_shards(prepared: Path) -> None:
    wds = pytest.importorskip("webdataset")  # not a dependency: checked only where installed
    manifest, _, _ = load_manifest(str(prepared))
    urls = [str(prepared / s.name) for s in manifest.splits["val"].shards]
    samples = list(wds.WebDataset(urls, shardshuffle=False))
    assert [s["__key__"] for s in samples] == [f"{i:08d}" for i in range(360)]
    assert [int(s["cls"]) for s in samples] == list(manifest.splits["val"].label)


def test_images_are_read_concurrently_in_order_with_a_bound() -> None:
    in_flight, most, lock = 0, 0, threading.Lock()

    def slow_read(location: str) -> bytes:
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        time.sleep(0.01)  # a GetObject's latency
        with lock:
            in_flight -= 1
        return location.encode()

    locations = [str(i) for i in range(200)]
    with ThreadPoolExecutor(8) as pool:
        started = time.monotonic()
        got = list(read_ordered(slow_read, locations, pool, window=16))
        elapsed = time.monotonic() - started
    assert got == [loc.encode() for loc in locations]
    assert most == 8  # every thread busy, never more than the pool
    assert elapsed < 200 * 0.01 / 3  # sequential reads would take 2 s


def test_a_shard_is_committed_while_the_next_is_written(
    digits: DigitsFolders, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real_open, real_commit = LocalOutput.open_shard, LocalOutput.commit

    def open_shard(self: LocalOutput, name: str) -> IO[bytes]:
        events.append(f"open {name}")
        return real_open(self, name)

    def slow_commit(self: LocalOutput, f: IO[bytes], record: ShardRecord) -> ShardRecord:
        time.sleep(0.2)  # an upload
        events.append(f"committed {record.name}")
        return real_commit(self, f, record)

    monkeypatch.setattr(LocalOutput, "open_shard", open_shard)
    monkeypatch.setattr(LocalOutput, "commit", slow_commit)
    prep(PrepRequest(src=str(digits.val_dir), out=str(tmp_path), shard_bytes=SHARD))
    # The next shard is written during the commit, and never more than one commit waits.
    assert events == [
        "open train-000000.tar",
        "open train-000001.tar",
        "committed train-000000.tar",
        "open train-000002.tar",
        "committed train-000001.tar",
        "committed train-000002.tar",
    ]


# --- verify ----------------------------------------------------------------------------------


@pytest.fixture
def damaged(prepared: Path, tmp_path: Path) -> Path:
    out = tmp_path / "damaged"
    shutil.copytree(prepared, out)
    return out


def run_verify(path: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str]:
    rc = main(["dataset", "verify", str(path), *flags])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def test_verify_catches_a_flipped_byte(damaged: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest, uri, _ = load_manifest(str(damaged))
    shard = damaged / "train-000001.tar"
    data = bytearray(shard.read_bytes())
    first = manifest.splits["train"].shards[1].first
    data[manifest.splits["train"].offset[first + 4] + 100] ^= 0x01  # inside an image
    shard.write_bytes(bytes(data))
    rc, out = run_verify(damaged, capsys)
    # The image's PNG checksum no longer matches either: it does not decode.
    assert (rc, out) == (
        1,
        f"{uri}: 2 problem(s)\n  train/train-000001.tar: sha256 {sha(bytes(data))}, the "
        f"manifest says {manifest.splits['train'].shards[1].sha256}\n"
        f"  train/train-000001.tar: sample {first + 4}: {first + 4:08d}.png does not decode "
        "(corrupt or truncated: broken PNG file (bad header checksum in b'IDAT'))\n",
    )
    # --quick checks sizes only: a flipped byte passes it.
    assert run_verify(damaged, capsys, "--quick")[0] == 0


def test_verify_catches_a_truncated_or_missing_shard(
    damaged: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest, uri, _ = load_manifest(str(damaged))
    val1 = manifest.splits["val"].shards[1]
    with open(damaged / val1.name, "r+b") as f:
        f.truncate(val1.bytes - 10240)
    (damaged / "train-000002.tar").unlink()
    expected = (
        f"{uri}: 2 problem(s)\n"
        "  train/train-000002.tar: missing\n"
        f"  val/{val1.name}: {val1.bytes - 10240} bytes, the manifest says {val1.bytes}\n"
    )
    assert run_verify(damaged, capsys) == (1, expected)
    assert run_verify(damaged, capsys, "--quick") == (1, expected)


def edit_manifest(root: Path, edit: dict[str, object]) -> str:
    path = root / "manifest.json"
    value = json.loads(path.read_bytes())
    for where, new in edit.items():
        split, field, i = where.split(".")
        value["splits"][split][field][int(i)] = new
    path.write_text(json.dumps(value))
    return str(path)


def test_verify_catches_an_edited_offset_or_label(
    damaged: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest, _, _ = load_manifest(str(damaged))
    train = manifest.splits["train"]
    offset, size, label = train.offset[3], train.size[3], train.label[7]
    wrong = (label + 1) % len(CLASSES)
    uri = edit_manifest(damaged, {"train.offset.3": offset + 512, "train.label.7": wrong})
    rc, out = run_verify(damaged, capsys)
    assert (rc, out) == (
        1,
        f"{uri}: 2 problem(s)\n"
        f"  train/train-000000.tar: sample 3: the manifest's offset {offset + 512}, size {size} "
        f"is not its image 00000003.png (offset {offset}, size {size})\n"
        f"  train/train-000000.tar: sample 7: 00000007.cls holds b'{label}', the manifest's "
        f"label is {wrong}\n",
    )


def test_verify_lists_the_first_20_problems_and_a_count(
    damaged: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest, _, _ = load_manifest(str(damaged))
    val = manifest.splits["val"]
    edit_manifest(damaged, {f"val.size.{i}": val.size[i] + 1 for i in range(25)})
    rc, out = run_verify(damaged, capsys)
    lines = out.splitlines()
    assert rc == 1 and lines[0].endswith(": 25 problem(s)") and len(lines) == 22
    assert lines[1].startswith("  val/val-000000.tar: sample 0: the manifest's offset")
    assert lines[-1] == "  ... and 5 more"


def test_verify_exits_2_on_a_manifest_that_is_not_json(
    damaged: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (damaged / "manifest.json").write_bytes(b"{not json")
    rc, out = run_verify(damaged, capsys)
    assert rc == 2
    assert out.startswith(f"hetero dataset verify: {damaged}/manifest.json is not JSON (")
    assert out.endswith("; prepare the dataset again with `hetero dataset prep`\n")


def test_verify_catches_a_shard_of_other_samples(damaged: Path) -> None:
    value = json.loads((damaged / "manifest.json").read_bytes())
    shards = value["splits"]["train"]["shards"]
    count0, first1, count1 = shards[0]["count"], shards[1]["first"], shards[1]["count"]
    # The first shard's entry names the second shard's file (with its size and checksum).
    shards[0].update(name=shards[1]["name"], bytes=shards[1]["bytes"], sha256=shards[1]["sha256"])
    (damaged / "manifest.json").write_text(json.dumps(value))
    problems = verify(str(damaged)).problems
    assert len(problems) == 2 * count1 + count0
    assert (
        problems[0]
        == f"train/train-000001.tar: member {first1:08d}.png is not a sample of this shard"
    )
    assert problems[-1] == f"train/train-000001.tar: sample {count0 - 1} has no image"


def test_verify_exits_2_when_the_counts_do_not_add_up(
    damaged: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    value = json.loads((damaged / "manifest.json").read_bytes())
    value["splits"]["train"]["label"].append(0)
    (damaged / "manifest.json").write_text(json.dumps(value))
    rc, out = run_verify(damaged, capsys)
    assert rc == 2
    assert out == (
        f"hetero dataset verify: {damaged}/manifest.json: splits.train: offset, size and label "
        "have 1437, 1437 and 1438 entries; its shards hold 1437 samples; prepare the dataset "
        "again with `hetero dataset prep`\n"
    )


def test_a_pinned_manifest_refuses_other_bytes(prepared: Path) -> None:
    _, _, digest = load_manifest(str(prepared), expected_sha256=None)
    assert load_manifest(str(prepared), expected_sha256=digest.upper())[2] == digest
    with pytest.raises(ManifestError, match="the dataset changed since the job was planned"):
        load_manifest(str(prepared), expected_sha256="0" * 64)


# --- resuming --------------------------------------------------------------------------------


class FailingClose:
    """``ShardWriter.close`` that counts its calls and raises on call ``fail_at`` (1-based)."""

    def __init__(self, fail_at: int | None) -> None:
        self.calls, self.fail_at = 0, fail_at
        self.real = ShardWriter.close

    def __call__(self, writer: ShardWriter) -> ShardRecord:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("interrupted")
        return self.real(writer)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FailingClose:
        def close(writer: ShardWriter) -> ShardRecord:
            return self(writer)

        monkeypatch.setattr(ShardWriter, "close", close)
        return self


def test_an_interrupted_prep_resumes_to_the_same_bytes(
    digits: DigitsFolders, prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    request = PrepRequest(src=str(digits.train_dir), val_src=str(digits.val_dir),
                          out=str(tmp_path), shard_bytes=SHARD)  # fmt: skip
    FailingClose(fail_at=3).install(monkeypatch)
    with pytest.raises(RuntimeError, match="interrupted"):
        prep(request)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "prep-state.json", "train-000000.tar", "train-000001.tar", "train-000002.tar.partial"
    ]  # fmt: skip
    state = json.loads((tmp_path / "prep-state.json").read_bytes())
    assert [s["name"] for s in state["shards"]] == ["train-000000.tar", "train-000001.tar"]
    finished = {
        n: os.stat(tmp_path / n).st_mtime_ns for n in ("train-000000.tar", "train-000001.tar")
    }

    counting = FailingClose(fail_at=None).install(monkeypatch)
    result = prep(request)
    total = sum(len(s.shards) for s in result.manifest.splits.values())
    assert result.kept == ["train-000000.tar", "train-000001.tar"]
    assert counting.calls == len(result.written) == total - 2
    assert {n: os.stat(tmp_path / n).st_mtime_ns for n in finished} == finished
    assert (tmp_path / "manifest.json").read_bytes() == (prepared / "manifest.json").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in prepared.iterdir())
    for p in prepared.iterdir():
        assert (tmp_path / p.name).read_bytes() == p.read_bytes(), p.name

    # A rerun of a finished prep writes no shard, and the same manifest.
    again = prep(request)
    assert again.written == [] and len(again.kept) == total and again.sha256 == result.sha256


def test_a_resume_rewrites_a_damaged_shard_and_those_after_it(
    digits: DigitsFolders, prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    request = PrepRequest(src=str(digits.val_dir), out=str(tmp_path), val_fraction=0.5,
                          shard_bytes=SHARD)  # fmt: skip
    FailingClose(fail_at=4).install(monkeypatch)
    with pytest.raises(RuntimeError):
        prep(request)
    monkeypatch.undo()
    shard = tmp_path / "train-000001.tar"
    data = bytearray(shard.read_bytes())
    data[5000] ^= 0xFF  # same size, other bytes: only the checksum tells
    shard.write_bytes(bytes(data))
    result = prep(request)
    assert result.kept == ["train-000000.tar"]
    assert result.written[0] == "train-000001.tar"
    fresh = prep(replace(request, out=str(tmp_path / "fresh")))
    assert result.sha256 == fresh.sha256


def test_a_state_of_other_inputs_is_refused_unless_restart(
    digits: DigitsFolders, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    request = PrepRequest(src=str(digits.val_dir), out=str(tmp_path), shard_bytes=SHARD)
    first = prep(request)
    assert first.written == ["train-000000.tar", "train-000001.tar", "train-000002.tar"]
    bigger = PrepRequest(src=str(digits.val_dir), out=str(tmp_path), shard_bytes=2 * SHARD)
    with pytest.raises(PrepError) as e:
        prep(bigger)
    assert str(e.value) == (
        f"{tmp_path}/prep-state.json records a prep of different inputs (differs: "
        "shard_bytes); rerun with the same inputs to resume it, or pass --restart to prepare "
        "from scratch"
    )
    # Interrupted in its first shard, the restart has already taken the old manifest away:
    # nothing describes shards that are being rewritten.
    FailingClose(fail_at=1).install(monkeypatch)
    with pytest.raises(RuntimeError):
        prep(replace(bigger, restart=True))
    assert not (tmp_path / "manifest.json").exists()
    monkeypatch.undo()
    result = prep(bigger)  # the state now records the new inputs: no --restart needed
    assert result.kept == [] and result.written == ["train-000000.tar", "train-000001.tar"]
    # The earlier prep's third shard is gone with it.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "manifest.json", "prep-state.json", "train-000000.tar", "train-000001.tar"
    ]  # fmt: skip
    assert verify(str(tmp_path)).problems == []


# --- S3 ----------------------------------------------------------------------------------------


@mock_aws
def test_prep_from_and_to_s3_makes_the_local_shards(
    digits: DigitsFolders, tmp_path: Path, record_aws_calls: Callable[..., Path]
) -> None:
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="images")
    for path in sorted(digits.val_dir.rglob("*.png")):
        key = f"digits/{path.relative_to(digits.val_dir).as_posix()}"
        s3.put_object(Bucket="images", Key=key, Body=path.read_bytes())
    # What `hetero dataset prep` and `verify` ask of S3, as the user runs them.
    record_aws_calls(aws_calls.Names(cluster="vit", dataset="s3://images/digits/"))
    call_log.attach(s3)

    def request(src: str, out: str) -> PrepRequest:
        return PrepRequest(src=src, out=out, val_fraction=0.25, split_seed=3, shard_bytes=SHARD)

    remote = prep(request("s3://images/digits/", "s3://images/prepared"), client=s3)
    local = prep(request(str(digits.val_dir), str(tmp_path)))
    assert remote.uri == "s3://images/prepared/manifest.json"
    assert remote.manifest.source == "s3://images/digits/"
    assert remote.manifest.classes == local.manifest.classes
    assert {k: v.to_json() for k, v in remote.manifest.splits.items()} == {
        k: v.to_json() for k, v in local.manifest.splits.items()
    }
    for index in local.manifest.splits.values():
        for shard in index.shards:
            body = s3.get_object(Bucket="images", Key=f"prepared/{shard.name}")["Body"].read()
            assert body == (tmp_path / shard.name).read_bytes()
    assert verify("s3://images/prepared/", client=s3).problems == []
    again = prep(request("s3://images/digits/", "s3://images/prepared"), client=s3)
    assert again.written == [] and again.sha256 == remote.sha256
    # A kept object whose bytes changed (same size, so a new ETag) is written again.
    body = s3.get_object(Bucket="images", Key="prepared/train-000001.tar")["Body"].read()
    s3.put_object(Bucket="images", Key="prepared/train-000001.tar", Body=body[::-1])
    resumed = prep(request("s3://images/digits/", "s3://images/prepared"), client=s3)
    assert resumed.kept == ["train-000000.tar"] and resumed.written[0] == "train-000001.tar"
    assert resumed.sha256 == remote.sha256
    s3.delete_object(Bucket="images", Key="prepared/val-000000.tar")
    assert verify("s3://images/prepared/", client=s3, quick=True).problems == [
        "val/val-000000.tar: missing"
    ]
