"""What the planner reads: --compare strings, regions, the spec's model and samples, and the
results store of measured throughput."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.planner import priors
from training.planner.candidates import Candidate, Group, candidates, check_region, parse_config
from training.planner.errors import PlanError
from training.planner.results import load_measured, read_throughput
from training.planner.throughput import gpu_throughput
from training.planner.workload import vit_size, workload_from_spec
from training.spec import Market, parse_spec

from .support import facts, workload
from .support import trainer_entry as entry

SPEC = {
    "name": "plan-test",
    "groups": [
        {
            "name": "trainer",
            "role": "trainer",
            "instance_types": ["g5.xlarge", "g6.xlarge"],
            "count": 2,
        },
        {"name": "dataprep", "role": "dataprep", "instance_types": ["c6i.4xlarge"], "count": 1},
    ],
    "job": {"batch_size": 32, "steps": 100, "grad_accum_steps": 2},
}


def test_compare_strings_parse_to_groups() -> None:
    assert parse_config("4 x g5.xlarge spot") == Candidate(Group("g5.xlarge", 4, Market.SPOT))
    assert parse_config("1 x g5.12xlarge on-demand") == Candidate(
        Group("g5.12xlarge", 1, Market.ON_DEMAND)
    )
    assert parse_config("2x g6.xlarge") == Candidate(Group("g6.xlarge", 2, Market.SPOT))
    assert parse_config("2 x g5.xlarge spot + 1 x c6i.8xlarge on-demand") == Candidate(
        Group("g5.xlarge", 2, Market.SPOT), Group("c6i.8xlarge", 1, Market.ON_DEMAND)
    )


def test_unknown_instance_type_names_close_matches() -> None:
    with pytest.raises(PlanError) as e:
        parse_config("4 x g5.xlarg spot")
    assert "unknown instance type 'g5.xlarg'" in str(e.value)
    assert "did you mean g5.xlarge" in str(e.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("4 x c6i.4xlarge spot", "c6i.4xlarge has no GPU"),
        ("1 x p3.2xlarge spot", "p3.2xlarge has V100 GPUs .* give a GPU type the image runs"),
        ("1 x g5.xlarge + 1 x g5.xlarge", "g5.xlarge is not a dataprep type"),
        ("four g5.xlarge", "expected 'N x TYPE [spot|on-demand]'"),
        ("0 x g5.xlarge", "instance counts must be at least 1"),
        ("1 x g5.xlarge preemptible", "expected 'N x TYPE [spot|on-demand]'"),
    ],
)
def test_bad_compare_strings_say_what_to_write(text: str, message: str) -> None:
    with pytest.raises(PlanError, match=message.replace("[", r"\[").replace("|", r"\|")):
        parse_config(text)


def test_unknown_region_lists_the_valid_ones() -> None:
    known = {"us-east-1", "us-east-2", "eu-west-1"}
    assert check_region("eu-west-1", known) == "eu-west-1"
    with pytest.raises(PlanError) as e:
        check_region("us-esat-1", known)
    assert str(e.value) == (
        "unknown region 'us-esat-1' (did you mean us-east-1, us-east-2?); valid regions: "
        "eu-west-1, us-east-1, us-east-2"
    )


def test_candidates_from_the_spec_are_types_x_counts_x_markets() -> None:
    spec = parse_spec(SPEC)
    found = candidates(spec, None)
    assert [c.label for c in found] == [
        f"{n} x {t} {m}"
        for t in ("g5.xlarge", "g6.xlarge")
        for n in (1, 2, 4)
        for m in ("spot", "on-demand")
    ]
    # --compare replaces them, duplicates dropped.
    assert [c.label for c in candidates(spec, ["1 x g5.xlarge", "1 x g5.xlarge spot"])] == [
        "1 x g5.xlarge spot"
    ]


def test_workload_from_the_spec() -> None:
    w = workload_from_spec(parse_spec(SPEC))
    # 100 steps x 32 per rank x 2 accumulation x (2 instances x 1 GPU) ranks.
    assert w.samples_to_train == 100 * 32 * 2 * 2
    assert w.samples_per_rank_step == 64
    assert w.params == vit_size(priors.VIT_ARCHS["vit_base_patch16_224"], 224, 1000).params
    assert workload_from_spec(parse_spec(SPEC), samples_override=7).samples_to_train == 7


def test_models_the_planner_cannot_size_are_refused() -> None:
    spec = json.loads(json.dumps(SPEC))
    spec["job"]["model"] = {"name": "resnet50"}
    with pytest.raises(PlanError, match=r"job.model.name = 'resnet50': the planner cannot size"):
        workload_from_spec(parse_spec(spec))
    spec["job"]["model"] = {"name": "vit_small_patch16_224", "overrides": {"class_token": False}}
    with pytest.raises(PlanError, match=r"job.model.overrides has class_token"):
        workload_from_spec(parse_spec(spec))
    # An architecture override is applied: 6 blocks of ViT-S instead of 12.
    spec["job"]["model"] = {"name": "vit_small_patch16_224", "overrides": {"depth": 6}}
    six = workload_from_spec(parse_spec(spec))
    twelve = vit_size(priors.VIT_ARCHS["vit_small_patch16_224"], 224, 1000)
    assert six.params < twelve.params
    assert six.train_flops_per_sample == pytest.approx(
        vit_size(priors.VitArch(16, 384, 6, 6), 224, 1000).train_flops_per_sample
    )


def test_epochs_of_a_folder_leave_samples_unknown() -> None:
    spec = json.loads(json.dumps(SPEC))
    del spec["job"]["steps"]
    spec["job"]["epochs"] = 3
    spec["job"]["dataset"] = {"source": "folder", "path": "/data"}
    w = workload_from_spec(parse_spec(spec))
    assert w.samples_to_train is None
    assert "pass --samples N" in w.samples_note


def write_store(folder: Path, results: list[dict[str, object]]) -> None:
    (folder / "throughput.json").write_text(
        json.dumps({"format": "hetero-throughput-v1", "results": results})
    )


def test_measured_throughput_wins_over_the_estimate(tmp_path: Path) -> None:
    write_store(
        tmp_path,
        [
            entry(),  # by GPU model
            entry(samples_per_s_per_device=300.0, date="2026-11-21"),  # newer, same key
            entry(instance_type="g.four", samples_per_s_per_device=123.0),  # by instance type
            entry(device="X", model="other", samples_per_s_per_device=9.0),  # another model
        ],
    )
    measured = load_measured(tmp_path)
    one = gpu_throughput("g.one", workload(), facts(), measured)
    assert (one.samples_per_s, one.measured) == (300.0, True)
    assert one.source == "measured on X 2026-11-21 (torch 2.15.0)"
    assert gpu_throughput("g.four", workload(), facts(), measured).samples_per_s == 123.0
    # Another image size: no measurement applies, the estimate (1,000/s) is used and labelled.
    estimate = gpu_throughput("g.one", workload(image_size=200), facts(), measured)
    assert (estimate.samples_per_s, estimate.measured) == (1000.0, False)
    assert estimate.source.startswith("estimate: X 100 TFLOP/s x MFU prior 0.5")


def test_malformed_results_store_names_the_field(tmp_path: Path) -> None:
    write_store(tmp_path, [entry(samples_per_s_per_device="fast")])
    with pytest.raises(PlanError, match=r"results\[0\].samples_per_s_per_device"):
        read_throughput(tmp_path / "throughput.json")
    (tmp_path / "throughput.json").write_text("{not json")
    with pytest.raises(PlanError, match="not readable JSON"):
        read_throughput(tmp_path / "throughput.json")
    assert read_throughput(tmp_path / "missing.json") == []


def test_the_repository_benchmark_results_are_read_as_measured(tmp_path: Path) -> None:
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    measured = load_measured(results)
    store = json.loads((results / "throughput.json").read_text())
    # At 224 px hetero bench's newest 224 px row per recipe applies (the whole server on real
    # JPEGs), not its 64 px ones, nor the benchmark outputs' figures.
    for recipe in ("standard", "randaugment"):
        row = [r for r in store["dataprep"] if (r["recipe"], r["image_size"]) == (recipe, 224)][-1]
        rate, px, source = measured.augment_rate(recipe, 224)
        assert (rate, px) == (row["images_per_s_per_vcpu"], 224), recipe
        assert source == f"measured by {row['source']} on {row['device']} {row['date']}"
    assert measured.receive_rate(224)[:2] == (row["receive_images_per_s_per_vcpu"], 224)
    # Without the store, the benchmark outputs' 224 px figures apply.
    for name in ("dataplane.json", "checkpoint.json"):
        (tmp_path / name).write_text((results / name).read_text())
    alone = load_measured(tmp_path)
    data = json.loads((results / "dataplane.json").read_text())
    rate, px, source = alone.augment_rate("standard", 224)
    assert rate == pytest.approx(1000 / data["local_augmentation"]["cpu_s_per_1000_images"])
    assert (px, source) == (224, "measured (benchmarks/results/dataplane.json)")
    # Likewise the receive cost: the 224 px transport measurement, not a smaller size's.
    receive = alone.receive_rate(224)
    assert receive[0] == pytest.approx(1000 / data["transport"]["client_cpu_s_per_1000_images"])
    assert receive[1:] == (224, "measured (benchmarks/results/dataplane.json)")
    checkpoint = json.loads((results / "checkpoint.json").read_text())
    s3 = next(r for r in checkpoint["stop_to_durable"] if r["target"].startswith("s3"))
    assert measured.checkpoint_s3_s == (
        s3["seconds"],
        "measured (benchmarks/results/checkpoint.json)",
    )
