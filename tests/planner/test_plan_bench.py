"""hetero bench and what the planner makes of its figures: the results store (merge, read,
validation), the CPU model of a trainer fed by data servers (``local``), and the MFU calibrated
on measured GPU runs. One test runs the real command (trainer, data server, client)."""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

import psutil
import pytest

from training.cli import main as hetero
from training.instance_types import InstanceType
from training.planner.bench import cpu_model, gpu_model, merge, parse_cores
from training.planner.errors import PlanError
from training.planner.local import LocalTopology, predict_local
from training.planner.priors import GpuPeak
from training.planner.results import load_measured, read_dataprep, read_throughput
from training.planner.throughput import calibrated_mfu, gpu_throughput
from training.planner.workload import workload_from_spec
from training.spec import load_spec

from .support import MEASURED, facts, trainer_entry, workload

TINY_SPEC = """
name = "bench-test"
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
batch_size = 8
steps = 10
precision = "fp32"
augmentation = "randaugment"
[job.model]
name = "vit_tiny_patch16_224"
[job.model.overrides]
img_size = 32
patch_size = 8
depth = 1
embed_dim = 32
num_heads = 2
num_classes = 10
[job.dataset]
source = "synthetic"
num_samples = 64
num_classes = 10
image_size = 32
[job.checkpoint]
dir = "CHECKPOINTS"
[job.dataplane]
prefetch_batches = 2
chunk_batches = 1
workers_per_server = 1
"""


def dataprep_entry(**changes: object) -> dict[str, object]:
    base: dict[str, object] = {
        "instance_type": None,
        "device": "CPU x1",
        "recipe": "standard",
        "image_size": 100,
        "images_per_s_per_vcpu": 50.0,
        "receive_images_per_s_per_vcpu": 1000.0,
        "date": "2026-11-20",
        "source": "test",
    }
    return {**base, **changes}


def test_hetero_bench_measures_and_stores_what_plan_reads(tmp_path: Path) -> None:
    spec_path = tmp_path / "spec.toml"
    spec_path.write_text(TINY_SPEC.replace("CHECKPOINTS", str(tmp_path / "ckpt")))
    store = tmp_path / "results" / "throughput.json"
    # Another machine's entry, which a run here must keep.
    merge(store, [trainer_entry(device="A10G")], [])
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    argv = ["--log-level", "WARNING", "bench", "--spec", str(spec_path), "--out", str(store)]
    argv += ["--trainer-cores", "0", "--server-cores", "0", "--steps", "2", "--warmup", "1"]
    assert hetero([*argv, "--batches", "4"]) == 0
    # No server, worker or forkserver outlives the command.
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before

    data = json.loads(store.read_text())
    trainers = {e["device"]: e for e in data["results"]}
    assert set(trainers) == {"A10G", f"{cpu_model()} x1"}
    spec = load_spec(spec_path)
    here = trainers[f"{cpu_model()} x1"]
    assert (here["model"], here["image_size"], here["precision"], here["threads"]) == (
        "vit_tiny_patch16_224",
        32,
        "fp32",
        1,
    )
    assert here["params"] == workload_from_spec(spec).params
    assert here["date"] == datetime.date.today().isoformat()
    import torch

    assert here["versions"]["torch"] == torch.__version__
    assert here["samples_per_s_per_device"] > 0 and here["measured_steps"] == 2
    (prep,) = data["dataprep"]
    assert (prep["recipe"], prep["image_size"], prep["device"]) == (
        "randaugment",
        32,
        f"{cpu_model()} x1",
    )
    assert prep["images"] == 4 * 8
    # What hetero plan reads: this recipe's rate and the receive cost, from the bench.
    measured = load_measured(store.parent)
    rate, px, source = measured.augment_rate("randaugment", 32)
    assert (rate, px) == (prep["images_per_s_per_vcpu"], 32)
    assert source.startswith("measured by hetero bench --spec spec.toml on ")
    assert measured.receive_images_per_vcpu[0] == prep["receive_images_per_s_per_vcpu"]
    # And the CPU model of this machine predicts from exactly these figures.
    prediction = predict_local(
        LocalTopology(1, 1, 1, 1), workload_from_spec(spec), measured, cpu_model()
    )
    r, recv, aug = (
        here["samples_per_s_per_device"],
        prep["receive_images_per_s_per_vcpu"],
        prep["images_per_s_per_vcpu"],
    )
    delivered = prep["images_per_s_per_server"]
    assert prep["server_workers"] == 1
    assert prediction.samples_per_s == pytest.approx(min(1 / (1 / r + 1 / recv), aug, delivered))


def test_merge_replaces_the_same_key_and_keeps_the_rest(tmp_path: Path) -> None:
    store = tmp_path / "throughput.json"
    merge(store, [trainer_entry(), trainer_entry(device="Y")], [dataprep_entry()])
    merge(
        store,
        [trainer_entry(samples_per_s_per_device=99.0, date="2026-11-22")],
        [dataprep_entry(recipe="randaugment")],
    )
    results = read_throughput(store)
    assert sorted((r.device, r.samples_per_s_per_device) for r in results) == [
        ("X", 99.0),
        ("Y", 250.0),
    ]
    assert [r.recipe for r in read_dataprep(store)] == ["standard", "randaugment"]
    (tmp_path / "other.json").write_text('{"format": "something-else"}')
    with pytest.raises(PlanError, match="not a results store"):
        merge(tmp_path / "other.json", [trainer_entry()], [])


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"images_per_s_per_vcpu": 0}, "images_per_s_per_vcpu"),
        ({"receive_images_per_s_per_vcpu": "fast"}, "receive_images_per_s_per_vcpu"),
        ({"recipe": "mixup"}, "recipe"),
        ({"image_size": 8}, "image_size"),
    ],
)
def test_malformed_dataprep_entries_name_the_field(
    tmp_path: Path, change: dict[str, object], field: str
) -> None:
    store = tmp_path / "throughput.json"
    merge(store, [], [dataprep_entry(**change)])
    with pytest.raises(PlanError, match=rf"dataprep\[0\]\.{field}"):
        load_measured(tmp_path)


def test_parse_cores() -> None:
    import os

    usable = sorted(os.sched_getaffinity(0))
    assert parse_cores(None, "--x") == usable
    assert parse_cores(f"{usable[0]}", "--x") == [usable[0]]
    with pytest.raises(PlanError, match=r"--x '9999': cores \[9999\] are not usable"):
        parse_cores("9999", "--x")
    with pytest.raises(PlanError, match="expected core numbers"):
        parse_cores("zero", "--x")


def test_gpu_names_map_to_the_peak_table() -> None:
    assert gpu_model("NVIDIA A10G") == "A10G"
    assert gpu_model("NVIDIA H100 80GB HBM3") == "H100"
    assert gpu_model("NVIDIA A100-SXM4-80GB") in ("A100", "A100-80GB")
    assert gpu_model("Some New GPU") == "Some New GPU"


def measured_cpu(**changes: object) -> object:
    """MEASURED with a CPU trainer result (100 samples/s on 'CPU x1') and 50 images/s per core
    of augmentation, 1,000 of receive, all at the workload's 100 px."""
    return dataclasses.replace(
        MEASURED,
        throughput=tuple(
            read_throughput_entries(
                [trainer_entry(device="CPU x1", samples_per_s_per_device=100.0, params=100_000_000)]
            )
        ),
        augment_images_per_vcpu={"standard": (50.0, 100, "test")},
        receive_images_per_vcpu=(1000.0, 100, "test"),
        **changes,
    )


def read_throughput_entries(entries: list[dict[str, object]]) -> list[object]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        merge(Path(tmp) / "t.json", entries, [])
        return list(read_throughput(Path(tmp) / "t.json"))


def test_local_prediction_by_hand() -> None:
    measured = measured_cpu()
    w = workload()
    # Trainer side: 1 / (1/100 + 1/1000) = 90.909; two servers on one core supply 1 x 50.
    p = predict_local(LocalTopology(1, 2, 1, 1), w, measured, "CPU")  # type: ignore[arg-type]
    assert (p.trainer_side, p.supply, p.samples_per_s, p.bound) == (
        pytest.approx(1000 / 11),
        50.0,
        50.0,
        "data",
    )
    # Two servers on two cores: 100 images/s, more than the trainer takes.
    p = predict_local(LocalTopology(1, 2, 2, 1), w, measured, "CPU")  # type: ignore[arg-type]
    assert (p.samples_per_s, p.bound) == (pytest.approx(1000 / 11), "trainer")
    # One server with one worker uses one core, however many it is given.
    p = predict_local(LocalTopology(1, 1, 2, 1), w, measured, "CPU")  # type: ignore[arg-type]
    assert p.supply == 50.0
    # The trainer measured at 100 px says nothing of 50 px.
    small = dataclasses.replace(w, image_size=50)
    with pytest.raises(PlanError, match=r"no measured trainer rate .* at 50 px"):
        predict_local(LocalTopology(1, 1, 1, 1), small, measured, "CPU")  # type: ignore[arg-type]
    # A different model under the same timm name (another parameter count) is not matched.
    other = dataclasses.replace(w, params=5)
    with pytest.raises(PlanError, match="run hetero bench --trainer-cores with 1 core"):
        predict_local(LocalTopology(1, 1, 1, 1), other, measured, "CPU")  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="servers must be at least 1"):
        LocalTopology(1, 0, 1, 1)
    # One server delivered 40 images/s with one worker: one server is held to 40, two on one
    # core to the core's 50; with two workers per server the figure does not apply.
    capped = dataclasses.replace(measured, server_images_per_s={"standard": (40.0, 100, 1, "t")})
    one = predict_local(LocalTopology(1, 1, 1, 1), w, capped, "CPU")  # type: ignore[arg-type]
    two = predict_local(LocalTopology(1, 2, 1, 1), w, capped, "CPU")  # type: ignore[arg-type]
    other = predict_local(LocalTopology(1, 1, 2, 2), w, capped, "CPU")  # type: ignore[arg-type]
    assert (one.supply, two.supply, other.supply) == (40.0, 50.0, 100.0)
    assert one.sources[-1] == "one server delivers 40.0 images/s: t"


def test_mfu_is_calibrated_on_measured_gpu_runs() -> None:
    # GPU X: 100 TFLOP/s bf16; 50 GFLOP per sample. Runs at 600, 800 and 1,200 samples/s give
    # MFU 0.3, 0.4, 0.6: the median 0.4. A CPU run and another image size do not count.
    runs = read_throughput_entries(
        [
            trainer_entry(instance_type="g.one", samples_per_s_per_device=600.0),
            trainer_entry(device="X", samples_per_s_per_device=800.0, date="2026-11-21"),
            trainer_entry(instance_type="g.four", samples_per_s_per_device=1200.0),
            trainer_entry(device="CPU x1", samples_per_s_per_device=5.0),
            trainer_entry(device="X", image_size=200, samples_per_s_per_device=1.0),
        ]
    )
    measured = dataclasses.replace(MEASURED, throughput=tuple(runs))
    mfu, source = calibrated_mfu(workload(), facts(), measured)  # type: ignore[arg-type]
    assert mfu == pytest.approx(0.4)
    assert source == "MFU 0.4 calibrated on 3 measured GPU run(s)"
    # g.z (GPU Z, 200 TFLOP/s, never measured) is estimated with the calibrated MFU:
    # 200e12 x 0.4 / 50e9 = 1,600 samples/s.
    base = facts()
    with_z = facts(
        catalog={**base.catalog, "g.z": InstanceType("g.z", 8, 32, 1, "Z", 0, 1.0)},
        gpu_peaks={**base.gpu_peaks, "Z": GpuPeak(bf16=200e12, fp32=100e12, source="test")},
    )
    est = gpu_throughput("g.z", workload(), with_z, measured)  # type: ignore[arg-type]
    assert (est.samples_per_s, est.measured) == (pytest.approx(1600.0), False)
    assert "x MFU 0.4 calibrated on 3 measured GPU run(s) /" in est.source
    # No GPU run for this model: the prior (0.5 in these facts), said so.
    assert calibrated_mfu(workload(model="other"), facts(), MEASURED) == (0.5, "MFU prior 0.5")
