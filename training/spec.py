"""The cluster spec: one typed TOML file that both the CDK app and the launcher read.

``load_spec(path)`` parses and validates the whole file once. Every problem found is reported
together in one ``SpecError`` whose lines name the field (``groups[1].count``) and the fix, so a
bad spec fails before anything is deployed or launched.
"""

from __future__ import annotations

import difflib
import math
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


class Placement(StrEnum):
    """Where a group's instances go: ``cluster``, a cluster placement group of their own (one
    AZ, one high-bisection network segment); ``none``, anywhere in the cluster's subnet."""

    CLUSTER = "cluster"
    NONE = "none"


CLUSTER_PLACEMENT_DOC = (
    "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/placement-strategies.html"
    "#placement-groups-cluster"
)
"""AWS's advice on cluster placement groups: "Use the same instance type for all instances in
the placement group" and "Use a single launch request to launch the number of instances that you
need in the placement group"; "If you try to add more instances to the placement group later, or
if you try to launch more than one instance type in the placement group, you increase your
chances of getting an insufficient capacity error"."""
PLACEMENT_WARNING_FIX = "list one instance type in the group, or set placement = 'none' on it"
"""What to do about an ``InstanceGroup.placement_warning``."""


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
    SHARDS = "shards"
    """A dataset ``hetero dataset prep`` wrote: tar shards and a manifest, local or in S3."""


class Recipe(StrEnum):
    """Augmentation presets: ``standard`` is decode + RandomResizedCrop (ImageNet's scale
    0.08-1) + horizontal flip; ``randaugment`` adds timm's RandAugment on top (several times the
    CPU cost per image); ``none`` only resizes and centre-crops (pre-cropped data)."""

    STANDARD = "standard"
    RANDAUGMENT = "randaugment"
    NONE = "none"


class Interpolation(StrEnum):
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    NEAREST = "nearest"
    RANDOM = "random"
    """Training only: timm picks bilinear or bicubic per image."""


class Optimizer(StrEnum):
    """``timm.optim.create_optimizer_v2`` names offered by the spec."""

    ADAMW = "adamw"
    LAMB = "lamb"
    SGD = "sgd"


class Schedule(StrEnum):
    """Learning-rate schedule after the linear warmup, from ``timm.scheduler``."""

    COSINE = "cosine"
    """Cosine decay to ``min_lr`` at the last step (``CosineLRScheduler``)."""
    CONSTANT = "constant"
    """The peak learning rate until the end."""


class MixupMode(StrEnum):
    BATCH = "batch"
    PAIR = "pair"
    ELEM = "elem"


RANDOM_ERASING_MODES = ("const", "rand", "pixel")


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
    """Number of instances (an elastic group's start: ``min_count <= count <= max_count``)."""
    market: Market = Market.SPOT
    efa: Efa = Efa.AUTO
    """``auto``: EFA where every listed type has it; ``on``: required; ``off``: never."""
    processes_per_instance: int | None = None
    """Trainer ranks (or data servers) per instance; default: GPUs per instance, or 1."""
    placement: Placement | None = None
    """``cluster`` or ``none``; ``None`` (not in the spec) resolves by
    ``uses_cluster_placement``."""
    min_count: int | None = None
    """Dataprep groups only: with ``max_count``, the group is elastic (the data-tier controller,
    ``training.dataplane.autoscale``, sizes it between the two); default ``count``."""
    max_count: int | None = None
    """Dataprep groups only: the most instances the controller may run; default ``count``."""

    @property
    def min_size(self) -> int:
        return self.count if self.min_count is None else self.min_count

    @property
    def max_size(self) -> int:
        return self.count if self.max_count is None else self.max_count

    @property
    def elastic(self) -> bool:
        """Whether the data-tier controller sizes this group (its min and max differ)."""
        return self.min_size != self.max_size

    @property
    def uses_cluster_placement(self) -> bool:
        """Whether the group gets a cluster placement group of its own: as the spec says, else
        only where it pays, that is trainer groups of more than one instance (their gradient
        all-reduce crosses instances) and groups that use EFA ("We recommended you launch all
        instances that use EFA in a cluster placement group", one per node group: AWS PCS,
        https://docs.aws.amazon.com/pcs/latest/userguide/working-with_networking_efa_create-placement-group.html).
        Dataprep groups and single-instance trainer groups default to none: every launch into
        a cluster placement group, Spot replacements and Capacity Rebalancing's included, is
        one more chance of an insufficient capacity error (``CLUSTER_PLACEMENT_DOC``) for no
        gain. The one rule that infra, preflight and ``spec check`` read."""
        if self.placement is not None:
            return self.placement is Placement.CLUSTER
        return (self.role is Role.TRAINER and self.count > 1) or self.use_efa

    @property
    def placement_warning(self) -> str | None:
        """Why this group's placement goes against AWS's advice, or None: a cluster placement
        group with several instance types. ``hetero spec check`` and ``hetero preflight`` print
        it with ``PLACEMENT_WARNING_FIX``; a warning, not an error (the spec stays valid)."""
        if not self.uses_cluster_placement or len(self.instance_types) < 2:
            return None
        return (
            f"group {self.name!r} uses a cluster placement group with "
            f"{len(self.instance_types)} instance types ({', '.join(self.instance_types)}); "
            "AWS recommends the same instance type for all instances in a cluster placement "
            "group: more than one type raises the chance of an insufficient capacity error "
            f"({CLUSTER_PLACEMENT_DOC})"
        )

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
    init: str | None = None
    """Start from these weights: a ``model.safetensors`` (this project's export or any timm
    file), a local path or an ``s3://`` URI; the classifier is re-initialised when its class
    count differs."""


@dataclass(frozen=True)
class DatasetSpec:
    source: DatasetSource = DatasetSource.SYNTHETIC
    path: str | None = None
    """Folder (ImageFolder layout) for ``folder``; ``s3://bucket/prefix/`` for ``s3``; for
    ``shards``, the folder or ``s3://`` prefix ``hetero dataset prep --out`` wrote (or its
    ``manifest.json``)."""
    num_samples: int = 50_000
    """Synthetic only: images per epoch."""
    num_classes: int = 1000
    """Synthetic only (folders and S3 prefixes take theirs from the class sub-folders)."""
    image_size: int = 224
    """Side of the square crop the trainer receives."""
    val_path: str | None = None
    """Validation images beside the training ones: a folder (source ``folder``) or an
    ``s3://`` prefix (source ``s3``) in the same layout, with the same class names."""
    val_fraction: float = 0.0
    """Or: hold out this share of the dataset for validation (a split seeded by
    ``split_seed`` that never overlaps training); 0 with no ``val_path``: no validation."""
    split_seed: int = 0
    """Seed of the ``val_fraction`` split (kept apart from ``job.seed``, so changing the
    training seed keeps the same validation set)."""
    manifest_sha256: str | None = None
    """``shards``: the manifest's checksum (``hetero dataset prep`` and ``verify`` print it);
    a job whose manifest has other bytes refuses to start (the dataset changed under it)."""
    shuffle_shards: int = 8
    """``shards``: how many shards an epoch shuffles together (a seeded order of the shards,
    then of the samples of each run of this many); more mixes better and keeps more shards in
    use at once."""
    cache_dir: str | None = None
    """``shards`` in S3: the folder for the local shard cache (default: ``$TMPDIR``'s
    ``hetero-shards``)."""
    cache_gb: float | None = None
    """``shards`` in S3: the cache's size cap (default: the dataset's size, at most 80% of
    the free space in ``cache_dir``)."""

    @property
    def has_validation(self) -> bool:
        """``shards`` carry their validation split in the manifest (``hetero dataset prep
        --val-src`` or ``--val-fraction``)."""
        return (
            self.source is DatasetSource.SHARDS
            or self.val_path is not None
            or self.val_fraction > 0
        )


@dataclass(frozen=True)
class AugmentationSpec:
    """The training transform: one of the ``Recipe`` presets, with any parameter of timm's
    ``create_transform`` that matters set over it. ``None`` keeps the preset's value."""

    preset: Recipe = Recipe.STANDARD
    scale: tuple[float, float] | None = None
    """RandomResizedCrop area range (preset: ImageNet's (0.08, 1.0))."""
    ratio: tuple[float, float] | None = None
    """RandomResizedCrop aspect range (preset: (3/4, 4/3))."""
    hflip: float | None = None
    """Horizontal flip probability (preset: 0.5)."""
    vflip: float | None = None
    """Vertical flip probability (preset: 0)."""
    color_jitter: float | tuple[float, ...] | None = None
    """Brightness/contrast/saturation[/hue] jitter; one number for the first three (preset:
    none)."""
    auto_augment: str | None = None
    """A timm policy string (``rand-m9-mstd0.5-inc1``, ``augmix-m5-w4-d2``, ``original``...);
    ``""`` for none (preset: RandAugment for ``randaugment``, none otherwise)."""
    interpolation: Interpolation | None = None
    """Resize interpolation (preset: bilinear)."""
    re_prob: float = 0.0
    """Random erasing probability, applied on the trainer's device after normalisation (as
    timm's prefetcher does)."""
    re_mode: str = "pixel"
    """Random erasing fill: ``const``, ``rand`` or ``pixel``."""
    re_count: int = 1
    """At most this many erased boxes per image."""

    @property
    def is_preset(self) -> bool:
        """True when nothing but the preset is set."""
        return self == AugmentationSpec(preset=self.preset)

    def describe(self) -> str:
        """The preset name, or the preset with what is set over it."""
        if self.is_preset:
            return self.preset.value
        changed = [
            f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if f.name != "preset" and getattr(self, f.name) != getattr(AugmentationSpec, f.name)
        ]
        return f"{self.preset.value}({', '.join(changed)})"


@dataclass(frozen=True)
class MixupSpec:
    """``timm.data.Mixup`` on the trainer's device; off while both alphas are 0."""

    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    prob: float = 1.0
    """Probability of mixing a batch (or a pair/element)."""
    switch_prob: float = 0.5
    """With both alphas on: probability of CutMix rather than Mixup."""
    mode: MixupMode = MixupMode.BATCH

    @property
    def enabled(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0


@dataclass(frozen=True)
class EmaSpec:
    """An exponential moving average of the weights (``timm.utils.ModelEmaV3``), evaluated
    beside the raw weights and exported when on."""

    decay: float = 0.0
    """0: off; e.g. 0.999 for a few thousand steps, 0.9999 for long runs."""

    @property
    def enabled(self) -> bool:
        return self.decay > 0


@dataclass(frozen=True)
class EvalSpec:
    """Validation: timm's eval transform (resize to ``image_size / crop_pct``, centre crop)."""

    every_steps: int = 0
    """Evaluate every N optimizer steps (0: only at the end); always at the end."""
    crop_pct: float = 0.875
    interpolation: Interpolation = Interpolation.BILINEAR
    batch_size: int | None = None
    """Per rank (default: ``job.batch_size``)."""


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
    autoscale_target_wait: float = 0.05
    """Elastic dataprep groups: the data-wait share the controller keeps the trainer under
    (``training.dataplane.autoscale``)."""
    autoscale_max_busy: float = 0.75
    """Elastic dataprep groups: a scale-in happens only when the servers left would be busy
    at most this share of their time (and the data-wait share is under half the target)."""
    autoscale_window: int = 3
    """Elastic dataprep groups: metric intervals (``job.log_every`` steps each) the controller
    averages before it decides; one slow interval does not decide alone."""
    autoscale_cooldown_s: float = 60.0
    """Elastic dataprep groups: seconds after a change (once every new server serves) before
    the next decision."""


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
    """Peak learning rate."""
    weight_decay: float = 0.05
    """Not applied to norms, biases and embeddings (timm's parameter groups)."""
    warmup_steps: int = 0
    """Linear warmup from 0 to ``lr``, counted in optimizer steps."""
    optimizer: Optimizer = Optimizer.ADAMW
    momentum: float = 0.9
    """SGD only."""
    schedule: Schedule = Schedule.COSINE
    min_lr: float = 0.0
    """The cosine schedule's floor (reached at the last step)."""
    clip_grad_norm: float = 0.0
    """Clip the gradients' total norm to this (0: off)."""
    label_smoothing: float = 0.0
    mixup: MixupSpec = field(default_factory=MixupSpec)
    ema: EmaSpec = field(default_factory=EmaSpec)
    eval: EvalSpec = field(default_factory=EvalSpec)
    accuracy_targets: tuple[float, ...] = ()
    """Validation top-1 targets (0-1): the summary reports the step, time, samples and USD at
    which each was first reached."""
    precision: Precision = Precision.BF16
    """bf16 autocast on GPU; CPU runs stay in fp32."""
    compile: bool = False
    """``torch.compile`` the model."""
    seed: int = 0
    log_every_steps: int = 10
    dataset: DatasetSpec = field(default_factory=DatasetSpec)
    augmentation: AugmentationSpec = field(default_factory=AugmentationSpec)
    """A preset name (``augmentation = "standard"``) or a table (``[job.augmentation]``)."""
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    parallelism: ParallelismSpec = field(default_factory=ParallelismSpec)
    prices: PricesSpec = field(default_factory=PricesSpec)
    dataplane: DataPlaneSpec = field(default_factory=DataPlaneSpec)
    max_hours: float | None = None
    """Budget: stop the job (checkpoint, outcome ``stopped``, every group at 0) once this many
    hours have passed since it started (``training.launcher.budget``). None: no cap."""
    max_usd: float | None = None
    """Budget: stop the job likewise once the cluster's price (``ClusterSpec.usd_per_hour``)
    times the hours since it started reaches this many USD. None: no cap."""

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
    """Which AZ of the region (by index) holds every instance (and every placement group)."""
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
    placement = r.choice(t, "placement", Placement, None)
    bounds: dict[str, int | None] = {}
    for key in ("min_count", "max_count"):
        bounds[key] = r.positive(t, key, 0) if key in t else None
        if bounds[key] is not None and role is Role.TRAINER:
            r.problem(
                key,
                "only dataprep groups are elastic; a trainer group has a fixed count (remove "
                f"{key})",
            )
    low = bounds["min_count"] if bounds["min_count"] is not None else count
    high = bounds["max_count"] if bounds["max_count"] is not None else count
    if not low <= count <= high:
        r.problem(
            "count",
            f"an elastic group starts at count, which must lie between min_count and max_count; "
            f"got min_count {low}, count {count}, max_count {high}",
        )
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
        placement=placement,
        min_count=bounds["min_count"],
        max_count=bounds["max_count"],
    )


def _fraction(
    r: _Reader,
    t: Mapping[str, Any],
    key: str,
    default: float,
    *,
    low: float = 0.0,
    high: float = 1.0,
    low_open: bool = False,
) -> float:
    """A float in [low, high] (or (low, high] with ``low_open``)."""
    value = r.get(t, key, float, default)
    if not isinstance(value, float):
        return default
    if not (low < value if low_open else low <= value) or not value <= high:
        left = "(" if low_open else "["
        r.problem(key, f"must be in {left}{low:g}, {high:g}], got {value:g}")
        return default
    return value


def _pair(r: _Reader, t: Mapping[str, Any], key: str, *, low: float) -> tuple[float, float] | None:
    raw = r.get(t, key, list, None)
    if raw is None:
        return None
    if (
        len(raw) != 2
        or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in raw)
        or not low <= raw[0] <= raw[1]
    ):
        r.problem(key, f"expected [min, max] with {low:g} <= min <= max, got {raw!r}")
        return None
    return float(raw[0]), float(raw[1])


def _parse_augmentation(r: _Reader, raw: Any) -> AugmentationSpec:
    if isinstance(raw, str):
        try:
            return AugmentationSpec(preset=Recipe(raw))
        except ValueError:
            valid = ", ".join(repr(e.value) for e in Recipe)
            r.problem(None, f"{raw!r} is not a preset; use one of {valid} or a table")
            return AugmentationSpec()
    if not isinstance(raw, dict):
        r.problem(None, f"expected a preset name or a table, got {type(raw).__name__}")
        return AugmentationSpec()
    r.check_keys(raw, AugmentationSpec)
    preset = r.choice(raw, "preset", Recipe, Recipe.STANDARD)
    scale = _pair(r, raw, "scale", low=0.0)
    if scale is not None and not (scale[0] > 0 and scale[1] <= 1):
        r.problem("scale", f"area shares must be in (0, 1], got {list(scale)}")
    ratio = _pair(r, raw, "ratio", low=0.0)
    if ratio is not None and ratio[0] <= 0:
        r.problem("ratio", f"aspect ratios must be positive, got {list(ratio)}")
    hflip = _fraction(r, raw, "hflip", -1.0, low=0.0) if "hflip" in raw else None
    vflip = _fraction(r, raw, "vflip", -1.0, low=0.0) if "vflip" in raw else None
    jitter: float | tuple[float, ...] | None = None
    if "color_jitter" in raw:
        cj = raw["color_jitter"]
        if isinstance(cj, int | float) and not isinstance(cj, bool) and cj >= 0:
            jitter = float(cj)
        elif (
            isinstance(cj, list)
            and len(cj) in (3, 4)
            and all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in cj)
        ):
            jitter = tuple(float(v) for v in cj)
        else:
            r.problem(
                "color_jitter",
                f"expected a number >= 0 or [brightness, contrast, saturation(, hue)], got {cj!r}",
            )
    auto = r.get(raw, "auto_augment", str, None)
    if auto and not re.fullmatch(
        r"(rand|augmix|original|originalr|v0|v0r|3a)(-[a-z]+[\d.]*)*", auto
    ):
        r.problem(
            "auto_augment",
            f"{auto!r} is not a timm policy; use e.g. 'rand-m9-mstd0.5-inc1', 'augmix-m5-w4-d2', "
            "'original', '3a' or '' for none",
        )
    interp = r.choice(raw, "interpolation", Interpolation, None)
    re_mode = r.get(raw, "re_mode", str, "pixel")
    if re_mode not in RANDOM_ERASING_MODES:
        r.problem("re_mode", f"{re_mode!r} is not valid; use one of {RANDOM_ERASING_MODES}")
        re_mode = "pixel"
    spec = AugmentationSpec(
        preset=preset,
        scale=scale,
        ratio=ratio,
        hflip=hflip,
        vflip=vflip,
        color_jitter=jitter,
        auto_augment=auto,
        interpolation=interp,
        re_prob=_fraction(r, raw, "re_prob", 0.0),
        re_mode=re_mode,
        re_count=r.positive(raw, "re_count", 1),
    )
    if preset is Recipe.NONE:
        crop_keys = [k for k in ("scale", "ratio", "hflip", "vflip", "color_jitter", "auto_augment")
                     if k in raw]  # fmt: skip
        if crop_keys:
            r.problem(
                "preset",
                f"'none' only resizes and centre-crops, so {', '.join(crop_keys)} would be "
                "ignored; use preset = 'standard' to set them, or remove them",
            )
    return spec


def _parse_job(r: _Reader, t: Mapping[str, Any]) -> JobSpec:
    r.check_keys(t, JobSpec)
    d = JobSpec()

    model_t = r.table(t, "model")
    with r.at("model"):
        r.check_keys(model_t, ModelSpec)
        overrides = r.table(model_t, "overrides")
        init = r.get(model_t, "init", str, None)
        if init is not None and not init.strip():
            r.problem("init", "empty; give a model.safetensors path or s3:// URI, or remove it")
            init = None
        model = ModelSpec(
            name=r.get(model_t, "name", str, d.model.name), overrides=overrides, init=init
        )

    ds_t = r.table(t, "dataset")
    with r.at("dataset"):
        r.check_keys(ds_t, DatasetSpec)
        source = r.choice(ds_t, "source", DatasetSource, DatasetSource.SYNTHETIC)
        path = r.get(ds_t, "path", str, None)
        if source is DatasetSource.FOLDER and not path:
            r.problem("path", "source 'folder' needs path = a folder of class sub-folders")
        if source is DatasetSource.S3 and not (path and path.startswith("s3://")):
            r.problem("path", "source 's3' needs path = 's3://bucket/prefix/'")
        if source is DatasetSource.SHARDS and not path:
            r.problem(
                "path",
                "source 'shards' needs path = the folder or s3:// prefix that `hetero dataset "
                "prep --out` wrote",
            )
        val_path = r.get(ds_t, "val_path", str, None)
        val_fraction = _fraction(r, ds_t, "val_fraction", 0.0, high=0.5)
        if source is DatasetSource.SHARDS and (val_path is not None or val_fraction):
            r.problem(
                "val_path" if val_path is not None else "val_fraction",
                "source 'shards' takes its validation split from the manifest; prepare the "
                "dataset with `hetero dataset prep --val-src` or `--val-fraction` instead",
            )
        manifest_sha256 = r.get(ds_t, "manifest_sha256", str, None)
        if manifest_sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", manifest_sha256):
            r.problem("manifest_sha256", "expected the 64 hex digits hetero dataset verify prints")
        shards_keys = ("manifest_sha256", "shuffle_shards", "cache_dir", "cache_gb")
        if source is not DatasetSource.SHARDS:
            for key in shards_keys:
                if key in ds_t:
                    r.problem(key, "only for source 'shards'")
        cache_gb = r.get(ds_t, "cache_gb", (int, float), None)
        if cache_gb is not None and (isinstance(cache_gb, bool) or not cache_gb > 0):
            r.problem("cache_gb", f"expected a size in GB above 0, got {cache_gb!r}")
        if val_path is not None:
            if val_fraction:
                r.problem(
                    "val_fraction",
                    "set either val_path (a validation folder or prefix) or val_fraction "
                    "(a held-out share of the dataset), not both",
                )
            if source is DatasetSource.SYNTHETIC:
                r.problem("val_path", "source 'synthetic' has no folder; use val_fraction")
            elif source is DatasetSource.S3 and not val_path.startswith("s3://"):
                r.problem("val_path", "source 's3' needs val_path = 's3://bucket/prefix/'")
            elif source is DatasetSource.FOLDER and val_path.startswith("s3://"):
                r.problem("val_path", "source 'folder' needs val_path = a local folder")
            elif val_path.rstrip("/") == (path or "").rstrip("/"):
                r.problem("val_path", "is the training path; validation must be other images")
        dataset = DatasetSpec(
            source=source,
            path=path,
            num_samples=r.positive(ds_t, "num_samples", d.dataset.num_samples),
            num_classes=r.positive(ds_t, "num_classes", d.dataset.num_classes),
            image_size=r.positive(ds_t, "image_size", d.dataset.image_size, minimum=16),
            val_path=val_path,
            val_fraction=val_fraction,
            split_seed=r.get(ds_t, "split_seed", int, d.dataset.split_seed),
            manifest_sha256=manifest_sha256.lower() if manifest_sha256 else None,
            shuffle_shards=r.positive(ds_t, "shuffle_shards", d.dataset.shuffle_shards),
            cache_dir=r.get(ds_t, "cache_dir", str, None),
            cache_gb=float(cache_gb) if isinstance(cache_gb, int | float) else None,
        )

    with r.at("augmentation"):
        augmentation = (
            _parse_augmentation(r, t["augmentation"]) if "augmentation" in t else d.augmentation
        )

    mx_t = r.table(t, "mixup")
    with r.at("mixup"):
        r.check_keys(mx_t, MixupSpec)
        alphas = {}
        for key in ("mixup_alpha", "cutmix_alpha"):
            alphas[key] = r.get(mx_t, key, float, 0.0)
            if alphas[key] < 0:
                r.problem(key, f"must be >= 0 (0: off), got {alphas[key]:g}")
                alphas[key] = 0.0
        mixup = MixupSpec(
            mixup_alpha=alphas["mixup_alpha"],
            cutmix_alpha=alphas["cutmix_alpha"],
            prob=_fraction(r, mx_t, "prob", d.mixup.prob),
            switch_prob=_fraction(r, mx_t, "switch_prob", d.mixup.switch_prob),
            mode=r.choice(mx_t, "mode", MixupMode, d.mixup.mode),
        )
        if mx_t and not mixup.enabled:
            r.problem(None, "set mixup_alpha and/or cutmix_alpha above 0, or remove [job.mixup]")

    ema_t = r.table(t, "ema")
    with r.at("ema"):
        r.check_keys(ema_t, EmaSpec)
        if ema_t and "decay" not in ema_t:
            r.problem("decay", "missing; e.g. decay = 0.999 (0 or no [job.ema]: no EMA)")
        ema = EmaSpec(decay=_fraction(r, ema_t, "decay", 0.0, high=0.999999))

    ev_t = r.table(t, "eval")
    with r.at("eval"):
        r.check_keys(ev_t, EvalSpec)
        eval_batch = r.positive(ev_t, "batch_size", 0) if "batch_size" in ev_t else None
        evaluation = EvalSpec(
            every_steps=r.positive(ev_t, "every_steps", d.eval.every_steps, minimum=0),
            crop_pct=_fraction(r, ev_t, "crop_pct", d.eval.crop_pct, low_open=True),
            interpolation=r.choice(ev_t, "interpolation", Interpolation, d.eval.interpolation),
            batch_size=eval_batch or None,
        )
        if evaluation.interpolation is Interpolation.RANDOM:
            r.problem("interpolation", "'random' is for training; use bilinear or bicubic")
        if ev_t and not dataset.has_validation:
            r.problem(
                None,
                "no validation set to evaluate on; set job.dataset.val_path or "
                "job.dataset.val_fraction (source 'shards': the manifest's val split)",
            )

    targets_raw = r.get(t, "accuracy_targets", list, [])
    targets: list[float] = []
    for i, v in enumerate(targets_raw):
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= 1:
            r.problem(f"accuracy_targets[{i}]", f"expected a top-1 share in (0, 1], got {v!r}")
        else:
            targets.append(float(v))
    if targets and not dataset.has_validation:
        r.problem(
            "accuracy_targets",
            "need a validation set; set job.dataset.val_path or job.dataset.val_fraction",
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
        cooldown = r.get(dp_t, "autoscale_cooldown_s", float, d.dataplane.autoscale_cooldown_s)
        if not 0 <= cooldown < float("inf"):
            r.problem("autoscale_cooldown_s", f"must be 0 or more seconds, got {cooldown}")
            cooldown = d.dataplane.autoscale_cooldown_s
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
            autoscale_target_wait=_fraction(
                r, dp_t, "autoscale_target_wait", d.dataplane.autoscale_target_wait,
                high=0.9, low_open=True,
            ),
            autoscale_max_busy=_fraction(
                r, dp_t, "autoscale_max_busy", d.dataplane.autoscale_max_busy, low_open=True
            ),
            autoscale_window=r.positive(dp_t, "autoscale_window", d.dataplane.autoscale_window),
            autoscale_cooldown_s=cooldown,
        )  # fmt: skip

    steps = r.positive(t, "steps", 0) if "steps" in t else None
    epochs = r.positive(t, "epochs", 0) if "epochs" in t else None
    if steps and epochs:
        r.problem("epochs", "set either steps or epochs, not both")
    lr = r.get(t, "lr", float, d.lr)
    if lr <= 0:
        r.problem("lr", f"must be positive, got {lr}")
    min_lr = r.get(t, "min_lr", float, d.min_lr)
    if not 0 <= min_lr <= lr:
        r.problem("min_lr", f"must be in [0, lr = {lr:g}], got {min_lr:g}")
        min_lr = 0.0
    weight_decay = r.get(t, "weight_decay", float, d.weight_decay)
    if weight_decay < 0:
        r.problem("weight_decay", f"must be >= 0, got {weight_decay:g}")
    clip = r.get(t, "clip_grad_norm", float, d.clip_grad_norm)
    if clip < 0:
        r.problem("clip_grad_norm", f"must be > 0 (or 0: no clipping), got {clip:g}")
    batch_size = r.positive(t, "batch_size", d.batch_size)
    if mixup.enabled and batch_size % 2:
        r.problem(
            "batch_size",
            f"{batch_size} is odd, but timm's Mixup mixes a batch with its reverse and needs an "
            "even batch; use an even batch_size",
        )
    return JobSpec(
        model=model,
        batch_size=batch_size,
        grad_accum_steps=r.positive(t, "grad_accum_steps", d.grad_accum_steps),
        steps=steps or None,
        epochs=epochs or None,
        lr=lr,
        weight_decay=weight_decay,
        warmup_steps=r.positive(t, "warmup_steps", d.warmup_steps, minimum=0),
        optimizer=r.choice(t, "optimizer", Optimizer, d.optimizer),
        momentum=_fraction(r, t, "momentum", d.momentum),
        schedule=r.choice(t, "schedule", Schedule, d.schedule),
        min_lr=min_lr,
        clip_grad_norm=clip,
        label_smoothing=_fraction(r, t, "label_smoothing", d.label_smoothing, high=0.5),
        mixup=mixup,
        ema=ema,
        eval=evaluation,
        accuracy_targets=tuple(sorted(set(targets))),
        precision=r.choice(t, "precision", Precision, d.precision),
        compile=r.get(t, "compile", bool, d.compile),
        seed=r.get(t, "seed", int, d.seed),
        log_every_steps=r.positive(t, "log_every_steps", d.log_every_steps),
        dataset=dataset,
        augmentation=augmentation,
        checkpoint=checkpoint,
        parallelism=parallelism,
        prices=prices,
        dataplane=dataplane,
        max_hours=_cap(r, t, "max_hours", "hours"),
        max_usd=_cap(r, t, "max_usd", "USD"),
    )


def _cap(r: _Reader, t: Mapping[str, Any], key: str, unit: str) -> float | None:
    """A budget cap: a positive, finite number, or None when left out."""
    value = r.get(t, key, float, None)
    if value is None:
        return None
    if not math.isfinite(value) or value <= 0:
        r.problem(key, f"must be a positive number of {unit}, got {value!r}; remove it for no cap")
        return None
    return value


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

    if job.ema.enabled and job.parallelism.strategy is not Parallelism.DDP:
        r.problem(
            "job.ema",
            f"weight EMA keeps a full copy of the model on every rank, which strategy "
            f"'{job.parallelism.strategy}' exists to avoid; use strategy = 'ddp' or remove "
            "[job.ema]",
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


def parse_augmentation(raw: Any, source: str = "augmentation") -> AugmentationSpec:
    """An ``AugmentationSpec`` from a preset name or a table (as in ``job.augmentation``);
    raises ``SpecError`` naming each bad field."""
    r = _Reader()
    spec = _parse_augmentation(r, raw)
    if r.problems:
        raise SpecError(r.problems, source)
    return spec


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
