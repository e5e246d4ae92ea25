"""The per-type facts and scalar priors one plan uses, bundled so a test can pass its own.

Defaults come from ``training.planner.priors`` and the catalogue (training/instance_types.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from training import instance_types
from training.planner import priors
from training.planner.errors import PlanError


@dataclass(frozen=True)
class Facts:
    catalog: Mapping[str, instance_types.InstanceType] = field(
        default_factory=lambda: instance_types.CATALOG
    )
    gpu_peaks: Mapping[str, priors.GpuPeak] = field(default_factory=lambda: priors.GPU_PEAKS)
    mfu: float = priors.MFU_PRIOR
    baseline_gbps: Mapping[str, float] = field(default_factory=lambda: priors.BASELINE_GBPS)
    intra_node_gbytes_per_s: Mapping[str, float] = field(
        default_factory=lambda: priors.INTRA_NODE_GBYTES_PER_S
    )
    intra_node_pcie_gbytes_per_s: float = priors.INTRA_NODE_PCIE_GBYTES_PER_S
    single_flow_gbps: float = priors.SINGLE_FLOW_GBPS_IN_PLACEMENT_GROUP
    interruption_band: Mapping[str, str] = field(default_factory=lambda: priors.INTERRUPTION_BAND)
    default_interruption_band: str = priors.DEFAULT_INTERRUPTION_BAND
    band_rate: Mapping[str, float] = field(default_factory=lambda: priors.INTERRUPTION_BAND_RATE)
    seconds_per_month: float = priors.SECONDS_PER_MONTH
    trainer_vcpus_per_rank: float = priors.TRAINER_VCPUS_PER_RANK
    dataprep_reserved_vcpus: int = priors.DATAPREP_RESERVED_VCPUS
    max_dataprep_instances: int = priors.MAX_DATAPREP_INSTANCES
    dataprep_types: tuple[str, ...] = priors.DATAPREP_TYPES
    recovery_s: float = priors.RECOVERY_S
    replacement_s: float = priors.REPLACEMENT_S
    checkpoint_reference_params: int = priors.CHECKPOINT_REFERENCE_PARAMS

    def instance(self, name: str) -> instance_types.InstanceType:
        entry = self.catalog.get(name)
        if entry is None:
            raise PlanError(f"unknown instance type {name!r}")
        return entry

    def bandwidth_gbps(self, name: str) -> float:
        """Baseline network bandwidth of one instance of ``name``."""
        if name not in self.baseline_gbps:
            raise PlanError(
                f"no network bandwidth known for {name}; add its baseline Gbps to "
                "training/planner/priors.py BASELINE_GBPS (Amazon EC2 Instance Types guide, "
                "Network specifications)"
            )
        return self.baseline_gbps[name]

    def intra_node_bytes_per_s(self, name: str) -> float:
        gbytes = self.intra_node_gbytes_per_s.get(name, self.intra_node_pcie_gbytes_per_s)
        return gbytes * 1e9

    def interruption(self, name: str) -> tuple[str, float]:
        """(Spot Instance Advisor band, interruptions per instance per month) of ``name``."""
        band = self.interruption_band.get(name, self.default_interruption_band)
        return band, self.band_rate[band]
