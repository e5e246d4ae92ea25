"""The cluster spec: one typed TOML file that both the CDK app and the launcher read.

``load_spec(path)`` parses and validates the whole file once. Every problem found is reported
together in one ``SpecError`` whose lines name the field (``groups[1].count``) and the fix, so a
bad spec fails before anything is deployed or launched.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar, cast

from training import instance_types

DEFAULT_SPEC_PATH = Path("cluster.toml")
_NAME_RE = re.compile(r"[a-z][a-z0-9-]{0,30}")
"""Cluster names: they become CloudFormation stack names (``<name>-cluster``), which allow
letters, digits and '-' only."""
_GROUP_NAME_RE = re.compile(r"[a-z][a-z0-9_-]{0,30}")
"""Group names also allow '_' (SageMaker heterogeneous-cluster examples use names such as
``dnn_group``); every place a group name goes accepts it: Auto Scaling group names, tags, CDK
construct ids, SageMaker ``InstanceGroupName``, log stream names and IAM ARNs."""
_T = TypeVar("_T")


class SpecError(ValueError):
    """The spec is invalid. ``problems`` holds one line per field: what is wrong and the fix."""

    def __init__(self, problems: list[str], source: str = "cluster spec") -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source} is invalid ({len(problems)} problem(s)):\n{lines}")


class Role(StrEnum):
    TRAINER = "trainer"
    DATAPREP = "dataprep"


class Market(StrEnum):
    SPOT = "spot"
    ON_DEMAND = "on-demand"


class Efa(StrEnum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


class Parallelism(StrEnum):
    DDP = "ddp"
    FSDP = "fsdp"
    HSDP = "hsdp"


class GradCompression(StrEnum):
    """How DDP all-reduces gradients: ``none`` in their own dtype; ``bf16`` cast to bf16 for the
    all-reduce (torch's ``bf16_compress_hook``: half the bytes, bf16 precision)."""

    NONE = "none"
    BF16 = "bf16"


class DatasetSource(StrEnum):
    SYNTHETIC = "synthetic"
    FOLDER = "folder"
    S3 = "s3"


class Recipe(StrEnum):
    """Augmentation recipes: ``standard`` is decode + RandomResizedCrop + flip; ``randaugment``
    adds timm's RandAugment on top (several times the CPU cost per image)."""

    STANDARD = "standard"
    RANDAUGMENT = "randaugment"


class Precision(StrEnum):
    BF16 = "bf16"
    FP32 = "fp32"


@dataclass(frozen=True)
class InstanceGroup:
    """One group of identical-role instances (one Auto Scaling group on EC2)."""

    name: str
    """Group name: tags, Auto Scaling group name and SageMaker instance group name."""
    role: Role
    """``trainer`` runs torchrun with the ViT trainer; ``dataprep`` runs the gRPC data server."""
    instance_types: tuple[str, ...]
    """Ordered by preference; Spot groups may get any of them."""
    count: int
    """Number of instances."""
    market: Market = Market.SPOT
    efa: Efa = Efa.AUTO
    """``auto``: EFA where every listed type has it; ``on``: required; ``off``: never."""
    processes_per_instance: int | None = None
    """Trainer ranks (or data servers) per instance; default: GPUs per instance, or 1."""

    @property
    def use_efa(self) -> bool:
        if self.efa is Efa.OFF:
            return False
        return all(_supports_efa(t) for t in self.instance_types)

    @property
    def gpus_per_instance(self) -> int:
        return instance_types.CATALOG[self.instance_types[0]].gpus

    @property
    def ranks_per_instance(self) -> int:
        if self.processes_per_instance is not None:
            return self.processes_per_instance
        return max(1, self.gpus_per_instance) if self.role is Role.TRAINER else 1


@dataclass(frozen=True)
class ModelSpec:
    name: str = "vit_base_patch16_224"
    """Any timm model name (ViTs are what the project is tuned for)."""
    overrides: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``timm.create_model`` (e.g. ``depth``, ``embed_dim``, ``img_size``)."""


@dataclass(frozen=True)
class DatasetSpec:
    source: DatasetSource = DatasetSource.SYNTHETIC
    path: str | None = None
    """Folder (ImageFolder layout) for ``folder``; ``s3://bucket/prefix/`` for ``s3``."""
    num_samples: int = 50_000
    """Synthetic only: images per epoch."""
    num_classes: int = 1000
    """Synthetic only (folders and S3 prefixes take theirs from the class sub-folders)."""
    image_size: int = 224
    """Side of the square crop the trainer receives."""


@dataclass(frozen=True)
class CheckpointSpec:
    interval_steps: int = 200
    """Save every N optimizer steps (and on SIGTERM / Spot interruption)."""
    dir: str = "runs/checkpoints"
    """Local folder, or ``s3://`` URI on AWS."""
    keep: int = 2
    """Complete checkpoints to keep (older ones are deleted)."""
    async_save: bool = False
    """Write periodic checkpoints in the background (``torch.distributed.checkpoint.async_save``):
    training stalls only while the state is copied to host memory, and the step counts as saved
    once every rank's write (and upload) has finished. Costs one extra copy of the model and
    optimizer state in host memory while a save is in flight."""


@dataclass(frozen=True)
class ParallelismSpec:
    strategy: Parallelism = Parallelism.DDP
    shard_degree: int | None = None
    """HSDP: ranks that shard one replica (default: ranks per trainer instance)."""
    replicate_degree: int | None = None
    """HSDP: number of replicas (default: world size / shard degree)."""
    grad_compression: GradCompression = GradCompression.NONE
    """DDP only: ``bf16`` halves the gradient all-reduce bytes at bf16 precision."""


@dataclass(frozen=True)
class PricesSpec:
    usd_per_hour: Mapping[str, float] = field(default_factory=dict)
    """Explicit prices per instance type; they win over the offline table."""
    spot_price_ratio: float = 0.35
    """Spot price as a share of On-Demand when no explicit price is given (an estimate)."""

    def hourly(self, instance_type: str, market: Market) -> float:
        """USD per hour for one instance of ``instance_type`` in ``market``."""
        if instance_type in self.usd_per_hour:
            return float(self.usd_per_hour[instance_type])
        on_demand = instance_types.CATALOG[instance_type].on_demand_usd_per_hour
        return on_demand * (self.spot_price_ratio if market is Market.SPOT else 1.0)


@dataclass(frozen=True)
class DataPlaneSpec:
    port: int = 50051
    """Port each data server listens on (locally: the first; the others follow)."""
    prefetch_batches: int = 8
    """The reorder window: batches a trainer rank's client requests or holds ahead of the
    trainer (its memory is this many batches; batches reach the trainer in the planned order)."""
    chunk_batches: int = 2
    """Batches per range of positions handed to a data server stream at a time."""
    streams_per_server: int = 1
    """Concurrent streams (each its own connection) from a trainer rank to each data server."""
    refresh_s: float = 5.0
    """How often the trainer asks where the data servers are (joiners get work after this)."""
    wait_for_data_s: float = 600.0
    """How long the trainer waits for a batch while no data server delivers (counted as
    data-wait) before it fails."""
    workers_per_server: int = 0
    """Augmentation worker processes per data server (0: one per core)."""
    rpc_timeout_s: float = 60.0
    """Deadline for each RPC."""
    server_memory_mb: int = 0
    """Bound on batch bytes in flight across all streams of a data server, in MB (0: derived
    from the host's memory)."""


@dataclass(frozen=True)
class JobSpec:
    model: ModelSpec = field(default_factory=ModelSpec)
    batch_size: int = 64
    """Per trainer rank, per micro-step."""
    grad_accum_steps: int = 1
    steps: int | None = None
    """Optimizer steps to run (default 1000 when ``epochs`` is not set either)."""
    epochs: int | None = None
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup_steps: int = 0
    precision: Precision = Precision.BF16
    """bf16 autocast on GPU; CPU runs stay in fp32."""
    compile: bool = False
    """``torch.compile`` the model."""
    seed: int = 0
    log_every_steps: int = 10
    dataset: DatasetSpec = field(default_factory=DatasetSpec)
    augmentation: Recipe = Recipe.STANDARD
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    parallelism: ParallelismSpec = field(default_factory=ParallelismSpec)
    prices: PricesSpec = field(default_factory=PricesSpec)
    dataplane: DataPlaneSpec = field(default_factory=DataPlaneSpec)

    @property
    def total_steps(self) -> int | None:
        """Optimizer steps, or None when the job runs by epochs."""
        if self.steps is not None:
            return self.steps
        return None if self.epochs is not None else 1000


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    """Cluster name: stack names, tags, SageMaker job name prefix."""
    groups: tuple[InstanceGroup, ...]
    job: JobSpec
    availability_zone_index: int = 0
    """Which AZ of the region (by index) holds the placement group and every instance."""
    source: str = "cluster spec"

    @property
    def trainer_group(self) -> InstanceGroup:
        return next(g for g in self.groups if g.role is Role.TRAINER)

    @property
    def dataprep_groups(self) -> tuple[InstanceGroup, ...]:
        return tuple(g for g in self.groups if g.role is Role.DATAPREP)

    def group(self, name: str) -> InstanceGroup:
        for g in self.groups:
            if g.name == name:
                return g
        valid = ", ".join(g.name for g in self.groups)
        raise SpecError([f"no instance group named {name!r}; the spec has: {valid}"], self.source)

    @property
    def world_size(self) -> int:
        g = self.trainer_group
        return g.count * g.ranks_per_instance

    def usd_per_hour(self) -> float:
        """What the whole cluster costs per hour (every group, first listed type)."""
        return sum(
            g.count * self.job.prices.hourly(g.instance_types[0], g.market) for g in self.groups
        )


def _supports_efa(instance_type: str) -> bool:
    entry = instance_types.lookup(instance_type)
    return entry is not None and entry.supports_efa


# --------------------------------------------------------------------------------------------
# Parsing and validation.


class _Reader:
    """Reads typed values out of TOML tables, collecting every problem with its field path."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self._path: list[str] = []

    def where(self, key: str | None = None) -> str:
        parts = [*self._path, key] if key else self._path
        out = ""
        for p in parts:
            out += p if p.startswith("[") or not out else f".{p}"
        return out or "(top level)"

    def problem(self, key: str | None, message: str) -> None:
        self.problems.append(f"{self.where(key)}: {message}")

    @contextmanager
    def at(self, key: str) -> Iterator[None]:
        self._path.append(key)
        try:
            yield
        finally:
            self._path.pop()

    def check_keys(
        self, table: Mapping[str, Any], cls: Any, internal: tuple[str, ...] = ()
    ) -> None:
        allowed = {f.name for f in fields(cls)} - set(internal)
        for key in table:
            if key not in allowed:
                close = difflib.get_close_matches(key, sorted(allowed), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                self.problem(key, f"unknown key{hint}; valid keys: {', '.join(sorted(allowed))}")

    def get(
        self, table: Mapping[str, Any], key: str, kind: type[_T] | tuple[type, ...], default: _T
    ) -> _T:
        if key not in table:
            return default
        value = table[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # TOML integers are valid floats; bools are not ints here.
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            self.problem(key, f"expected {names}, got {type(value).__name__} {value!r}")
            return default
        return cast(_T, value)

    def positive(self, table: Mapping[str, Any], key: str, default: int, minimum: int = 1) -> int:
        value: int = self.get(table, key, int, default)
        if isinstance(value, int) and value < minimum:
            self.problem(key, f"must be at least {minimum}, got {value}")
            return default
        return value

    def choice(self, table: Mapping[str, Any], key: str, enum: type[StrEnum], default: Any) -> Any:
        raw = self.get(table, key, str, None)
        if raw is None:
            return default
        try:
            return enum(raw)
        except ValueError:
            valid = ", ".join(repr(e.value) for e in enum)
            self.problem(key, f"{raw!r} is not valid; use one of {valid}")
            return default

    def table(self, table: Mapping[str, Any], key: str) -> Mapping[str, Any]:
        value = table.get(key, {})
        if not isinstance(value, dict):
            self.problem(key, f"expected a table ([{key}]), got {type(value).__name__}")
            return {}
        return value


def _parse_group(r: _Reader, t: Mapping[str, Any]) -> InstanceGroup | None:
    r.check_keys(t, InstanceGroup)
    name = r.get(t, "name", str, "")
    if not name:
        r.problem("name", 'missing; give the group a name such as "trainer" or "dataprep"')
    elif not _GROUP_NAME_RE.fullmatch(name):
        r.problem(
            "name",
            f"{name!r} must start with a lowercase letter, then lowercase letters, digits, '-' "
            "or '_', 1-31 characters (e.g. 'trainer', 'dnn_group')",
        )
    if "role" not in t:
        r.problem("role", "missing; use 'trainer' or 'dataprep'")
    role = r.choice(t, "role", Role, None)
    types_raw = r.get(t, "instance_types", list, [])
    types: list[str] = []
    if not types_raw:
        r.problem("instance_types", 'missing or empty; list one or more, e.g. ["g5.xlarge"]')
    for i, it in enumerate(types_raw):
        if not isinstance(it, str):
            r.problem(f"instance_types[{i}]", f"expected a string, got {it!r}")
            continue
        types.append(it)
        entry = instance_types.lookup(it)
        if entry is None:
            close = difflib.get_close_matches(it, list(instance_types.CATALOG), n=3)
            hint = f" (close: {', '.join(close)})" if close else ""
            r.problem(
                f"instance_types[{i}]",
                f"unknown instance type {it!r}{hint}; add it to training/instance_types.py "
                "or choose a listed one",
            )
        elif entry.burstable:
            r.problem(
                f"instance_types[{i}]",
                f"{it!r} is burstable (T family) and cannot run in a cluster placement group; "
                "choose a non-burstable type such as c6i.4xlarge",
            )
        elif role is Role.TRAINER and entry.gpus == 0:
            r.problem(
                f"instance_types[{i}]",
                f"{it!r} has no GPU; trainer groups need GPU types (e.g. g5.xlarge, p4d.24xlarge)",
            )
    if "count" not in t:
        r.problem("count", "missing; how many instances the group has (1 or more)")
    count = r.positive(t, "count", 1)
    market = r.choice(t, "market", Market, Market.SPOT)
    efa = r.choice(t, "efa", Efa, Efa.AUTO)
    known = [x for x in types if instance_types.lookup(x) is not None]
    if efa is Efa.ON:
        without = [x for x in known if not instance_types.CATALOG[x].supports_efa]
        if without:
            r.problem(
                "efa",
                f"'on' but {', '.join(without)} has no EFA; remove those types, choose EFA types "
                "(e.g. p4d.24xlarge, g5.8xlarge, c5n.18xlarge) or set efa = 'auto'",
            )
    if role is Role.TRAINER and known:
        gpu_counts = {instance_types.CATALOG[x].gpus for x in known}
        if len(gpu_counts) > 1:
            r.problem(
                "instance_types",
                "trainer types must have the same number of GPUs (ranks per instance must not "
                f"depend on which type Spot delivers); got {sorted(gpu_counts)}",
            )
    ppi_raw = r.get(t, "processes_per_instance", int, 0)
    ppi: int | None = None
    if "processes_per_instance" in t:
        if ppi_raw < 1:
            r.problem("processes_per_instance", f"must be at least 1, got {ppi_raw}")
        else:
            ppi = ppi_raw
    if not name or role is None or not types or len(known) != len(types):
        return None
    return InstanceGroup(
        name=name,
        role=role,
        instance_types=tuple(types),
        count=count,
        market=market,
        efa=efa,
        processes_per_instance=ppi,
    )


def _parse_job(r: _Reader, t: Mapping[str, Any]) -> JobSpec:
    r.check_keys(t, JobSpec)
    d = JobSpec()

    model_t = r.table(t, "model")
    with r.at("model"):
        r.check_keys(model_t, ModelSpec)
        overrides = r.table(model_t, "overrides")
        model = ModelSpec(name=r.get(model_t, "name", str, d.model.name), overrides=overrides)

    ds_t = r.table(t, "dataset")
    with r.at("dataset"):
        r.check_keys(ds_t, DatasetSpec)
        source = r.choice(ds_t, "source", DatasetSource, DatasetSource.SYNTHETIC)
        path = r.get(ds_t, "path", str, None)
        if source is DatasetSource.FOLDER and not path:
            r.problem("path", "source 'folder' needs path = a folder of class sub-folders")
        if source is DatasetSource.S3 and not (path and path.startswith("s3://")):
            r.problem("path", "source 's3' needs path = 's3://bucket/prefix/'")
        dataset = DatasetSpec(
            source=source,
            path=path,
            num_samples=r.positive(ds_t, "num_samples", d.dataset.num_samples),
            num_classes=r.positive(ds_t, "num_classes", d.dataset.num_classes),
            image_size=r.positive(ds_t, "image_size", d.dataset.image_size, minimum=16),
        )

    ck_t = r.table(t, "checkpoint")
    with r.at("checkpoint"):
        r.check_keys(ck_t, CheckpointSpec)
        checkpoint = CheckpointSpec(
            interval_steps=r.positive(ck_t, "interval_steps", d.checkpoint.interval_steps),
            dir=r.get(ck_t, "dir", str, d.checkpoint.dir),
            keep=r.positive(ck_t, "keep", d.checkpoint.keep),
            async_save=r.get(ck_t, "async_save", bool, d.checkpoint.async_save),
        )

    par_t = r.table(t, "parallelism")
    with r.at("parallelism"):
        r.check_keys(par_t, ParallelismSpec)
        strategy = r.choice(par_t, "strategy", Parallelism, Parallelism.DDP)
        shard = r.positive(par_t, "shard_degree", 0) if "shard_degree" in par_t else None
        replicate = (
            r.positive(par_t, "replicate_degree", 0) if "replicate_degree" in par_t else None
        )
        if strategy is not Parallelism.HSDP:
            for key, val in (("shard_degree", shard), ("replicate_degree", replicate)):
                if val is not None:
                    r.problem(key, f"only applies to strategy 'hsdp' (strategy is {strategy})")
        compression = r.choice(par_t, "grad_compression", GradCompression, GradCompression.NONE)
        if compression is not GradCompression.NONE and strategy is not Parallelism.DDP:
            # FSDP2 reduce-scatters in its MixedPrecisionPolicy's reduce dtype, not via DDP hooks.
            r.problem(
                "grad_compression",
                f"'{compression}' only applies to strategy 'ddp' (strategy is {strategy}: it "
                "reduce-scatters gradients in its own dtype); set strategy = 'ddp' or remove "
                "grad_compression",
            )
            compression = GradCompression.NONE
        parallelism = ParallelismSpec(strategy, shard or None, replicate or None, compression)

    pr_t = r.table(t, "prices")
    with r.at("prices"):
        r.check_keys(pr_t, PricesSpec)
        usd = r.table(pr_t, "usd_per_hour")
        clean: dict[str, float] = {}
        with r.at("usd_per_hour"):
            for k, v in usd.items():
                if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
                    r.problem(k, f"expected a price in USD per hour (>= 0), got {v!r}")
                else:
                    clean[k] = float(v)
        ratio = r.get(pr_t, "spot_price_ratio", float, d.prices.spot_price_ratio)
        if not 0 < ratio <= 1:
            r.problem("spot_price_ratio", f"must be in (0, 1], got {ratio}")
            ratio = d.prices.spot_price_ratio
        prices = PricesSpec(usd_per_hour=clean, spot_price_ratio=ratio)

    dp_t = r.table(t, "dataplane")
    with r.at("dataplane"):
        r.check_keys(dp_t, DataPlaneSpec)
        port = r.positive(dp_t, "port", d.dataplane.port)
        if port > 65535:
            r.problem("port", f"must be a TCP port (1-65535), got {port}")
        timeout = r.get(dp_t, "rpc_timeout_s", float, d.dataplane.rpc_timeout_s)
        if timeout <= 0:
            r.problem("rpc_timeout_s", f"must be positive, got {timeout}")
        seconds: dict[str, float] = {}
        for key in ("refresh_s", "wait_for_data_s"):
            value = r.get(dp_t, key, float, getattr(d.dataplane, key))
            if not 0 < value < float("inf"):
                r.problem(key, f"must be a positive number of seconds, got {value}")
                value = getattr(d.dataplane, key)
            seconds[key] = value
        dataplane = DataPlaneSpec(
            port=port,
            prefetch_batches=r.positive(dp_t, "prefetch_batches", d.dataplane.prefetch_batches),
            chunk_batches=r.positive(dp_t, "chunk_batches", d.dataplane.chunk_batches),
            streams_per_server=r.positive(
                dp_t, "streams_per_server", d.dataplane.streams_per_server
            ),
            refresh_s=seconds["refresh_s"],
            wait_for_data_s=seconds["wait_for_data_s"],
            workers_per_server=r.positive(
                dp_t, "workers_per_server", d.dataplane.workers_per_server, minimum=0
            ),
            rpc_timeout_s=timeout,
            server_memory_mb=r.positive(
                dp_t, "server_memory_mb", d.dataplane.server_memory_mb, minimum=0
            ),
        )

    steps = r.positive(t, "steps", 0) if "steps" in t else None
    epochs = r.positive(t, "epochs", 0) if "epochs" in t else None
    if steps and epochs:
        r.problem("epochs", "set either steps or epochs, not both")
    lr = r.get(t, "lr", float, d.lr)
    if lr <= 0:
        r.problem("lr", f"must be positive, got {lr}")
    return JobSpec(
        model=model,
        batch_size=r.positive(t, "batch_size", d.batch_size),
        grad_accum_steps=r.positive(t, "grad_accum_steps", d.grad_accum_steps),
        steps=steps or None,
        epochs=epochs or None,
        lr=lr,
        weight_decay=r.get(t, "weight_decay", float, d.weight_decay),
        warmup_steps=r.positive(t, "warmup_steps", d.warmup_steps, minimum=0),
        precision=r.choice(t, "precision", Precision, d.precision),
        compile=r.get(t, "compile", bool, d.compile),
        seed=r.get(t, "seed", int, d.seed),
        log_every_steps=r.positive(t, "log_every_steps", d.log_every_steps),
        dataset=dataset,
        augmentation=r.choice(t, "augmentation", Recipe, d.augmentation),
        checkpoint=checkpoint,
        parallelism=parallelism,
        prices=prices,
        dataplane=dataplane,
    )


def parse_spec(data: Mapping[str, Any], source: str = "cluster spec") -> ClusterSpec:
    """Validate a parsed TOML document and build the spec; raises ``SpecError``."""
    r = _Reader()
    r.check_keys(data, ClusterSpec, internal=("source",))
    name = r.get(data, "name", str, "hetero")
    if not _NAME_RE.fullmatch(name):
        r.problem("name", f"{name!r} must be lowercase letters, digits and '-', 1-31 characters")
    az_index = r.positive(data, "availability_zone_index", 0, minimum=0)

    groups: list[InstanceGroup] = []
    raw_groups = data.get("groups", [])
    if not isinstance(raw_groups, list) or not raw_groups:
        r.problem("groups", "missing; add [[groups]] tables: one 'trainer' group, 0+ 'dataprep'")
        raw_groups = []
    for i, g in enumerate(raw_groups):
        with r.at(f"groups[{i}]"):
            if not isinstance(g, dict):
                r.problem(None, "expected a table ([[groups]])")
                continue
            parsed = _parse_group(r, g)
            if parsed is not None:
                groups.append(parsed)

    names = [g.name for g in groups]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        r.problem("groups", f"group name {dup!r} is used twice; names must be unique")
    trainers = [g for g in groups if g.role is Role.TRAINER]
    if raw_groups and not trainers and len(groups) == len(raw_groups):
        r.problem("groups", "no group has role 'trainer'; add one (GPU instances that train)")
    if len(trainers) > 1:
        r.problem(
            "groups",
            f"{len(trainers)} trainer groups ({', '.join(g.name for g in trainers)}); use one "
            "trainer group and list alternative types in its instance_types",
        )

    with r.at("job"):
        job = _parse_job(r, r.table(data, "job"))

    # Cross-field checks.
    if len(trainers) == 1:
        tg = trainers[0]
        world = tg.count * tg.ranks_per_instance
        par = job.parallelism
        if par.strategy is Parallelism.HSDP:
            shard = par.shard_degree or tg.ranks_per_instance
            replicate = par.replicate_degree or max(1, world // shard)
            if shard * replicate != world:
                r.problem(
                    "job.parallelism",
                    f"shard_degree ({shard}) x replicate_degree ({replicate}) = "
                    f"{shard * replicate}, but the trainer group has {world} ranks "
                    f"({tg.count} instances x {tg.ranks_per_instance}); make the product {world}",
                )

    if r.problems:
        raise SpecError(r.problems, source)
    return ClusterSpec(
        name=name,
        groups=tuple(groups),
        job=job,
        availability_zone_index=az_index,
        source=source,
    )


def load_spec(path: str | Path | None = None) -> ClusterSpec:
    """Read and validate the spec at ``path`` (default ``cluster.toml``)."""
    p = Path(path) if path is not None else DEFAULT_SPEC_PATH
    if not p.is_file():
        raise SpecError([f"{p}: no such file; pass --spec PATH or create {p}"], str(p))
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SpecError([f"not valid TOML: {e}"], str(p)) from e
    return parse_spec(data, source=str(p))
