"""The trainer's configuration: typed, built once from the cluster spec and the command line.

``TrainerConfig.from_spec`` is the only place that reads the spec for the trainer; everything
downstream takes the dataclasses here. Problems are raised together as one ``ConfigError`` whose
lines name the spec field or flag to change.
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.common.names import (
    ENV_BUDGET_DEADLINE,
    ENV_CLUSTER,
    ENV_INIT_URI,
    ENV_SAMPLE_LOG_DIR,
)
from training.common.s3 import is_s3_uri, parse_s3_uri
from training.dataplane.discovery import parse_discovery
from training.spec import ClusterSpec, GradCompression, Parallelism, Precision
from training.trainer.classes import ClassCountError, resolve_num_classes

ENV_COLLECTIVE_TIMEOUT = "HETERO_COLLECTIVE_TIMEOUT_S"
"""Seconds a rank waits in a training collective (gradients, the per-step flags) for its peers
before it fails (default 60): a lost peer ends the job within about a minute."""
ENV_CHECKPOINT_TIMEOUT = "HETERO_CHECKPOINT_TIMEOUT_S"
"""Seconds a rank waits in a checkpoint collective (DCP save/load, the agreements around uploads
and downloads) for its peers (default 600): a slow upload is not a lost peer."""
ENV_FINAL_SAVE_RETRY = "HETERO_FINAL_SAVE_RETRY_S"
"""Seconds the last checkpoint of a run (a graceful stop, the end) keeps retrying a failing
save before the run counts as failed (default 60)."""
ENV_MIN_STEP_S = "HETERO_MIN_STEP_S"
"""A pace for the trainer (tests and rehearsals: a stand-in for a slower or faster GPU): each
optimizer step takes at least this long, data waits aside. ``S`` or ``S,STEP:S2[,...]`` (from
that step on, S2)."""


class ConfigError(ValueError):
    """The trainer cannot run with this spec and these flags; each line names what to change."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"trainer configuration is invalid:\n{lines}")


class InputKind(enum.StrEnum):
    """Where batches come from."""

    DATAPLANE = "dataplane"
    """gRPC data servers (``--data-servers``): augmentation runs on other instances."""
    LOCAL = "local"
    """``training.data.local_loader``: same dataset and recipe, augmented on this host."""
    SYNTHETIC = "synthetic"
    """In-memory uint8 batches with no augmentation: tests and loop-overhead benchmarks."""


@dataclass(frozen=True)
class ModelConfig:
    name: str
    """timm model name, or one of ``training.trainer.model.PRESETS``."""
    overrides: Mapping[str, Any]
    """Keyword arguments for ``timm.create_model`` (``job.model.overrides``)."""
    image_size: int
    """Side of the square input (``job.dataset.image_size``)."""
    num_classes: int
    """Classifier width: ``job.dataset.num_classes``, or the data's (``trainer.classes``)."""
    init: str | None = None
    """Start from these weights (``job.model.init``): ``timm:NAME.TAG``, a hub-form folder or a
    weights file, a path or ``s3://`` URI (``training.trainer.init_weights``);
    ``training.trainer.model`` loads it."""
    init_uri: str | None = None
    """Where ``init``'s files are read instead (``HETERO_INIT_URI``: the copy of a ``timm:`` init
    staged in S3, ``training.common.timm_hub``); None: where ``init`` says."""
    init_ema: bool = True
    """From a ``train.py`` checkpoint, its EMA weights when it has them (``job.model.init_ema``)."""
    drop_rate: float | None = None
    """``timm.create_model(drop_rate=...)`` (``job.model.drop_rate``); None: the model's."""
    drop_path_rate: float | None = None
    """``timm.create_model(drop_path_rate=...)`` (``job.model.drop_path_rate``); None: the
    model's."""


@dataclass(frozen=True)
class ParallelConfig:
    strategy: Parallelism
    """``ddp``, ``fsdp`` (FSDP2 over all ranks) or ``hsdp`` (shard in a node, replicate across)."""
    shard_degree: int | None
    """HSDP: ranks per shard group (default: ranks per node, torchrun's LOCAL_WORLD_SIZE)."""
    replicate_degree: int | None
    """HSDP: replica count (default: world size / shard degree)."""
    grad_compression: GradCompression = GradCompression.NONE
    """DDP: ``bf16`` all-reduces gradients in bf16 (``job.parallelism.grad_compression``)."""


@dataclass(frozen=True)
class CheckpointConfig:
    dir: Path
    """Where ``step-N/`` folders go (a local or shared filesystem path); with ``s3_uri``, this
    host's staging folder for them."""
    interval_steps: int
    """Save every N optimizer steps; also on SIGTERM and at the end of the run."""
    keep: int
    """Complete checkpoints kept; older ones are deleted after a new one completes."""
    s3_uri: str | None = None
    """``s3://bucket/prefix``: checkpoints live there (every host uploads its shards; resume
    downloads the newest complete step on every host)."""
    async_save: bool = False
    """Periodic saves write in the background (``job.checkpoint.async_save``)."""
    final_save_retry_s: float = 60.0
    """How long the last save of a run retries before the run counts as failed
    (``HETERO_FINAL_SAVE_RETRY_S``)."""


@dataclass(frozen=True)
class Timeouts:
    """Bounded waits for peers, in seconds (environment: ``HETERO_COLLECTIVE_TIMEOUT_S``,
    ``HETERO_CHECKPOINT_TIMEOUT_S``)."""

    collective_s: float = 60.0
    """Training collectives: the default process group and the per-step flag group."""
    checkpoint_s: float = 600.0
    """The checkpoint group: DCP save/load and the agreements around uploads and downloads."""


@dataclass(frozen=True)
class InputConfig:
    kind: InputKind
    data_servers: str = ""
    """Where the data servers are (``dataplane`` only): ``host:port,...``, ``file:PATH``,
    ``ec2[:CLUSTER]``, ``sagemaker[:PATH]`` or ``loopback`` (``training.dataplane.discovery``)."""
    autoscale: str = ""
    """Where the data-tier controller acts (``dataplane`` with an elastic dataprep group):
    ``file:PATH``, ``asg:NAME`` or ``report`` (``training.dataplane.autoscale``); empty: none."""


@dataclass(frozen=True)
class TrainerConfig:
    """Everything one trainer run needs; validated at construction by ``from_spec``."""

    spec: ClusterSpec
    """Kept for prices (samples per dollar) and for the data modules, which take the job."""
    run_dir: Path
    """Metrics (``metrics.jsonl``, ``metrics.png``, ``summary.json``) go here."""
    model: ModelConfig
    parallel: ParallelConfig
    checkpoint: CheckpointConfig
    input: InputConfig
    batch_size: int
    """Per rank, per micro-step (``job.batch_size``)."""
    grad_accum_steps: int
    total_steps: int | None
    """Optimizer steps to run; None: run ``epochs`` epochs."""
    epochs: int | None
    max_seconds: float | None
    """Stop (with a checkpoint) after this much training time."""
    bf16: bool
    """bf16 autocast; only ever applied on CUDA (CPU runs stay fp32)."""
    compile: bool
    seed: int
    log_every_steps: int
    timeouts: Timeouts = Timeouts()
    sample_log_dir: Path | None = None
    """Where each rank logs the sample ids of every applied step (``HETERO_SAMPLE_LOG_DIR``)."""
    emf_cluster: str | None = None
    """When set, rank 0 also prints each logged interval as a CloudWatch Embedded Metric Format
    line on stdout, with this ``Cluster`` dimension (``training.trainer.emf``): on by default
    where ``HETERO_CLUSTER`` is set (the stack's user data sets it), or with ``--emf``; None
    (local runs, ``--no-emf``): no such lines."""
    deadline: float | None = None
    """Stop (with a checkpoint) at this wall-clock time, epoch seconds: the job's budget
    (``HETERO_BUDGET_DEADLINE``, from the launcher: ``training.costs.budget``). Absolute, so
    the trainer's own start-up counts against it."""
    min_step_s: tuple[tuple[int, float], ...] = ()
    """``(from step, seconds)``: the least time an optimizer step takes, data waits aside
    (``HETERO_MIN_STEP_S``; empty: no pace)."""

    def pace_at(self, step: int) -> float:
        """The least seconds step ``step`` (1-based) takes."""
        return next((s for start, s in reversed(self.min_step_s) if step >= start), 0.0)

    @classmethod
    def from_spec(
        cls,
        spec: ClusterSpec,
        *,
        run_dir: str | Path,
        data_servers: Sequence[str] | str = (),
        steps: int | None = None,
        max_seconds: float | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_s3_uri: str | None = None,
        synthetic: bool = False,
        emf: bool | None = None,
        environ: Mapping[str, str] | None = None,
        autoscale: str = "",
    ) -> TrainerConfig:
        """Build and validate the trainer's view of ``spec``; flags win over spec fields.
        ``environ`` (default: this process's environment) gives the ``HETERO_*`` settings.
        ``emf``: True/False force EMF metric lines on/off; None: on where ``HETERO_CLUSTER``
        is set. Their ``Cluster`` dimension is ``HETERO_CLUSTER``, else the spec's name."""
        job = spec.job
        env = os.environ if environ is None else environ
        problems: list[str] = []

        def seconds(name: str, default: float) -> float:
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                value = float(raw)
            except ValueError:
                value = math.nan
            if not math.isfinite(value) or value <= 0:
                problems.append(f"{name} must be a positive number of seconds, got {raw!r}")
                return default
            return value

        timeouts = Timeouts(
            collective_s=seconds(ENV_COLLECTIVE_TIMEOUT, Timeouts.collective_s),
            checkpoint_s=seconds(ENV_CHECKPOINT_TIMEOUT, Timeouts.checkpoint_s),
        )
        final_retry = seconds(ENV_FINAL_SAVE_RETRY, CheckpointConfig.final_save_retry_s)
        sample_log = env.get(ENV_SAMPLE_LOG_DIR, "").strip()
        deadline: float | None = None
        raw_deadline = env.get(ENV_BUDGET_DEADLINE, "").strip()
        if raw_deadline:
            try:
                deadline = float(raw_deadline)
            except ValueError:
                deadline = math.nan
            if not math.isfinite(deadline):
                problems.append(
                    f"{ENV_BUDGET_DEADLINE} must be epoch seconds, got {raw_deadline!r}"
                )
                deadline = None
        try:
            pace = parse_pace(env.get(ENV_MIN_STEP_S, ""))
        except ValueError as e:
            problems.append(f"{ENV_MIN_STEP_S}: {e}")
            pace = ()
        cluster_env = env.get(ENV_CLUSTER, "").strip()
        init_uri = env.get(ENV_INIT_URI, "").strip() or None
        if init_uri is not None and not job.model.init:
            problems.append(
                f"{ENV_INIT_URI} = {init_uri!r} names a staged copy of job.model.init, but the "
                "spec has no init; unset it or give the spec that was deployed"
            )
        # EMF lines only where CloudWatch Logs reads stdout (the stack sets HETERO_CLUSTER) or
        # where asked for; a local run's console stays free of them.
        emf_on = emf if emf is not None else bool(cluster_env)
        emf_cluster = (cluster_env or spec.name) if emf_on else None
        if steps is not None and steps < 1:
            problems.append(f"--steps must be at least 1, got {steps}")
        if max_seconds is not None and max_seconds <= 0:
            problems.append(f"--max-seconds must be positive, got {max_seconds}")
        if isinstance(data_servers, str):
            servers = data_servers.strip()
        else:
            servers = ",".join(s.strip() for s in data_servers if s.strip())
        if servers:
            try:
                parse_discovery(servers, spec)
            except ValueError as e:
                problems.append(f"--data-servers: {e}")
        if synthetic and servers:
            problems.append("--synthetic-data and --data-servers exclude each other; pick one")
        ckpt_field = "--checkpoint-dir" if checkpoint_dir is not None else "job.checkpoint.dir"
        ckpt = str(checkpoint_dir) if checkpoint_dir is not None else job.checkpoint.dir
        s3_uri = checkpoint_s3_uri.strip() if checkpoint_s3_uri else None
        if is_s3_uri(ckpt):
            if s3_uri is not None and s3_uri.rstrip("/") != ckpt.rstrip("/"):
                problems.append(
                    f"{ckpt_field} = {ckpt!r} and --checkpoint-s3-uri = {s3_uri!r} name two "
                    "buckets; give the S3 URI once (--checkpoint-dir is then the local folder)"
                )
            # The S3 URI is the checkpoint; the shards are staged in a folder of the run.
            s3_uri, ckpt = ckpt, str(Path(run_dir) / "checkpoint-staging")
        if s3_uri is not None:
            try:
                parse_s3_uri(s3_uri)
            except ValueError as e:
                problems.append(f"--checkpoint-s3-uri: {e}")
        overrides = dict(job.model.overrides)
        try:
            num_classes = resolve_num_classes(job.dataset)
        except ClassCountError as e:
            problems.append(str(e))
            num_classes = job.dataset.num_classes or 0
        dataset_values = {"image_size": job.dataset.image_size, "num_classes": num_classes}
        for key, ds_key in (("img_size", "image_size"), ("num_classes", "num_classes")):
            value = overrides.get(key)
            expected = dataset_values[ds_key]
            if value is not None and value != expected:
                problems.append(
                    f"job.model.overrides.{key} = {value} but job.dataset.{ds_key} = {expected}; "
                    f"make them equal (or drop the override: it defaults to the dataset's)"
                )
        chans = overrides.get("in_chans", 3)
        if chans != 3:
            problems.append(
                f"job.model.overrides.in_chans = {chans!r}, but the trainer feeds RGB images (3 "
                "channels); remove it (init weights of other channels are adapted by timm)"
            )
        total = steps if steps is not None else job.total_steps
        if problems:
            raise ConfigError(problems)
        if synthetic:
            kind = InputKind.SYNTHETIC
        elif servers:
            kind = InputKind.DATAPLANE
        else:
            kind = InputKind.LOCAL
        return cls(
            spec=spec,
            run_dir=Path(run_dir),
            model=ModelConfig(
                name=job.model.name,
                overrides=overrides,
                image_size=job.dataset.image_size,
                num_classes=num_classes,
                init=job.model.init,
                init_uri=init_uri,
                init_ema=job.model.init_ema,
                drop_rate=job.model.drop_rate,
                drop_path_rate=job.model.drop_path_rate,
            ),
            parallel=ParallelConfig(
                strategy=job.parallelism.strategy,
                shard_degree=job.parallelism.shard_degree,
                replicate_degree=job.parallelism.replicate_degree,
                grad_compression=job.parallelism.grad_compression,
            ),
            checkpoint=CheckpointConfig(
                dir=Path(ckpt),
                interval_steps=job.checkpoint.interval_steps,
                keep=job.checkpoint.keep,
                s3_uri=s3_uri,
                async_save=job.checkpoint.async_save,
                final_save_retry_s=final_retry,
            ),
            input=InputConfig(kind=kind, data_servers=servers, autoscale=autoscale),
            batch_size=job.batch_size,
            grad_accum_steps=job.grad_accum_steps,
            total_steps=total,
            epochs=None if steps is not None else job.epochs,
            max_seconds=max_seconds,
            deadline=deadline,
            bf16=job.precision is Precision.BF16,
            compile=job.compile,
            seed=job.seed,
            log_every_steps=job.log_every_steps,
            timeouts=timeouts,
            sample_log_dir=Path(sample_log) if sample_log else None,
            emf_cluster=emf_cluster,
            min_step_s=pace,
        )


def parse_pace(raw: str) -> tuple[tuple[int, float], ...]:
    """``HETERO_MIN_STEP_S``: ``S`` or ``S,STEP:S2,...`` -> ``((1, S), (STEP, S2), ...)``."""
    raw = raw.strip()
    if not raw:
        return ()
    pace: list[tuple[int, float]] = []
    for i, part in enumerate(raw.split(",")):
        step_text, _, seconds_text = part.strip().rpartition(":")
        try:
            step = int(step_text) if step_text else 1
            seconds = float(seconds_text)
        except ValueError:
            step, seconds = -1, math.nan
        if (i == 0) != (not step_text) or not math.isfinite(seconds) or seconds < 0 or step < 1:
            raise ValueError(
                f"{raw!r} is not S or S,STEP:S2,... (seconds >= 0, steps rising from 2), "
                "e.g. 0.1,300:0.4"
            )
        if pace and step <= pace[-1][0]:
            raise ValueError(f"{raw!r}: steps must rise, {step} follows {pace[-1][0]}")
        pace.append((step, seconds))
    return tuple(pace)
