"""A small world for planner tests: made-up instance types with round numbers, so every figure
the planner produces can be computed by hand in the test that checks it."""

from __future__ import annotations

from training.instance_types import InstanceType
from training.planner.facts import Facts
from training.planner.priors import GpuPeak
from training.planner.results import Measured
from training.planner.workload import Workload
from training.spec import Parallelism, Precision, PricesSpec

# name, vCPUs, memory, GPUs, GPU model, EFA cards, On-Demand USD/h (unused: prices are explicit).
CATALOG = {
    t.name: t
    for t in (
        InstanceType("g.one", 8, 32, 1, "X", 0, 1.0),
        InstanceType("g.alt", 8, 32, 1, "X", 0, 1.0),
        InstanceType("g.four", 32, 128, 4, "X", 1, 4.4),
        InstanceType("g.tiny", 1, 4, 1, "X", 0, 0.5),
        InstanceType("c.cpu", 16, 32, 0, None, 0, 0.5),
    )
}
# Explicit prices (they apply to either market): the Spot price of g.one and g.alt, the
# On-Demand price of g.four.
PRICES = PricesSpec(
    usd_per_hour={"g.one": 0.40, "g.alt": 0.41, "g.four": 4.40, "g.tiny": 0.2, "c.cpu": 0.50}
)


def facts(**changes: object) -> Facts:
    base: dict[str, object] = dict(
        catalog=CATALOG,
        gpu_peaks={"X": GpuPeak(bf16=100e12, fp32=50e12, source="test")},
        mfu=0.5,
        # 8 Gbps = 1e9 bytes/s; 80 Gbps = 1e10 bytes/s.
        baseline_gbps={"g.one": 8.0, "g.alt": 8.0, "g.four": 80.0, "g.tiny": 8.0, "c.cpu": 8.0},
        intra_node_gbytes_per_s={},
        intra_node_pcie_gbytes_per_s=10.0,
        single_flow_gbps=10.0,
        interruption_band={"g.one": "hi", "g.alt": "lo", "g.tiny": "hi"},
        default_interruption_band="hi",
        band_rate={"hi": 20.0, "lo": 0.5},
        seconds_per_month=1e6,
        trainer_vcpus_per_rank=1.0,
        dataprep_reserved_vcpus=1,
        max_dataprep_instances=16,
        dataprep_types=("c.cpu",),
        recovery_s=30.0,
        replacement_s=120.0,
        checkpoint_reference_params=100_000_000,
    )
    base.update(changes)
    return Facts(**base)  # type: ignore[arg-type]


MEASURED = Measured(
    throughput=(),
    augment_images_per_vcpu={"standard": (100.0, 100, "test")},
    receive_images_per_vcpu=(10_000.0, 100, "test"),
    checkpoint_s3_s=(18.0, "test"),
    checkpoint_async_stall_s=(1.0, "test"),
)


def workload(**changes: object) -> Workload:
    base: dict[str, object] = dict(
        model="test",
        params=100_000_000,
        train_flops_per_sample=50e9,
        image_size=100,  # 30,000 bytes per uint8 sample
        batch_per_rank=100,
        grad_accum_steps=1,
        precision=Precision.BF16,
        strategy=Parallelism.DDP,
        grad_compression=False,
        recipe="standard",
        samples_to_train=3_600_000,
        samples_note="test",
        async_checkpoint=False,
        spec_interval_steps=500,
        streams_per_server=1,
    )
    base.update(changes)
    return Workload(**base)  # type: ignore[arg-type]


def trainer_entry(**changes: object) -> dict[str, object]:
    """One trainer result as the results store holds it (GPU X, the test model, 100 px)."""
    base: dict[str, object] = {
        "instance_type": None,
        "device": "X",
        "model": "test",
        "image_size": 100,
        "precision": "bf16",
        "samples_per_s_per_device": 250.0,
        "date": "2026-11-20",
        "versions": {"torch": "2.15.0"},
        "source": "test",
    }
    return {**base, **changes}
