"""A prepared dataset's reads from S3 in the plan: each data server reads every shard in an epoch
read from S3, at most at its type's bandwidth; the GPUs get at most that share in those epochs,
and the expected throughput counts how many epochs that is (every one when the servers' caches
cannot hold the dataset, the first when they can). Sizes come from the manifest."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest
from realdata import DigitsFolders, write_digits

from training.planner.cli import make_plan, read_prepared_dataset
from training.planner.dataplane import ReadBound, read_bound
from training.planner.facts import Facts
from training.planner.workload import DatasetRead, workload_from_spec
from training.spec import ClusterSpec, load_spec

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
NOW = datetime.datetime(2026, 11, 22, 6, 0, tzinfo=datetime.UTC)
COMPARE = ["1 x g5.xlarge spot + 1 x c6i.4xlarge spot"]
IMAGENET = 1_281_167


def with_shards(text: str, path: str) -> str:
    """cluster.toml's text with its synthetic dataset (``source`` to ``val_fraction``: a prepared
    dataset carries its validation split in the manifest) replaced by shards at ``path``."""
    start = text.index('source = "synthetic"')
    end = text.index("\n", text.index("val_fraction = ", start)) + 1
    return f'{text[:start]}source = "shards"\npath = "{path}"\n{text[end:]}'


def imagenet(cache_gb: float | None) -> DatasetRead:
    """ImageNet-1k's training split as shards: about 140 GB, 109 KB an image."""
    return DatasetRead(
        samples=IMAGENET,
        bytes_total=140_000_000_000,
        cache_bytes=int(cache_gb * 1e9) if cache_gb else 40 * 2**30,
        cache_note=f"cache_gb {cache_gb:g}" if cache_gb else "the default cache (estimate)",
    )


def prepared_digits(tmp_path: Path, *, shard_mb: float) -> tuple[DigitsFolders, Path]:
    """Real digits and the shards ``hetero dataset prep`` made of their training folder."""
    digits = write_digits(tmp_path / "digits", size=16)
    out = tmp_path / "shards"
    subprocess.run(
        [sys.executable, "-m", "training.cli", "--log-level", "WARNING", "dataset", "prep",
         "--src", str(digits.train_dir), "--out", str(out), "--shard-mb", str(shard_mb)],
        cwd=REPO, check=True, capture_output=True,
    )  # fmt: skip
    return digits, out


def test_read_bound_efficiency_weights_the_epochs_read_from_s3() -> None:
    assert ReadBound(factor=1.0, cold_share=1.0, note="").efficiency == 1.0
    assert ReadBound(factor=0.5, cold_share=1.0, note="").efficiency == pytest.approx(0.5)
    # A quarter of the samples at half speed: 1 / (0.75 + 0.25 / 0.5) = 0.8.
    assert ReadBound(factor=0.5, cold_share=0.25, note="").efficiency == pytest.approx(0.8)


def test_the_share_read_from_s3_is_every_epoch_unless_the_cache_holds_the_dataset(
    tmp_path: Path,
) -> None:
    spec = load_spec(REPO / "cluster.toml")
    small_cache = workload_from_spec(spec, 10 * IMAGENET, imagenet(None))
    assert not small_cache.dataset_read.cache_fits  # type: ignore[union-attr]
    assert small_cache.cold_epoch_share == 1.0
    big_cache = workload_from_spec(spec, 10 * IMAGENET, imagenet(200))
    assert big_cache.cold_epoch_share == pytest.approx(0.1)  # the first of 10 epochs
    assert workload_from_spec(spec, 10 * IMAGENET).cold_epoch_share == 0.0  # not prepared


def test_a_server_that_cannot_read_fast_enough_slows_the_plan_and_says_so() -> None:
    spec = load_spec(REPO / "cluster.toml")
    facts = Facts()
    read = imagenet(None)
    workload = workload_from_spec(spec, 10 * IMAGENET, read)
    link = facts.bandwidth_gbps("c6i.4xlarge") * 1e9 / 8
    fast = link / read.bytes_per_image * 2  # twice what the link can read
    bound = read_bound(fast, workload, "c6i.4xlarge", facts)
    assert bound is not None and bound.factor == pytest.approx(0.5)
    assert bound.note.startswith(
        "reads the dataset from S3 in every epoch (the dataset is larger than the default "
        "cache (estimate), 43 GB): "
    )
    assert bound.note.endswith(
        f"more than c6i.4xlarge's {link * 8 / 1e9:.1f} Gbps (estimate): 50% of the GPUs' rate "
        "while it does"
    )
    slow = read_bound(link / read.bytes_per_image / 4, workload, "c6i.4xlarge", facts)
    assert slow is not None and slow.factor == 1.0 and "more than" not in slow.note

    plain = make_plan(spec, COMPARE, region="us-east-1", results_dir=RESULTS, now=NOW)
    with_reads = make_plan(
        spec, COMPARE, region="us-east-1", results_dir=RESULTS, now=NOW, dataset_read=read
    )
    (a,), (b,) = plain.rows, with_reads.rows
    assert not any("reads the dataset" in n for n in a.notes)
    (note,) = [n for n in b.notes if n.startswith("reads the dataset from S3")]
    bound = read_bound(b.nominal_samples_per_s, with_reads.workload, "c6i.4xlarge", facts)
    assert bound is not None and note == bound.note
    assert b.expected_samples_per_s == pytest.approx(a.expected_samples_per_s * bound.efficiency)


def test_the_plan_reads_a_local_manifest_and_leaves_one_in_s3_out_offline(
    tmp_path: Path,
) -> None:
    digits, out = prepared_digits(tmp_path, shard_mb=0.5)
    text = (REPO / "cluster.toml").read_text()

    def spec_at(path: str) -> ClusterSpec:
        spec_path = tmp_path / "cluster.toml"
        spec_path.write_text(with_shards(text, path))
        return load_spec(spec_path)

    notes: list[str] = []
    read = read_prepared_dataset(spec_at(str(out)), offline=True, notes=notes)
    assert notes == [] and read is not None
    assert read.samples == digits.train_count
    assert read.bytes_total == sum(p.stat().st_size for p in out.glob("train-*.tar"))
    assert read_prepared_dataset(spec_at("s3://b/d/"), offline=True, notes=notes) is None
    assert notes == [
        "the prepared dataset's manifest (s3://b/d/) is in S3 and the plan is offline: its "
        "reads from S3 are left out"
    ]


def test_bench_measures_the_shard_reads_and_the_plan_uses_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hetero bench on a spec of shards in S3 (moto) reads whole shards with the server's own
    download path, stores MB/s by instance type, and the plan reads the dataset at that rate."""
    import boto3
    from moto import mock_aws

    from training.planner.bench import dataprep_record, measure_shard_reads
    from training.planner.results import THROUGHPUT_FORMAT, load_measured, read_dataprep

    _, out = prepared_digits(tmp_path, shard_mb=0.1)
    text = (REPO / "cluster.toml").read_text()
    spec_path = tmp_path / "cluster.toml"
    spec_path.write_text(with_shards(text, "s3://data/digits/"))
    spec = load_spec(spec_path)
    for k, v in {"AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t"}.items():
        monkeypatch.setenv(k, v)
    with mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="data")
        for f in out.iterdir():
            s3.upload_file(str(f), "data", f"digits/{f.name}")
        reads = measure_shard_reads(spec, threads=2, max_shards=3, client=s3)
    assert reads is not None and reads.shards == 3
    first3 = sorted(out.glob("train-*.tar"))[:3]
    assert reads.bytes == sum(p.stat().st_size for p in first3)
    assert reads.bytes_per_s == pytest.approx(reads.bytes / reads.seconds)
    assert measure_shard_reads(load_spec(REPO / "cluster.toml"), threads=2) is None

    # Stored like hetero bench stores it, then read back by the planner.
    from training.planner.bench import DataprepFigure

    figure = DataprepFigure(300.0, 6000.0, 280.0, 100)
    common = {"instance_type": "c6i.4xlarge", "date": "2026-11-25", "image_size": 224,
              "source": "hetero bench --spec cluster.toml"}  # fmt: skip
    record = dataprep_record(spec, figure, [1], common, reads)
    record["shard_read_mb_per_s"] = 50.0  # a slow S3: 0.4 Gbps
    store = tmp_path / "results" / "throughput.json"
    store.parent.mkdir()
    store.write_text(json.dumps({"format": THROUGHPUT_FORMAT, "results": [], "dataprep": [record]}))
    (result,) = read_dataprep(store)
    assert result.shard_read_bytes_per_s == 50e6
    measured = load_measured(store.parent)
    assert measured.shard_read_bytes_per_s["c6i.4xlarge"][0] == 50e6
    workload = workload_from_spec(spec, 10 * IMAGENET, imagenet(None))
    bound = read_bound(1000.0, workload, "c6i.4xlarge", Facts(), measured)
    assert bound is not None
    assert bound.factor == pytest.approx(50e6 / (1000.0 * imagenet(None).bytes_per_image))
    assert "c6i.4xlarge's 0.4 Gbps (S3 reads measured by hetero bench" in bound.note
