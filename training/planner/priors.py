"""Every number the planner assumes rather than reads, in one place, each with its source and date.

Measured figures (``benchmarks/results/*.json``) are read by ``training.planner.results``; what
is here is used where no measurement exists. Values marked *estimate* are judgements to be
replaced by measurements (``hetero bench``) or by AWS's current figures; ``docs/planner.md``
lists every one and the formula that uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

# --------------------------------------------------------------------------------------------
# GPUs: peak dense tensor FLOP/s and the share of it a ViT training step reaches.


@dataclass(frozen=True)
class GpuPeak:
    """Peak dense tensor-core FLOP/s of one GPU (no sparsity)."""

    bf16: float
    """bf16 (fp16 for V100 and T4, which have no bf16)."""
    fp32: float
    """TF32 tensor cores where the GPU has them, else plain fp32."""
    source: str


# Keys are the catalogue's ``gpu_model`` names (training/instance_types.py). The bf16 figures are
# the ones training/trainer/metrics.py PEAK_FLOPS measures MFU against (tests/planner check they
# agree), so an efficiency calibrated from a measured MFU carries over unchanged.
GPU_PEAKS: dict[str, GpuPeak] = {
    "H100": GpuPeak(
        989e12, 494e12, "NVIDIA H100 SXM datasheet, https://www.nvidia.com/en-us/data-center/h100/"
    ),
    "A100": GpuPeak(
        312e12,
        156e12,
        "NVIDIA A100 datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
        "a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
    ),
    "A100-80GB": GpuPeak(312e12, 156e12, "as A100 (same datasheet)"),
    # The A10G (g5) is an AWS variant of the A10 with lower clocks: the A10 figure is an upper
    # bound, so estimates for g5 are optimistic until a measured result replaces them.
    "A10G": GpuPeak(
        125e12,
        62.5e12,
        "NVIDIA A10 datasheet (upper bound for the A10G), https://www.nvidia.com/content/dam/"
        "en-zz/Solutions/Data-Center/a10/pdf/datasheet-new/nvidia-a10-datasheet.pdf",
    ),
    "L40S": GpuPeak(
        362e12, 183e12, "NVIDIA L40S datasheet, https://www.nvidia.com/en-us/data-center/l40s/"
    ),
    "L4": GpuPeak(
        121e12, 60e12, "NVIDIA L4 datasheet, https://www.nvidia.com/en-us/data-center/l4/"
    ),
    "V100": GpuPeak(
        125e12,
        15.7e12,
        "NVIDIA V100 datasheet (fp16 tensor; fp32 without tensor cores), https://images.nvidia.com/"
        "content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf",
    ),
    "T4": GpuPeak(
        65e12,
        8.1e12,
        "NVIDIA T4 datasheet (fp16 tensor; fp32), https://www.nvidia.com/content/dam/en-zz/"
        "Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf",
    ),
}

MFU_PRIOR = 0.35
"""*Estimate*: share of peak FLOP/s a ViT training step reaches (model FLOPs utilisation), used
only for a model, image size and precision with no measured GPU run in
``benchmarks/results/throughput.json``. ViT-B/16 at 224 px in bf16 has one: 0.254 on an H100,
2026-11-28 (batch 256, compile off), ``python -m benchmarks trainer_gpu``, which
``throughput.calibrated_mfu`` uses instead. 0.35 is the project's H100 target (3,000 images/s
for ViT-B/16, ~32 % MFU), rounded; the trainer reached 32.0 % there with ``job.compile`` on."""

# --------------------------------------------------------------------------------------------
# Models: timm ViT architectures, so parameters and FLOPs follow from the spec's model name.


@dataclass(frozen=True)
class VitArch:
    """The hyper-parameters of a timm ``VisionTransformer`` that set its size and compute."""

    patch_size: int
    embed_dim: int
    depth: int
    num_heads: int
    mlp_ratio: float = 4.0
    img_size: int = 224


# From timm/models/vision_transformer.py (the ``vit_*`` entry points' ``model_args``), timm 1.0.
VIT_ARCHS: dict[str, VitArch] = {
    "vit_tiny_patch16_224": VitArch(16, 192, 12, 3),
    "vit_small_patch16_224": VitArch(16, 384, 12, 6),
    "vit_base_patch16_224": VitArch(16, 768, 12, 12),
    "vit_base_patch32_224": VitArch(32, 768, 12, 12),
    "vit_large_patch16_224": VitArch(16, 1024, 24, 16),
    "vit_huge_patch14_224": VitArch(14, 1280, 32, 16),
}

ARCH_OVERRIDES = frozenset({"patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio"})
"""``job.model.overrides`` keys the planner applies to the architecture."""
NEUTRAL_OVERRIDES = frozenset(
    {"img_size", "num_classes", "drop_rate", "drop_path_rate", "attn_drop_rate", "proj_drop_rate"}
)
"""Override keys that change neither parameters nor FLOPs beyond what the planner models
(``img_size`` and ``num_classes`` are taken from the dataset, as the trainer does)."""

VIT_B16_TRAIN_FLOPS_MEASURED = 105.15e9
"""Training FLOPs per 224 px image of vit_base_patch16_224, forward + backward, counted by
torch's FlopCounterMode (benchmarks/trainer_gpu.py); the analytic count in
``training.planner.workload`` equals the counter's (tests/planner/test_plan_tables.py)."""

# --------------------------------------------------------------------------------------------
# Network.

BANDWIDTH_AS_OF = "2026-11-01"
# Baseline (sustained) network bandwidth per instance type in Gbps, and the "up to" burst figure
# where AWS lists one. Source: the "Network specifications" tables of the Amazon EC2 Instance
# Types guide, https://docs.aws.amazon.com/ec2/latest/instancetypes/ac.html#ac_network
# (accelerated computing), .../co.html#co_network (compute optimized), .../gp.html#gp_network
# (general purpose); cross-checked against aws/karpenter-provider-aws
# pkg/providers/instancetype/zz_generated.bandwidth.go, generated from the same pages.
# Instances with a burst figure "can use a network I/O credit mechanism to burst beyond their
# baseline bandwidth" for a limited time (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/
# ec2-instance-network-bandwidth.html): a training job runs for hours, so the planner uses the
# baseline.
BASELINE_GBPS: dict[str, float] = {
    "p5.48xlarge": 3200.0,
    "p4de.24xlarge": 400.0,
    "p4d.24xlarge": 400.0,
    "p3dn.24xlarge": 100.0,
    "p3.2xlarge": 2.5,
    "p3.8xlarge": 10.0,
    "p3.16xlarge": 25.0,
    "g6e.xlarge": 2.5,
    "g6e.12xlarge": 100.0,
    "g6.xlarge": 2.5,
    "g6.2xlarge": 5.0,
    "g6.4xlarge": 10.0,
    "g6.8xlarge": 25.0,
    "g6.12xlarge": 40.0,
    "g6.48xlarge": 100.0,
    "g5.xlarge": 2.5,
    "g5.2xlarge": 5.0,
    "g5.4xlarge": 10.0,
    "g5.8xlarge": 25.0,
    "g5.12xlarge": 40.0,
    "g5.24xlarge": 50.0,
    "g5.48xlarge": 100.0,
    "g4dn.xlarge": 5.0,
    "g4dn.12xlarge": 50.0,
    "c5.9xlarge": 12.0,
    "c5.18xlarge": 25.0,
    "c5n.18xlarge": 100.0,
    "c6i.4xlarge": 6.25,
    "c6i.8xlarge": 12.5,
    "c6i.16xlarge": 25.0,
    "c6i.32xlarge": 50.0,
    "c7i.4xlarge": 6.25,
    "c7i.8xlarge": 12.5,
    "c7i.16xlarge": 25.0,
    "c7i.48xlarge": 50.0,
    "m6i.4xlarge": 6.25,
    "m7i.4xlarge": 6.25,
    "c5d.9xlarge": 12.0,
    "c5d.18xlarge": 25.0,
    "c6id.4xlarge": 6.25,
    "c6id.8xlarge": 12.5,
    "c6id.16xlarge": 25.0,
    "c6id.32xlarge": 50.0,
    "m6id.4xlarge": 6.25,
}
BURST_GBPS: dict[str, float] = {
    "p3.2xlarge": 10.0,
    "g6e.xlarge": 20.0,
    "g6.xlarge": 10.0,
    "g6.2xlarge": 10.0,
    "g6.4xlarge": 25.0,
    "g5.xlarge": 10.0,
    "g5.2xlarge": 10.0,
    "g5.4xlarge": 25.0,
    "g4dn.xlarge": 25.0,
    "c6i.4xlarge": 12.5,
    "c7i.4xlarge": 12.5,
    "m6i.4xlarge": 12.5,
    "m7i.4xlarge": 12.5,
    "c6id.4xlarge": 12.5,
    "m6id.4xlarge": 12.5,
}
SINGLE_FLOW_GBPS_IN_PLACEMENT_GROUP = 10.0
"""One TCP/UDP flow (5-tuple) between instances of one cluster placement group gets up to
10 Gbps (5 Gbps outside one): https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/
ec2-instance-network-bandwidth.html. Bounds one data-plane gRPC stream."""

INTRA_NODE_GBYTES_PER_S: dict[str, float] = {
    # *Estimate*: NCCL all-reduce bus bandwidth between the GPUs of one instance, GB/s.
    # NVLink/NVSwitch types: NVIDIA quotes 600 GB/s (A100) and 900 GB/s (H100) per GPU; NCCL's
    # all-reduce bus bandwidth reaches well under that, so a third is assumed.
    "p5.48xlarge": 300.0,
    "p4de.24xlarge": 200.0,
    "p4d.24xlarge": 200.0,
    "p3dn.24xlarge": 100.0,
    "p3.8xlarge": 100.0,
    "p3.16xlarge": 100.0,
}
INTRA_NODE_PCIE_GBYTES_PER_S = 10.0
"""*Estimate*: all-reduce bus bandwidth between GPUs joined only by PCIe (g4dn, g5, g6, g6e
multi-GPU types), GB/s."""

# --------------------------------------------------------------------------------------------
# Data plane and hosts.

AUGMENT_IMAGES_PER_VCPU_PRIOR = {"standard": 350.0, "randaugment": 175.0}
"""*Estimate*, used only when benchmarks/results has no measurement: augmented 224 px images
per second per vCPU (the measured values, 2026-11-21, were 349 standard and ~177 RandAugment
scaled to 224 px)."""
RECEIVE_IMAGES_PER_VCPU_PRIOR = 6000.0
"""*Estimate*, used only without benchmarks/results/dataplane.json: 224 px images one trainer-host
vCPU receives per second (measured 6,381, 2026-11-21)."""
TRAINER_VCPUS_PER_RANK = 1.0
"""*Estimate*: vCPUs one trainer process (Python loop, CUDA launches) keeps busy."""
DATAPREP_RESERVED_VCPUS = 1
"""*Estimate*: vCPUs of a dataprep instance left to the data server's gRPC process and the OS."""
MAX_DATAPREP_INSTANCES = 16
"""Planner bound on a dataprep group's size: a configuration that needs more is excluded as
"too few CPUs" (a bigger group is one more Spot request to fill in one placement group)."""
DATAPREP_TYPES = (
    "c5.9xlarge",
    "c5.18xlarge",
    "c5n.18xlarge",
    "c6i.4xlarge",
    "c6i.8xlarge",
    "c6i.16xlarge",
    "c6i.32xlarge",
    "c7i.4xlarge",
    "c7i.8xlarge",
    "c7i.16xlarge",
    "c7i.48xlarge",
    "m6i.4xlarge",
    "m7i.4xlarge",
    # NVMe instance store (a dataprep host keeps its shard cache there: infra/shard_cache.py).
    # Dearer per vCPU than their EBS-only twins, and the planner does not credit what a local
    # cache saves in S3 reads, so they win on price alone; `--compare '... + M x c6id.8xlarge'`
    # prices one as a fixed dataprep group.
    "c5d.9xlarge",
    "c5d.18xlarge",
    "c6id.4xlarge",
    "c6id.8xlarge",
    "c6id.16xlarge",
    "c6id.32xlarge",
    "m6id.4xlarge",
)
"""CPU types the planner tries for the dataprep group (plus the spec's own dataprep types). The
planner assumes a vCPU augments as fast on each (*estimate*; the measurement is from one Xeon),
so the cheapest vCPU that the network can serve wins."""

# --------------------------------------------------------------------------------------------
# Checkpoints, recovery, preemption.

CHECKPOINT_S3_S_PRIOR = 17.5
"""Used only without benchmarks/results/checkpoint.json: seconds from stop to a durable S3
checkpoint of ViT-B/16 + AdamW (measured 2026-11-22 against moto on loopback)."""
CHECKPOINT_ASYNC_STALL_S_PRIOR = 0.53
"""Used only without checkpoint.json: training stall per async periodic save, same model."""
CHECKPOINT_REFERENCE_PARAMS = 86_567_656
"""Parameters of the model the checkpoint measurement used (vit_base_patch16_224): save times
scale with parameters (the checkpoint is parameters + AdamW state)."""
RECOVERY_S = 21.8
"""Measured (README, rehearsal 2026-11-22): slowest recovery, a replacement's launcher start to
its first step (13.8-21.8 s)."""
REPLACEMENT_S = 120.0
"""*Estimate*: from an interruption to a replacement instance's launcher start (Auto Scaling
launch, boot, image pull). Not measured on AWS."""
SECONDS_PER_MONTH = 730 * 3600
"""The month of the interruption bands, taken as 730 hours (AWS's billing month)."""

INTERRUPTION_AS_OF = "2025-06-28"
SPOT_ADVISOR_SOURCE = (
    "Spot Instance Advisor feed spot-advisor-data.json, us-east-1 Linux, as stored on "
    "2025-06-28 in github.com/alexei-led/spotinfo internal/spot/data/spot-advisor-data.json"
)
"""Where the offline interruption bands and Spot savings come from. The advisor
(https://aws.amazon.com/ec2/spot/instance-advisor/) publishes them for the trailing month; its
JSON feed (https://spot-bid-advisor.s3.amazonaws.com/spot-advisor-data.json) is not described
in any AWS document found, so the planner does not call it."""
# Spot Instance Advisor bands ("frequency of interruption": the share of Spot capacity of a type
# that AWS reclaimed over the trailing month), and the rate the planner takes from each band
# (*estimate*: the band's midpoint; ">20%" is taken as 25 %).
INTERRUPTION_BAND_RATE: dict[str, float] = {
    "<5%": 0.025,
    "5-10%": 0.075,
    "10-15%": 0.125,
    "15-20%": 0.175,
    ">20%": 0.25,
}
# Per type, us-east-1 Linux, from SPOT_ADVISOR_SOURCE (the feed's "r" band index): a snapshot,
# older than the prices; the bands change monthly and by region.
INTERRUPTION_BAND: dict[str, str] = {
    "p5.48xlarge": ">20%",
    "p4de.24xlarge": "<5%",
    "p4d.24xlarge": "10-15%",
    "p3dn.24xlarge": ">20%",
    "p3.2xlarge": ">20%",
    "p3.8xlarge": ">20%",
    "p3.16xlarge": ">20%",
    "g6e.xlarge": "5-10%",
    "g6e.12xlarge": ">20%",
    "g6.xlarge": ">20%",
    "g6.2xlarge": ">20%",
    "g6.4xlarge": ">20%",
    "g6.8xlarge": ">20%",
    "g6.12xlarge": ">20%",
    "g6.48xlarge": ">20%",
    "g5.xlarge": ">20%",
    "g5.2xlarge": "15-20%",
    "g5.4xlarge": "10-15%",
    "g5.8xlarge": ">20%",
    "g5.12xlarge": ">20%",
    "g5.24xlarge": ">20%",
    "g5.48xlarge": ">20%",
    "g4dn.xlarge": "15-20%",
    "g4dn.12xlarge": "10-15%",
    "c5.9xlarge": "<5%",
    "c5.18xlarge": "10-15%",
    "c5n.18xlarge": "<5%",
    "c6i.4xlarge": "15-20%",
    "c6i.8xlarge": "5-10%",
    "c6i.16xlarge": "5-10%",
    "c6i.32xlarge": "10-15%",
    "c7i.4xlarge": "15-20%",
    "c7i.8xlarge": "10-15%",
    "c7i.16xlarge": "5-10%",
    "c7i.48xlarge": ">20%",
    "m6i.4xlarge": ">20%",
    "m7i.4xlarge": "5-10%",
    "c5d.9xlarge": "5-10%",
    "c5d.18xlarge": "10-15%",
    "c6id.4xlarge": ">20%",
    "c6id.8xlarge": ">20%",
    "c6id.16xlarge": ">20%",
    "c6id.32xlarge": "15-20%",
    "m6id.4xlarge": ">20%",
    "t3.medium": "<5%",
    "t3.large": "5-10%",
    "t3.xlarge": "10-15%",
}
DEFAULT_INTERRUPTION_BAND = ">20%"
"""Band assumed for a Spot type missing from INTERRUPTION_BAND (the pessimistic end)."""

# --------------------------------------------------------------------------------------------
# Prices.

SPOT_PRICES_AS_OF = INTERRUPTION_AS_OF
# *Estimate*: Spot price as a share of the On-Demand price per type, us-east-1 Linux: 1 - the
# advisor's "savings over On-Demand" ("s") from SPOT_ADVISOR_SOURCE, applied to the offline
# On-Demand price (live mode reads DescribeSpotPriceHistory instead). The feed does not say
# which On-Demand prices it compared with; for p4d, p4de and p5, whose list prices AWS cut in
# June 2025, the share may be of the old price. A type missing here uses the spec's
# ``job.prices.spot_price_ratio``.
SPOT_PRICE_RATIO: dict[str, float] = {
    "p5.48xlarge": 0.48,
    "p4de.24xlarge": 0.35,
    "p4d.24xlarge": 0.33,
    "p3dn.24xlarge": 0.13,
    "p3.2xlarge": 0.2,
    "p3.8xlarge": 0.14,
    "p3.16xlarge": 0.17,
    "g6e.xlarge": 0.42,
    "g6e.12xlarge": 0.44,
    "g6.xlarge": 0.51,
    "g6.2xlarge": 0.42,
    "g6.4xlarge": 0.43,
    "g6.8xlarge": 0.44,
    "g6.12xlarge": 0.41,
    "g6.48xlarge": 0.31,
    "g5.xlarge": 0.41,
    "g5.2xlarge": 0.42,
    "g5.4xlarge": 0.4,
    "g5.8xlarge": 0.41,
    "g5.12xlarge": 0.42,
    "g5.24xlarge": 0.43,
    "g5.48xlarge": 0.29,
    "g4dn.xlarge": 0.36,
    "g4dn.12xlarge": 0.36,
    "c5.9xlarge": 0.42,
    "c5.18xlarge": 0.28,
    "c5n.18xlarge": 0.37,
    "c6i.4xlarge": 0.43,
    "c6i.8xlarge": 0.39,
    "c6i.16xlarge": 0.33,
    "c6i.32xlarge": 0.26,
    "c7i.4xlarge": 0.39,
    "c7i.8xlarge": 0.38,
    "c7i.16xlarge": 0.37,
    "c7i.48xlarge": 0.25,
    "m6i.4xlarge": 0.34,
    "m7i.4xlarge": 0.48,
    "c5d.9xlarge": 0.41,
    "c5d.18xlarge": 0.34,
    "c6id.4xlarge": 0.45,
    "c6id.8xlarge": 0.41,
    "c6id.16xlarge": 0.35,
    "c6id.32xlarge": 0.28,
    "m6id.4xlarge": 0.33,
    "t3.medium": 0.44,
    "t3.large": 0.38,
    "t3.xlarge": 0.4,
}
