"""A dated, offline catalogue of the EC2 instance types this project knows.

The spec validator uses it to refuse impossible clusters before anything is deployed (EFA asked
for on a type without it, burstable types in a cluster placement group, unknown types, trainer
GPUs the image's CUDA wheels have no kernels for: ``compute_capability``); the
infrastructure uses it to add one EFA interface per network card and to grow the dataprep root
volume for the shard cache only where a type's instance store cannot hold it; metrics and the
planner use its On-Demand prices when the spec gives none.

Prices are us-east-1 Linux On-Demand list prices in USD per hour, as of ``PRICES_AS_OF``: the
Price List API's figures as aws/karpenter-provider-aws recorded them on that date
(``pkg/providers/pricing/zz_generated.pricing_aws.go``, "generated at 2026-07-20T13:44:30Z for
us-east-1"; p4d and p4de after AWS's June 2025 price cut). They drift: pass explicit prices in
the spec (``[job.prices]``) for figures you will act on.

Instance store (the CPU types with NVMe instance store, the ``d`` types, where a dataprep
instance keeps its shard cache: ``infra/shard_cache.py``): volumes per type and the size of
each, in GB, from the EC2 User Guide's "Available instance store volumes" table
(https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/InstanceStorage.html#instance-store-volumes,
as github.com/awsdocs/amazon-ec2-user-guide ``doc_source/InstanceStorage.md`` holds it at commit
5bcb1f4, 2022-11-05; the tables now live in the Instance Types guide, "Instance store
specifications": https://docs.aws.amazon.com/ec2/latest/instancetypes/co.html#co_instance-store
for c5d and c6id, .../gp.html for m6id). Cross-checked against the totals
(``karpenter.k8s.aws/instance-local-nvme``) of aws/karpenter-provider-aws
``website/content/en/preview/reference/instance-types.md`` (generated from DescribeInstanceTypes,
2026-07-11), which also gives these types' vCPUs, memory and EFA support. Only x86_64 types:
every instance runs the same x86_64 image, so Graviton ``d`` types (c6gd, c7gd) are left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

PRICES_AS_OF = "2026-07-20"
PRICES_REGION = "us-east-1"

IMAGE_CUDA_MAJOR = 13
"""The CUDA major version of the trainer image's torch wheels: the ``nvidia-cuda-runtime`` pin in
``containers/constraints.txt`` (``tests/test_instance_types.py`` keeps the two the same)."""
MIN_COMPUTE_CAPABILITY: Mapping[int, tuple[int, int]] = {12: (7, 0), 13: (7, 5)}
"""The least GPU compute capability PyTorch's Linux x86_64 CUDA wheels of each CUDA major carry
kernels for. CUDA 13.0 removed offline compilation and library support for Maxwell, Pascal and
Volta, compute capability below 7.5 (CUDA Toolkit 13.0 release notes, "Deprecated
Architectures": https://docs.nvidia.com/cuda/archive/13.0.0/cuda-toolkit-release-notes/index.html;
announced in 12.9's), so PyTorch builds its CUDA 13.0 wheels for
``TORCH_CUDA_ARCH_LIST="7.5;8.0;8.6;9.0;10.0;12.0+PTX"`` and its CUDA 12.8 and 12.9 wheels from
7.0 up (``.ci/manywheel/build_cuda.sh`` in pytorch/pytorch; pytorch/pytorch#157517). A GPU below
the floor (V100, 7.0, on p3 and p3dn) fails at its first CUDA call."""
MIN_DRIVER_BRANCH: Mapping[int, int] = {12: 525, 13: 580}
"""The least Linux NVIDIA driver (its major version, the branch) an application built with each
CUDA major runs on under CUDA minor version compatibility: "CUDA 13.x >= 580", "CUDA 12.x
>= 525" (https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html).
An older driver fails at the first CUDA call ("driver too old")."""


@dataclass(frozen=True, slots=True)
class InstanceType:
    name: str
    vcpus: int
    memory_gib: float
    gpus: int
    gpu_model: str | None
    efa_network_cards: int
    """How many network cards can carry an EFA interface (0: the type has no EFA)."""
    on_demand_usd_per_hour: float
    instance_store_volumes: int = 0
    """How many NVMe instance store volumes the type has (0: none, EBS only)."""
    instance_store_volume_gb: int = 0
    """The size of each of them in GB as AWS lists it ("2 x 1900 GB"), taken as 10^9 bytes like
    the spec's ``cache_gb``. The boot puts the shard cache on one volume, so this, not the
    total, is what the cache can use."""
    compute_capability: tuple[int, int] | None = None
    """The GPU's CUDA compute capability (major, minor), from NVIDIA's table
    (https://developer.nvidia.com/cuda-gpus; V100 on https://developer.nvidia.com/cuda-legacy-gpus;
    A10G is AWS's A10, 8.6); None without a GPU. What decides whether the image's CUDA wheels
    have kernels for it (``MIN_COMPUTE_CAPABILITY``)."""

    @property
    def instance_store_volume_bytes(self) -> int:
        """One instance store volume's size in bytes (0 without instance store)."""
        return self.instance_store_volume_gb * 10**9

    @property
    def family(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def burstable(self) -> bool:
        """T-family types run on CPU credits; they cannot join a cluster placement group."""
        return self.family.startswith("t")

    @property
    def supports_efa(self) -> bool:
        return self.efa_network_cards > 0

    def image_problem(self, cuda_major: int = IMAGE_CUDA_MAJOR) -> str | None:
        """Why the image's CUDA ``cuda_major`` wheels cannot run on this type's GPU, or None."""
        if not self.gpus:
            return None
        floor = MIN_COMPUTE_CAPABILITY[cuda_major]
        if self.compute_capability is None:
            return f"{self.name}: the catalogue does not know its GPU's compute capability"
        if self.compute_capability >= floor:
            return None
        have = ".".join(map(str, self.compute_capability))
        return (
            f"{self.name} has {self.gpu_model} GPUs (compute capability {have}); the image's "
            f"CUDA {cuda_major} wheels (containers/constraints.txt) have kernels only for "
            f"{'.'.join(map(str, floor))} and newer, so the job would fail at its first CUDA call"
        )


CATALOG: dict[str, InstanceType] = {
    t.name: t
    for t in (
        # GPU: trainer groups.
        InstanceType("p5.48xlarge", 192, 2048, 8, "H100", 32, 55.04, compute_capability=(9, 0)),
        InstanceType(
            "p4de.24xlarge", 96, 1152, 8, "A100-80GB", 4, 27.44705, compute_capability=(8, 0)
        ),
        InstanceType("p4d.24xlarge", 96, 1152, 8, "A100", 4, 21.957642, compute_capability=(8, 0)),
        InstanceType("p3dn.24xlarge", 96, 768, 8, "V100", 1, 31.212, compute_capability=(7, 0)),
        InstanceType("p3.2xlarge", 8, 61, 1, "V100", 0, 3.06, compute_capability=(7, 0)),
        InstanceType("p3.8xlarge", 32, 244, 4, "V100", 0, 12.24, compute_capability=(7, 0)),
        InstanceType("p3.16xlarge", 64, 488, 8, "V100", 0, 24.48, compute_capability=(7, 0)),
        InstanceType("g6e.xlarge", 4, 32, 1, "L40S", 0, 1.861, compute_capability=(8, 9)),
        InstanceType("g6e.12xlarge", 48, 384, 4, "L40S", 1, 10.493, compute_capability=(8, 9)),
        InstanceType("g6.xlarge", 4, 16, 1, "L4", 0, 0.8048, compute_capability=(8, 9)),
        InstanceType("g6.2xlarge", 8, 32, 1, "L4", 0, 0.9776, compute_capability=(8, 9)),
        InstanceType("g6.4xlarge", 16, 64, 1, "L4", 0, 1.3232, compute_capability=(8, 9)),
        InstanceType("g6.8xlarge", 32, 128, 1, "L4", 1, 2.0144, compute_capability=(8, 9)),
        InstanceType("g6.12xlarge", 48, 192, 4, "L4", 1, 4.6016, compute_capability=(8, 9)),
        InstanceType("g6.48xlarge", 192, 768, 8, "L4", 1, 13.3504, compute_capability=(8, 9)),
        InstanceType("g5.xlarge", 4, 16, 1, "A10G", 0, 1.006, compute_capability=(8, 6)),
        InstanceType("g5.2xlarge", 8, 32, 1, "A10G", 0, 1.212, compute_capability=(8, 6)),
        InstanceType("g5.4xlarge", 16, 64, 1, "A10G", 0, 1.624, compute_capability=(8, 6)),
        InstanceType("g5.8xlarge", 32, 128, 1, "A10G", 1, 2.448, compute_capability=(8, 6)),
        InstanceType("g5.12xlarge", 48, 192, 4, "A10G", 1, 5.672, compute_capability=(8, 6)),
        InstanceType("g5.24xlarge", 96, 384, 4, "A10G", 1, 8.144, compute_capability=(8, 6)),
        InstanceType("g5.48xlarge", 192, 768, 8, "A10G", 1, 16.288, compute_capability=(8, 6)),
        InstanceType("g4dn.xlarge", 4, 16, 1, "T4", 0, 0.526, compute_capability=(7, 5)),
        InstanceType("g4dn.12xlarge", 48, 192, 4, "T4", 1, 3.912, compute_capability=(7, 5)),
        # CPU: dataprep groups.
        InstanceType("c5.9xlarge", 36, 72, 0, None, 0, 1.53),
        InstanceType("c5.18xlarge", 72, 144, 0, None, 1, 3.06),
        InstanceType("c5n.18xlarge", 72, 192, 0, None, 1, 3.888),
        InstanceType("c6i.4xlarge", 16, 32, 0, None, 0, 0.68),
        InstanceType("c6i.8xlarge", 32, 64, 0, None, 0, 1.36),
        InstanceType("c6i.16xlarge", 64, 128, 0, None, 0, 2.72),
        InstanceType("c6i.32xlarge", 128, 256, 0, None, 1, 5.44),
        InstanceType("c7i.4xlarge", 16, 32, 0, None, 0, 0.714),
        InstanceType("c7i.8xlarge", 32, 64, 0, None, 0, 1.428),
        InstanceType("c7i.16xlarge", 64, 128, 0, None, 0, 2.856),
        InstanceType("c7i.48xlarge", 192, 384, 0, None, 1, 8.568),
        InstanceType("m6i.4xlarge", 16, 64, 0, None, 0, 0.768),
        InstanceType("m7i.4xlarge", 16, 64, 0, None, 0, 0.8064),
        # CPU with NVMe instance store (volumes, GB each): dataprep groups that cache shards on
        # local disk.
        InstanceType("c5d.9xlarge", 36, 72, 0, None, 0, 1.728, 1, 900),
        InstanceType("c5d.18xlarge", 72, 144, 0, None, 0, 3.456, 2, 900),
        InstanceType("c6id.4xlarge", 16, 32, 0, None, 0, 0.8064, 1, 950),
        InstanceType("c6id.8xlarge", 32, 64, 0, None, 0, 1.6128, 1, 1900),
        InstanceType("c6id.16xlarge", 64, 128, 0, None, 0, 3.2256, 2, 1900),
        InstanceType("c6id.32xlarge", 128, 256, 0, None, 1, 6.4512, 4, 1900),
        InstanceType("m6id.4xlarge", 16, 64, 0, None, 0, 0.9492, 1, 950),
        # Burstable: listed so the validator can name the problem rather than "unknown type".
        InstanceType("t3.medium", 2, 4, 0, None, 0, 0.0416),
        InstanceType("t3.large", 2, 8, 0, None, 0, 0.0832),
        InstanceType("t3.xlarge", 4, 16, 0, None, 0, 0.1664),
    )
}


def lookup(name: str) -> InstanceType | None:
    """The catalogue entry for ``name``, or None if this project does not know the type."""
    return CATALOG.get(name)
