"""A dated, offline catalogue of the EC2 instance types this project knows.

The spec validator uses it to refuse impossible clusters before anything is deployed (EFA asked
for on a type without it, burstable types in a cluster placement group, unknown types); the
infrastructure uses it to add one EFA interface per network card; metrics and the planner use
its On-Demand prices when the spec gives none.

Prices are us-east-1 Linux On-Demand list prices in USD per hour, as of ``PRICES_AS_OF``: the
Price List API's figures as aws/karpenter-provider-aws recorded them on that date
(``pkg/providers/pricing/zz_generated.pricing_aws.go``, "generated at 2026-07-20T13:44:30Z for
us-east-1"; p4d and p4de after AWS's June 2025 price cut). They drift: pass explicit prices in
the spec (``[job.prices]``) for figures you will act on.
"""

from __future__ import annotations

from dataclasses import dataclass

PRICES_AS_OF = "2026-07-20"
PRICES_REGION = "us-east-1"


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


CATALOG: dict[str, InstanceType] = {
    t.name: t
    for t in (
        # GPU: trainer groups.
        InstanceType("p5.48xlarge", 192, 2048, 8, "H100", 32, 55.04),
        InstanceType("p4de.24xlarge", 96, 1152, 8, "A100-80GB", 4, 27.44705),
        InstanceType("p4d.24xlarge", 96, 1152, 8, "A100", 4, 21.957642),
        InstanceType("p3dn.24xlarge", 96, 768, 8, "V100", 1, 31.212),
        InstanceType("p3.2xlarge", 8, 61, 1, "V100", 0, 3.06),
        InstanceType("p3.8xlarge", 32, 244, 4, "V100", 0, 12.24),
        InstanceType("p3.16xlarge", 64, 488, 8, "V100", 0, 24.48),
        InstanceType("g6e.xlarge", 4, 32, 1, "L40S", 0, 1.861),
        InstanceType("g6e.12xlarge", 48, 384, 4, "L40S", 1, 10.493),
        InstanceType("g6.xlarge", 4, 16, 1, "L4", 0, 0.8048),
        InstanceType("g6.2xlarge", 8, 32, 1, "L4", 0, 0.9776),
        InstanceType("g6.4xlarge", 16, 64, 1, "L4", 0, 1.3232),
        InstanceType("g6.8xlarge", 32, 128, 1, "L4", 1, 2.0144),
        InstanceType("g6.12xlarge", 48, 192, 4, "L4", 1, 4.6016),
        InstanceType("g6.48xlarge", 192, 768, 8, "L4", 1, 13.3504),
        InstanceType("g5.xlarge", 4, 16, 1, "A10G", 0, 1.006),
        InstanceType("g5.2xlarge", 8, 32, 1, "A10G", 0, 1.212),
        InstanceType("g5.4xlarge", 16, 64, 1, "A10G", 0, 1.624),
        InstanceType("g5.8xlarge", 32, 128, 1, "A10G", 1, 2.448),
        InstanceType("g5.12xlarge", 48, 192, 4, "A10G", 1, 5.672),
        InstanceType("g5.24xlarge", 96, 384, 4, "A10G", 1, 8.144),
        InstanceType("g5.48xlarge", 192, 768, 8, "A10G", 1, 16.288),
        InstanceType("g4dn.xlarge", 4, 16, 1, "T4", 0, 0.526),
        InstanceType("g4dn.12xlarge", 48, 192, 4, "T4", 1, 3.912),
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
        # Burstable: listed so the validator can name the problem rather than "unknown type".
        InstanceType("t3.medium", 2, 4, 0, None, 0, 0.0416),
        InstanceType("t3.large", 2, 8, 0, None, 0, 0.0832),
        InstanceType("t3.xlarge", 4, 16, 0, None, 0, 0.1664),
    )
}


def lookup(name: str) -> InstanceType | None:
    """The catalogue entry for ``name``, or None if this project does not know the type."""
    return CATALOG.get(name)
