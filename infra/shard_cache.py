"""Where a dataprep instance keeps its shard cache: NVMe instance store when one volume holds the
cache the spec asks for (``job.dataset.cache_gb``), else the root volume, which the stack then
sizes for it.

Two halves that must agree: the boot lines (``shard_cache_lines``) look at the volumes the
instance actually has; the launch template's root volume (``root_volume_cache_gib``) is sized
from the catalogue (``training/instance_types.py``) for every type the group lists, since the
template cannot know which type Spot or On-Demand capacity delivers.
"""

from __future__ import annotations

import math

from training import instance_types
from training.common.names import HOST_SHARD_CACHE_DIR
from training.spec import ClusterSpec, InstanceGroup, Role

INSTANCE_STORE_MODEL = "Amazon EC2 NVMe Instance Storage"
"""The NVMe model string of an instance store volume: the one Amazon Linux's own udev rules match
to tell instance store from EBS (``70-ec2-nvme-devices.rules`` in
github.com/amazonlinux/amazon-ec2-utils, the package both AMIs are built with)."""
SECTOR_BYTES = 512
"""sysfs gives a block device's size (``/sys/block/<dev>/size``) in 512-byte sectors, whatever
the device's own sector size (include/linux/types.h: "Linux always considers sectors to be 512
bytes long independently of the devices real block size")."""


def cache_bytes(spec: ClusterSpec) -> int | None:
    """The shard cache the spec asks for, in bytes (``cache_gb`` x 10^9, rounded up); None when
    it asks for none (the cache then defaults to the dataset's size, bounded by the free space
    of whatever volume it lands on: ``training/data/shard_source.py``)."""
    cache_gb = spec.job.dataset.cache_gb
    return math.ceil(cache_gb * 1e9) if cache_gb else None


def instance_store_holds(instance_type: str, size_bytes: int) -> bool:
    """Whether one NVMe instance store volume of ``instance_type`` is at least ``size_bytes``
    (the catalogue's figure; a type not in the catalogue counts as having none)."""
    entry = instance_types.lookup(instance_type)
    return entry is not None and entry.instance_store_volume_bytes >= size_bytes


def root_volume_cache_gib(spec: ClusterSpec, group: InstanceGroup) -> int:
    """GiB the group's root volume adds for the shard cache: ``cache_gb`` (GB to GiB, rounded up)
    on a dataprep group when some type it lists has no instance store volume that holds it
    (there the boot leaves the cache on the root volume); 0 otherwise: trainers, no
    ``cache_gb`` (the default cache fits the free space), or every type's store holds it."""
    size = cache_bytes(spec)
    if group.role is not Role.DATAPREP or size is None:
        return 0
    if all(instance_store_holds(t, size) for t in group.instance_types):
        return 0
    return math.ceil(size / 2**30)


def shard_cache_lines(cache_size_bytes: int | None) -> list[str]:
    """Boot lines of a dataprep instance: the shard cache's host folder
    (``HOST_SHARD_CACHE_DIR``), on the first unused NVMe instance store volume of at least
    ``cache_size_bytes`` (``cache_bytes``; any size when None), else on the root volume.

    NVMe instance store volumes are attached at launch without a block device mapping ("NVMe
    instance store volumes are automatically enumerated and assigned a device name. Including
    them in your block device mapping has no effect", API_BlockDeviceMapping) and come
    unformatted ("you must mount the volume"), so the boot finds one by its model in sysfs
    (``$SYS_BLOCK``), skips those already mounted (``$PROC_MOUNTS``) and those smaller than the
    cache (a log line names the sizes; an explicit ``cache_gb`` is a hard cap the cache fills,
    so a smaller volume would run out of space), makes an XFS file system on it and mounts it
    (one volume, however many the type has; no RAID). Nothing here can stop the boot: when no
    volume fits or formatting or mounting fails, the cache stays on the root volume, which the
    stack sizes for it (``root_volume_cache_gib``) unless every listed type has a volume that
    holds it: then a failed format leaves a ``cache_gb`` the root volume may not hold, and the
    console log's line says why the disk fills."""
    need = cache_size_bytes or 0
    cache_gb = f"cache_gb {need / 1e9:g}"
    wanted = f"of at least {need} bytes ({cache_gb}) " if need else ""
    return [
        f"HOST_SHARD_CACHE={HOST_SHARD_CACHE_DIR}",
        "SYS_BLOCK=/sys/block",
        "PROC_MOUNTS=/proc/mounts",
        f"CACHE_BYTES={need}",  # the spec's cache_gb in bytes; 0: no size asked, any volume
        "instance_store_device() {",
        "  local d model sectors bytes",
        '  for d in "$SYS_BLOCK"/nvme*n*; do',
        '    [ -r "$d/device/model" ] || continue',
        '    read -r model < "$d/device/model" || true',  # sysfs pads the model with spaces
        f'    [ "$model" = "{INSTANCE_STORE_MODEL}" ] || continue',
        '    grep -q "^/dev/${d##*/} " "$PROC_MOUNTS" && continue',  # already in use
        '    sectors=0; { read -r sectors < "$d/size"; } 2>/dev/null || true',
        '    case "$sectors" in ""|*[!0-9]*) sectors=0 ;; esac',
        f"    bytes=$((sectors * {SECTOR_BYTES}))",
        '    if [ "$bytes" -lt "$CACHE_BYTES" ]; then',
        '      echo "hetero boot: instance store /dev/${d##*/} has $bytes bytes, less than the '
        f'shard cache asks for ({cache_gb}: $CACHE_BYTES bytes); not used for the cache" >&2',
        "      continue",
        "    fi",
        '    echo "/dev/${d##*/}"',
        "    return 0",
        "  done",
        "  return 1",
        "}",
        'mkdir -p "$HOST_SHARD_CACHE"',
        "if CACHE_DEVICE=$(instance_store_device); then",
        '  if mkfs.xfs -f -K "$CACHE_DEVICE" '
        '&& mount -o noatime "$CACHE_DEVICE" "$HOST_SHARD_CACHE"; then',
        '    echo "hetero boot: the shard cache is on instance store $CACHE_DEVICE"',
        "  else",
        '    echo "hetero boot: could not format or mount instance store $CACHE_DEVICE; '
        'the shard cache stays on the root volume" >&2',
        "  fi",
        "else",
        f'  echo "hetero boot: no instance store volume {wanted}is free; '
        'the shard cache is on the root volume"',
        "fi",
    ]
