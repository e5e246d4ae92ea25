"""Communication time per optimizer step, against compute time per step.

Per step, each trainer instance sends and receives (all-reduce as a ring; N instances, G GPUs
each, P parameters, ``gb`` bytes per gradient element, ``pb`` per bf16/fp32 parameter):

- DDP: between instances ``2 (N-1)/N x P x gb`` over the instance's baseline bandwidth; inside
  the instance ``2 (G-1)/G x P x gb`` over NVLink or PCIe (``priors.INTRA_NODE_*``);
- FSDP (*estimate*): parameters all-gathered for forward and backward and gradients
  reduce-scattered, ``(N-1)/N x P x (2 pb + gb)`` between instances, ``(G-1)/G x ...`` inside;
- HSDP: sharded inside the instance (as FSDP with N = 1), replicated across instances (as DDP);
- the data stream: ``G x batch x accumulation x H x W x 3`` bytes of uint8 pixels into the
  instance over the same link, each gRPC stream at most one flow's 10 Gbps.

The all-reduce overlaps backward and the data stream is prefetched, so a step takes
``max(compute, communication)``; a configuration whose communication exceeds its compute is
"network-bound" and keeps its (slower) rank with a note on how to fix it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from training.planner.facts import Facts
from training.planner.workload import Workload
from training.spec import Parallelism


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    inter_node_s: float
    intra_node_s: float
    data_s: float

    @property
    def all_reduce_s(self) -> float:
        return self.inter_node_s + self.intra_node_s

    @property
    def comm_s(self) -> float:
        return self.all_reduce_s + self.data_s

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.comm_s)

    @property
    def network_bound(self) -> bool:
        return self.comm_s > self.compute_s


def sync_bytes(workload: Workload, instances: int, gpus: int) -> tuple[float, float]:
    """(bytes each instance moves between instances, bytes between its own GPUs) per step."""
    p, gb, pb = workload.params, workload.grad_bytes_per_param, workload.param_bytes_per_param

    def ring(k: int) -> float:
        return (k - 1) / k if k > 1 else 0.0

    if workload.strategy is Parallelism.DDP:
        return 2 * ring(instances) * p * gb, 2 * ring(gpus) * p * gb
    if workload.strategy is Parallelism.FSDP:
        return ring(instances) * p * (2 * pb + gb), ring(gpus) * p * (2 * pb + gb)
    return 2 * ring(instances) * p * gb, ring(gpus) * p * (2 * pb + gb)  # HSDP


def step_time(
    instance_type: str,
    instances: int,
    gpu_samples_per_s: float,
    workload: Workload,
    facts: Facts,
) -> StepTime:
    """Compute, all-reduce and data time of one optimizer step on ``instances`` x type."""
    gpus = max(1, facts.instance(instance_type).gpus)
    link = facts.bandwidth_gbps(instance_type) * 1e9 / 8
    inter, intra = sync_bytes(workload, instances, gpus)
    data_bytes = gpus * workload.samples_per_rank_step * workload.bytes_per_sample
    # Each rank's stream is one TCP flow per data server (at least one server).
    data_link = min(link, gpus * workload.streams_per_server * facts.single_flow_gbps * 1e9 / 8)
    return StepTime(
        compute_s=workload.samples_per_rank_step / gpu_samples_per_s,
        inter_node_s=inter / link,
        intra_node_s=intra / facts.intra_node_bytes_per_s(instance_type) if intra else 0.0,
        data_s=data_bytes / data_link,
    )


def network_advice(step: StepTime, workload: Workload) -> str:
    """What would make a network-bound configuration compute-bound again."""
    per_micro = workload.grad_accum_steps
    compute, data = step.compute_s / per_micro, step.data_s / per_micro
    parts = [
        f"network-bound: all-reduce {step.all_reduce_s:.3g} s + data {step.data_s:.3g} s > "
        f"compute {step.compute_s:.3g} s per step"
    ]
    if data >= compute:
        parts.append("the data stream alone outruns compute: a faster link is needed")
    else:
        k = math.ceil(step.all_reduce_s / (compute - data))
        if k > per_micro:
            parts.append(f"try job.grad_accum_steps >= {k}")
    if workload.strategy is Parallelism.DDP and not workload.grad_compression:
        parts.append("or job.parallelism.grad_compression = 'bf16' (half the all-reduce bytes)")
    return "; ".join(parts)
