"""The spec's dataclasses: ``InstanceGroup``, the job's sections and ``ClusterSpec``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from training import instance_types
from training.spec.enums import (
    CLUSTER_PLACEMENT_DOC,
    DatasetSource,
    Efa,
    GradCompression,
    Interpolation,
    LrScale,
    Market,
    MixupMode,
    Optimizer,
    Parallelism,
    Placement,
    Precision,
    Recipe,
    Role,
    Schedule,
    SpecError,
)


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
    """Start from these weights: ``timm:NAME.TAG`` (a timm model's pretrained weights on the
    Hugging Face Hub, resolved through the user's Hugging Face cache where the job is started
    and staged into S3 for the instances: ``training.common.timm_hub``), or a local path or an
    ``s3://`` URI of a hub-form folder (``config.json`` + ``model.safetensors`` or
    ``pytorch_model.bin``, as timm's ``save_for_hf`` and this project's export write them) or of
    a file timm's ``load_state_dict`` reads (``.safetensors``, ``.pth``, ``.bin``, a ``train.py``
    checkpoint ``*.pth.tar``); the classifier is re-initialised when its class count differs
    (``training.trainer.init_weights``)."""
    init_ema: bool = True
    """From a ``train.py`` checkpoint that holds both, take its EMA weights (``state_dict_ema``,
    as timm's ``load_checkpoint(use_ema=True)`` does); false: its raw ``state_dict``."""
    mean: tuple[float, float, float] | None = None
    """Per-channel mean the trainer normalises [0, 1] pixels with (default: the weights' data
    config with ``init``, else ImageNet's)."""
    std: tuple[float, float, float] | None = None
    """Per-channel std, likewise (default: the weights' with ``init``, else ImageNet's)."""
    drop_rate: float | None = None
    """Dropout before the classifier (``timm.create_model(drop_rate=...)``); None: the
    model's default (0 for ViTs)."""
    drop_path_rate: float | None = None
    """Stochastic depth (``timm.create_model(drop_path_rate=...)``; a ViT's blocks drop from 0
    rising linearly to this rate at the last block); None: the model's default (0)."""


SYNTHETIC_CLASSES = 1000
"""Synthetic data's classes when ``job.dataset.num_classes`` is left out (ImageNet-1k's)."""


@dataclass(frozen=True)
class DatasetSpec:
    source: DatasetSource = DatasetSource.SYNTHETIC
    path: str | None = None
    """Folder (ImageFolder layout) for ``folder``; ``s3://bucket/prefix/`` for ``s3``; for
    ``shards``, the folder or ``s3://`` prefix ``hetero dataset prep --out`` wrote (or its
    ``manifest.json``)."""
    num_samples: int = 50_000
    """Synthetic only: images per epoch."""
    num_classes: int | None = None
    """The classifier's width. Left out, it is the data's: a folder's or an S3 prefix's class
    sub-folders, a prepared dataset's manifest (``training.trainer.classes``), or
    ``SYNTHETIC_CLASSES`` for synthetic data. Set, it must equal what the data has: a job that
    finds another count refuses to start, naming both."""
    image_size: int = 224
    """Side of the square crop the trainer receives."""
    val_path: str | None = None
    """Validation images beside the training ones: a folder (source ``folder``) or an
    ``s3://`` prefix (source ``s3``) in the same layout, with the same class names."""
    val_fraction: float = 0.0
    """Or: hold out this share of the dataset for validation (a split seeded by
    ``split_seed`` that never overlaps training); 0 with no ``val_path``: no validation."""
    max_unreadable: float = 0.01
    """The share of the training samples that may be unreadable (a file that cannot be read or
    decoded; the data path leaves it out of its batch, and the job lists it by name in its
    summary). Above it, judged once 1,000 samples (or the first epoch, if shorter) have been
    met, the job fails with the list: a dataset mostly unreadable is not trained on. 0: the
    first unreadable sample ends the job; 1: never."""
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
    the free space in ``cache_dir``). On AWS a dataprep instance keeps the cache on an NVMe
    instance store volume of at least this size, else on its root volume, which the stack grows
    by it when a listed type has no such volume (``infra/shard_cache.py``)."""

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
    warmup: bool = False
    """Warm the decay up (``ModelEmaV3(use_warmup=True)``, timm's ``train.py
    --model-ema-warmup``): at optimizer step ``s`` the decay is ``1 - (1 + (s - 1) /
    warmup_gamma) ** -warmup_power``, capped at ``decay``, so the average follows the weights
    closely early on instead of holding on to the starting weights."""
    warmup_power: float = 2 / 3
    """The warm-up's power (timm's default 2/3: decay 0.999 at about 31,600 steps; 3/4: at
    about 10,000)."""
    warmup_gamma: float = 1.0
    """The warm-up's inverse gamma (timm's default 1)."""

    @property
    def enabled(self) -> bool:
        return self.decay > 0


@dataclass(frozen=True)
class EvalSpec:
    """Validation: timm's eval transform (resize to ``image_size / crop_pct``, centre crop)."""

    every_steps: int = 0
    """Evaluate every N optimizer steps (0: only at the end); always at the end."""
    at_start: bool = False
    """Also evaluate before the first step of a run that starts at step 0: what the starting
    weights (``job.model.init``) score on their own."""
    crop_pct: float | None = None
    """Default: the weights' data config with ``job.model.init``, else 0.875."""
    interpolation: Interpolation | None = None
    """Default: the weights' data config with ``job.model.init``, else bilinear."""
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
    """Peak learning rate (or set ``lr_base`` instead)."""
    lr_base: float | None = None
    """Or: the peak learning rate at a global batch of ``lr_base_size`` samples, scaled to
    the job's global batch (``batch_size`` x ``grad_accum_steps`` x trainer ranks) as timm's
    ``train.py --lr-base`` does (``peak_lr``)."""
    lr_base_size: int = 256
    """The global batch ``lr_base`` is given for (timm's ``--lr-base-size``)."""
    lr_base_scale: LrScale | None = None
    """``linear`` or ``sqrt`` in the batch ratio; default as timm's ``train.py``: ``sqrt``
    for Adam-family optimizers and LAMB, ``linear`` for SGD."""
    layer_decay: float | None = None
    """Layer-wise learning-rate decay (timm's ``create_optimizer_v2(layer_decay=...)``, the
    standard ViT fine-tuning setting, e.g. 0.65-0.75): the head learns at the full rate, each
    block below at this factor of the one above, the embeddings least. None: off."""
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
    """Clip the gradients' total norm to this (0: off; the norm is logged either way)."""
    max_nonfinite_steps: int = 3
    """A step whose loss or gradient norm is not finite on any rank is skipped (no update);
    this many such steps in a row stop the run (outcome ``failed``) with the step and what to
    try."""
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
    hours have passed since it started (``training.costs.budget``). None: no cap."""
    max_usd: float | None = None
    """Budget: stop the job likewise once the cluster's price at its most (every group at
    ``max_size`` of its dearest listed type, priced when the job started: ``training.prices``)
    times the hours since it started reaches this many USD. None: no cap."""

    @property
    def total_steps(self) -> int | None:
        """Optimizer steps, or None when the job runs by epochs."""
        if self.steps is not None:
            return self.steps
        return None if self.epochs is not None else 1000

    @property
    def resolved_lr_base_scale(self) -> LrScale:
        """``lr_base_scale``, or timm's default for the optimizer (``train.py``: ``sqrt`` when
        the optimizer's name has "ada" or "lamb", else ``linear``)."""
        if self.lr_base_scale is not None:
            return self.lr_base_scale
        name = self.optimizer.value
        return LrScale.SQRT if "ada" in name or "lamb" in name else LrScale.LINEAR

    def global_batch(self, world_size: int) -> int:
        """Samples per optimizer step over ``world_size`` trainer ranks."""
        return self.batch_size * self.grad_accum_steps * world_size

    def peak_lr(self, world_size: int) -> float:
        """The peak learning rate with ``world_size`` trainer ranks: ``lr``, or ``lr_base``
        scaled by the global batch over ``lr_base_size`` (its square root with ``sqrt``), as
        timm's ``train.py`` computes ``--lr`` from ``--lr-base``."""
        if self.lr_base is None:
            return self.lr
        ratio = self.global_batch(world_size) / self.lr_base_size
        if self.resolved_lr_base_scale is LrScale.SQRT:
            ratio = ratio**0.5
        return self.lr_base * ratio


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

    @property
    def window_warning(self) -> str | None:
        """Why some data servers would get no work, or None: each trainer rank hands out
        ranges of ``chunk_batches`` batches only inside its reorder window of
        ``prefetch_batches`` (``training.dataplane.client``), so at most that many over
        ``chunk_batches`` streams have a range at once; the data tier at its largest has more.
        ``hetero spec check`` prints it; a warning, not an error."""
        dp, job = self.job.dataplane, self.job
        servers = sum(g.max_size * g.ranks_per_instance for g in self.dataprep_groups)
        streams = servers * dp.streams_per_server
        need = streams * dp.chunk_batches
        if need <= dp.prefetch_batches:
            return None
        ranges = -(-dp.prefetch_batches // dp.chunk_batches)
        size = job.dataset.image_size
        mb = need * job.batch_size * 3 * size * size / 1e6
        return (
            f"job.dataplane.prefetch_batches = {dp.prefetch_batches} lets at most {ranges} of "
            f"the data tier's {streams} streams ({servers} server(s) at its largest x "
            f"streams_per_server {dp.streams_per_server}) have a range of chunk_batches = "
            f"{dp.chunk_batches} at once, so the others wait idle; set prefetch_batches = "
            f"{need} (each trainer rank then holds up to {mb:,.0f} MB of batches) or lower "
            "chunk_batches"
        )

    def usd_per_hour(self) -> float:
        """What the whole cluster costs per hour at its counts (every group's ``count`` of its
        first listed type): the figure of the trainer's samples-per-dollar metrics. The budget
        prices the cluster at its most instead (``training.prices``)."""
        return sum(
            g.count * self.job.prices.hourly(g.instance_types[0], g.market) for g in self.groups
        )


def _supports_efa(instance_type: str) -> bool:
    entry = instance_types.lookup(instance_type)
    return entry is not None and entry.supports_efa
