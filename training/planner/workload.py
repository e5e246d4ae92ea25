"""What the spec asks the cluster to do, in the units the planner's formulas use.

The model's size comes from its timm architecture (``priors.VIT_ARCHS`` plus the spec's
overrides), counted analytically: parameters exactly as timm builds them, training FLOPs as
3 x (2 x multiply-accumulates of the forward pass), except the patch embedding, which needs no
input gradient (2 x 2). For vit_base_patch16_224 at 224 px that gives 86,567,656 parameters
(timm's count) and 105.15 GFLOP, as torch's FlopCounterMode counts on the real model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from training.data.splits import val_count
from training.planner import priors
from training.planner.errors import PlanError
from training.spec import (
    SYNTHETIC_CLASSES,
    ClusterSpec,
    DatasetSource,
    GradCompression,
    Parallelism,
    Precision,
)


@dataclass(frozen=True)
class ModelSize:
    params: int
    train_flops_per_sample: float
    """Forward + backward FLOPs for one image at the job's image size."""
    tokens: int


def vit_size(arch: priors.VitArch, image_size: int, num_classes: int) -> ModelSize:
    """Parameters and training FLOPs of a timm VisionTransformer (class token, learned position
    embedding, pre-norm blocks, linear head) at ``image_size``."""
    if image_size % arch.patch_size:
        raise PlanError(
            f"image size {image_size} is not a multiple of the patch size {arch.patch_size}; "
            "set job.dataset.image_size to a multiple of it"
        )
    d, hidden = arch.embed_dim, int(arch.embed_dim * arch.mlp_ratio)
    patches = (image_size // arch.patch_size) ** 2
    tokens = patches + 1
    patch_embed = 3 * arch.patch_size**2 * d + d
    per_block = (
        2 * d  # norm1
        + d * 3 * d
        + 3 * d  # qkv
        + d * d
        + d  # proj
        + 2 * d  # norm2
        + d * hidden
        + hidden  # fc1
        + hidden * d
        + d  # fc2
    )
    params = patch_embed + d + tokens * d + arch.depth * per_block + 2 * d + d * num_classes
    params += num_classes
    macs_block = tokens * (3 * d * d + d * d + 2 * d * hidden) + 2 * tokens * tokens * d
    macs = arch.depth * macs_block + d * num_classes
    # The patch embedding gets no input gradient (the image needs none): forward + weight
    # gradient, 2 x 2 FLOPs per multiply-accumulate instead of 3 x 2.
    patch_macs = patches * 3 * arch.patch_size**2 * d
    flops = 6.0 * macs + 4.0 * patch_macs
    return ModelSize(params=params, train_flops_per_sample=flops, tokens=tokens)


@dataclass(frozen=True)
class DatasetRead:
    """What a prepared dataset (``source = "shards"``) makes the data servers read from S3."""

    samples: int
    """Training samples per epoch."""
    bytes_total: int
    """The training split's shards, in bytes."""
    cache_bytes: int
    """What each data server's shard cache holds: ``job.dataset.cache_gb``, else an estimate
    of the default (``DEFAULT_CACHE_BYTES``)."""
    cache_note: str

    @property
    def bytes_per_image(self) -> float:
        return self.bytes_total / self.samples

    @property
    def cache_fits(self) -> bool:
        return self.cache_bytes >= self.bytes_total


DEFAULT_CACHE_BYTES = int(0.8 * 50 * 2**30)
"""*Estimate* of the default shard cache on a dataprep instance: 80% of the free space
(``shard_source.CACHE_FREE_SHARE``) of its 100 GiB root volume less about 50 GiB for the AMI,
Docker and the image."""


def dataset_read_of(spec: ClusterSpec, manifest: Any) -> DatasetRead:
    """``DatasetRead`` of a spec whose dataset is prepared, given its ``Manifest``."""
    train = manifest.splits["train"]
    cache_gb = spec.job.dataset.cache_gb
    return DatasetRead(
        samples=len(train),
        bytes_total=sum(s.bytes for s in train.shards),
        cache_bytes=int(cache_gb * 1e9) if cache_gb else DEFAULT_CACHE_BYTES,
        cache_note=f"cache_gb {cache_gb:g}" if cache_gb else "the default cache (estimate)",
    )


@dataclass(frozen=True)
class Workload:
    """The job, as the planner sees it."""

    model: str
    params: int
    train_flops_per_sample: float
    image_size: int
    batch_per_rank: int
    grad_accum_steps: int
    precision: Precision
    strategy: Parallelism
    grad_compression: bool
    recipe: str
    samples_to_train: int | None
    samples_note: str
    """How ``samples_to_train`` was derived (or why it is unknown)."""
    async_checkpoint: bool
    spec_interval_steps: int
    streams_per_server: int = 1
    """gRPC streams (TCP flows) from each trainer rank to each data server."""
    dataset_read: DatasetRead | None = None
    """A prepared dataset's reads from S3 (None: not a prepared dataset, or its manifest was
    not read)."""

    @property
    def cold_epoch_share(self) -> float:
        """The share of training that reads shards from S3 (not the cache): every epoch when
        the cache cannot hold the dataset, else the first of the planned epochs."""
        read = self.dataset_read
        if read is None:
            return 0.0
        if not read.cache_fits or not self.samples_to_train:
            return 1.0
        return min(1.0, read.samples / self.samples_to_train)

    @property
    def samples_per_rank_step(self) -> int:
        """Images one rank processes per optimizer step (micro-batches x accumulation)."""
        return self.batch_per_rank * self.grad_accum_steps

    @property
    def bytes_per_sample(self) -> int:
        """uint8 pixels on the wire (the data plane sends H x W x 3 bytes per image)."""
        return self.image_size * self.image_size * 3

    @property
    def grad_bytes_per_param(self) -> int:
        """Bytes per gradient element on the wire: gradients take the parameters' dtype (fp32,
        also under bf16 autocast) unless DDP compresses them to bf16."""
        return 2 if self.grad_compression else 4

    @property
    def param_bytes_per_param(self) -> int:
        """FSDP/HSDP all-gather parameters in bf16 under the trainer's mixed-precision policy."""
        return 2 if self.precision is Precision.BF16 else 4


def workload_from_spec(
    spec: ClusterSpec,
    samples_override: int | None = None,
    dataset_read: DatasetRead | None = None,
) -> Workload:
    """The spec's job in the planner's units; raises PlanError for a model it cannot size.
    ``dataset_read``: a prepared dataset's size (from its manifest), which also gives the
    samples an epoch-counted job trains."""
    job = spec.job
    arch = priors.VIT_ARCHS.get(job.model.name)
    if arch is None:
        known = ", ".join(sorted(priors.VIT_ARCHS))
        raise PlanError(
            f"job.model.name = {job.model.name!r}: the planner cannot size this model (it knows "
            f"{known}); use one of them, or add its architecture to "
            "training/planner/priors.py VIT_ARCHS"
        )
    overrides = dict(job.model.overrides)
    unknown = sorted(set(overrides) - priors.ARCH_OVERRIDES - priors.NEUTRAL_OVERRIDES)
    if unknown:
        raise PlanError(
            f"job.model.overrides has {', '.join(unknown)}, which the planner cannot size; it "
            f"applies {', '.join(sorted(priors.ARCH_OVERRIDES))} and ignores "
            f"{', '.join(sorted(priors.NEUTRAL_OVERRIDES))}: remove the others to plan"
        )
    try:
        arch = replace(arch, **{k: overrides[k] for k in priors.ARCH_OVERRIDES & set(overrides)})
        # A dataset whose classes the spec leaves to the data: ImageNet-1k's count (the head is
        # a small part of a ViT's parameters and work either way).
        classes = job.dataset.num_classes or SYNTHETIC_CLASSES
        size = vit_size(arch, job.dataset.image_size, classes)
    except TypeError as e:  # an override of the wrong type, e.g. depth = "12"
        raise PlanError(f"job.model.overrides: {e}; give numbers") from e

    world = spec.world_size
    per_step = job.batch_size * job.grad_accum_steps * world
    if samples_override is not None:
        samples: int | None = samples_override
        note = "--samples"
    elif job.total_steps is not None:
        samples = job.total_steps * per_step
        note = (
            f"{job.total_steps} steps x {job.batch_size} per rank x {job.grad_accum_steps} "
            f"accumulation x {world} ranks of the spec"
        )
    elif dataset_read is not None:
        assert job.epochs is not None
        samples = job.epochs * dataset_read.samples
        note = f"{job.epochs} epochs x {dataset_read.samples} training samples (the manifest)"
    elif job.dataset.source is DatasetSource.SYNTHETIC:
        assert job.epochs is not None
        n = job.dataset.num_samples
        train = n - val_count(n, job.dataset.val_fraction)  # the validation share is not trained
        samples = job.epochs * train
        note = f"{job.epochs} epochs x {train} training samples"
    else:
        samples = None
        note = (
            f"unknown: {job.epochs} epochs of a {job.dataset.source.value} dataset of unknown "
            "size; pass --samples N for time and cost to train"
        )
    return Workload(
        model=job.model.name,
        params=size.params,
        train_flops_per_sample=size.train_flops_per_sample,
        image_size=job.dataset.image_size,
        batch_per_rank=job.batch_size,
        grad_accum_steps=job.grad_accum_steps,
        precision=job.precision,
        strategy=job.parallelism.strategy,
        grad_compression=job.parallelism.grad_compression is GradCompression.BF16,
        recipe=job.augmentation.describe(),
        samples_to_train=samples,
        samples_note=note,
        async_checkpoint=job.checkpoint.async_save,
        spec_interval_steps=job.checkpoint.interval_steps,
        streams_per_server=job.dataplane.streams_per_server,
        dataset_read=dataset_read,
    )
