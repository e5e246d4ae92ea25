"""Expected progress under Spot interruptions, and the checkpoint interval that maximises it.

For a Spot trainer group of N instances, each interrupted at rate ``lambda`` per second (its
Spot Instance Advisor band's midpoint, per 730-hour month):

- ``M = 1 / (N x lambda)``: mean time between interruptions of the cluster (any instance's
  interruption stops every rank until the job re-forms);
- ``C``: training time lost per checkpoint (the S3 save, or the async save's stall), measured
  for ViT-B/16 + AdamW and scaled by parameters;
- ``R``: recovery per interruption, the rehearsal's measured recovery plus the replacement
  instance's launch (a prior);
- ``d``: for async saves, the extra time until a save is durable (work since the previous
  durable checkpoint is lost meanwhile); 0 for synchronous saves;
- Young's interval ``tau = sqrt(2 C M)`` (J. W. Young, "A first order approximation to the
  optimum checkpoint interval", CACM 17(9), 1974) and Daly's first-order expected efficiency
  ``1 - C/tau - (tau/2 + d + R)/M`` (J. T. Daly, "A higher order estimate of the optimum
  checkpoint interval for restart dumps", FGCS 22(3), 2006): a save costs C every tau, and each
  interruption loses half an interval of work on average plus the recovery.

This counts every interruption as losing work since the last checkpoint. The launcher also
checkpoints on the two-minute notice (the rehearsal redid 0 steps), so it is the worst case:
the expected figures are a lower bound where notices arrive in time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from training.planner.facts import Facts
from training.planner.results import Measured
from training.planner.workload import Workload


@dataclass(frozen=True)
class Preemption:
    band: str
    rate_per_month: float
    """Interruptions per instance per month (the band's midpoint)."""
    mtbi_s: float
    """Mean time between interruptions of the whole group."""
    checkpoint_s: float
    durable_lag_s: float
    recovery_s: float
    interval_s: float
    """Young's optimal checkpoint interval."""
    efficiency: float
    """Expected share of wall time that advances training (Daly, first order)."""


def checkpoint_costs(workload: Workload, facts: Facts, measured: Measured) -> tuple[float, float]:
    """(C, d): stall per checkpoint and extra time to durability, scaled to the model."""
    scale = workload.params / facts.checkpoint_reference_params
    s3 = measured.checkpoint_s3_s[0] * scale
    if workload.async_checkpoint:
        return measured.checkpoint_async_stall_s[0] * scale, s3
    return s3, 0.0


def preemption(
    instance_type: str, instances: int, workload: Workload, facts: Facts, measured: Measured
) -> Preemption:
    """Young/Daly for a Spot group of ``instances`` x ``instance_type``."""
    band, rate = facts.interruption(instance_type)
    mtbi = facts.seconds_per_month / (rate * instances)
    c, d = checkpoint_costs(workload, facts, measured)
    r = facts.recovery_s + facts.replacement_s
    tau = math.sqrt(2 * c * mtbi)
    efficiency = 1 - c / tau - (tau / 2 + d + r) / mtbi
    return Preemption(band, rate, mtbi, c, d, r, tau, efficiency)
