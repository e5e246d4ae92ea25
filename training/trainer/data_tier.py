"""The data-tier controller beside the trainer: built on global rank 0 only, for an elastic
dataprep group, when the launcher names a backend (``--autoscale``)."""

from __future__ import annotations

import logging
from typing import Any

from training.common.jobrecord import JobRecord
from training.dataplane.autoscale import Autoscaler, Decision, actuator_from_arg, policy_for
from training.trainer.config import InputKind, TrainerConfig

log = logging.getLogger(__name__)


def build_autoscaler(config: TrainerConfig, stream: Any, rank: int) -> Autoscaler | None:
    """The controller, or None: not rank 0, no data plane, no elastic group or no backend.
    Its decisions also go to the job record where the job keeps one (checkpoints in S3)."""
    backend = config.input.autoscale
    if rank != 0 or config.input.kind is not InputKind.DATAPLANE or not backend:
        return None
    policy = policy_for(config.spec)
    if policy is None:
        log.info("--autoscale %s: no dataprep group is elastic; the count stays", backend)
        return None
    pool = stream.client.pool
    group = next(g for g in config.spec.dataprep_groups if g.name == policy.group)
    record = None
    if config.checkpoint.s3_uri:
        record = JobRecord(config.checkpoint.s3_uri)

    def on_decision(decision: Decision) -> None:
        if record is not None:
            record.add_decision(decision.as_dict())

    return Autoscaler(
        policy,
        actuator_from_arg(backend, group.count, record.leaving if record is not None else None),
        pool.server_loads,
        run_dir=config.run_dir,
        start_count=group.count,
        on_decision=on_decision,
    )
