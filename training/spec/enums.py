"""The spec's closed choices (the enums its string fields take), their constants and
``SpecError``."""

from __future__ import annotations

from enum import StrEnum

from training.common.names import MARKET_ON_DEMAND, MARKET_SPOT


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
    SPOT = MARKET_SPOT
    ON_DEMAND = MARKET_ON_DEMAND


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


class LrScale(StrEnum):
    """How ``job.lr_base`` scales to the global batch (timm's ``train.py --lr-base-scale``)."""

    LINEAR = "linear"
    """``lr = lr_base * global_batch / lr_base_size``."""
    SQRT = "sqrt"
    """``lr = lr_base * sqrt(global_batch / lr_base_size)``."""


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
