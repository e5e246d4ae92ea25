"""The planner's throughput model for CPU cores on one machine: a trainer on some cores fed by
data servers on others, as ``hetero local`` and the offload benchmark run it.

The same terms as for a cluster (``dataplane``), with the core counts fixed instead of planned:

- trainer side: the trainer's own step on its ``T`` cores takes ``T / R`` core-seconds per
  sample (``R``: samples/s measured by ``hetero bench`` on ``T`` cores, synthetic batches), and
  receiving the stream takes ``1 / r_recv`` more on the same cores:
  ``trainer side = T / (T / R + 1 / r_recv)``;
- data side: each augmentation worker is one process, so the servers use at most
  ``min(servers x workers, server cores)`` cores at ``r_aug`` images/s per core (measured on
  the server's whole process tree, so its gRPC and serialisation work are in it). And one
  server delivers at most ``d`` images/s, what it delivered to an otherwise idle client in
  ``hetero bench`` with the same workers and the spec's streams, reorder window and range size
  (its pipeline limit: between ranges, a stream's server waits for the next request):
  ``supply = min(min(servers x workers, server cores) x r_aug, servers x d)``;
- ``samples/s = min(trainer side, supply)``, and whichever is smaller is the bound.

Checked against real runs by ``python -m benchmarks planner`` (README, "Planner: predicted
against measured").
"""

from __future__ import annotations

from dataclasses import dataclass

from training.planner.dataplane import scaled_rate
from training.planner.errors import PlanError
from training.planner.results import Measured
from training.planner.workload import Workload


@dataclass(frozen=True)
class LocalTopology:
    trainer_cores: int
    servers: int
    server_cores: int
    """Cores the data servers share (all of them pinned to the same set)."""
    workers_per_server: int

    def __post_init__(self) -> None:
        for name in ("trainer_cores", "servers", "server_cores", "workers_per_server"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def label(self) -> str:
        return (
            f"trainer on {self.trainer_cores} core(s), {self.servers} server(s) x "
            f"{self.workers_per_server} worker(s) on {self.server_cores} core(s)"
        )


@dataclass(frozen=True)
class LocalPrediction:
    samples_per_s: float
    trainer_side: float
    supply: float
    bound: str
    """``trainer`` or ``data``."""
    sources: tuple[str, ...]


def predict_local(
    topology: LocalTopology, workload: Workload, measured: Measured, device: str
) -> LocalPrediction:
    """Samples/s of ``topology`` for ``workload``, from the measured figures for ``device``
    (the CPU model as ``hetero bench`` keys it, without the ``xN`` core count)."""
    key = f"{device} x{topology.trainer_cores}"
    trainer = measured.trainer_result(
        "", key, workload.model, workload.image_size, workload.precision.value, workload.params
    )
    if trainer is None:
        raise PlanError(
            f"no measured trainer rate for {workload.model} at {workload.image_size} px "
            f"({workload.precision.value}) on {key}; run hetero bench --trainer-cores with "
            f"{topology.trainer_cores} core(s) first"
        )
    rate, px, aug_source = measured.augment_rate(workload.recipe, workload.image_size)
    augment = scaled_rate(rate, px, workload.image_size)
    rate, px, receive_source = measured.receive_rate(workload.image_size)
    receive = scaled_rate(rate, px, workload.image_size)
    cores = topology.trainer_cores
    trainer_side = cores / (cores / trainer.samples_per_s_per_device + 1 / receive)
    parallel = min(topology.servers * topology.workers_per_server, topology.server_cores)
    supply = parallel * augment
    sources = [
        f"trainer {trainer.samples_per_s_per_device:.1f} samples/s: {trainer.describe()}",
        f"augmentation {augment:.1f} images/s per core: {aug_source}",
        f"receive {receive:.0f} images/s per core: {receive_source}",
    ]
    delivered = measured.server_images_per_s.get(workload.recipe)
    if delivered is not None and delivered[2] == topology.workers_per_server:
        rate, px, _, source = delivered
        per_server = scaled_rate(rate, px, workload.image_size)
        supply = min(supply, topology.servers * per_server)
        sources.append(f"one server delivers {per_server:.1f} images/s: {source}")
    bound = "trainer" if trainer_side <= supply else "data"
    return LocalPrediction(
        samples_per_s=min(trainer_side, supply),
        trainer_side=trainer_side,
        supply=supply,
        bound=bound,
        sources=tuple(sources),
    )
