"""The classifier's width, from the data where the data says it.

``job.dataset.num_classes`` left out, a job takes the data's own class count: a folder's class
sub-folders (every directory under ``path``, as ``FolderImages`` and torchvision's
``find_classes`` list them), an S3 prefix's class prefixes (one ``ListObjectsV2`` per 1,000 with
``Delimiter="/"``, never the objects themselves; every one, one that holds no image too, as
``S3Images`` takes them: ``s3.sub_prefix``), a prepared dataset's manifest (its
``classes``); synthetic data has ``SYNTHETIC_CLASSES``. Set, it must equal the data's count:
``ClassCountError`` names both numbers and the fix. Where the data cannot be listed (no such
folder here, no credentials), a count the spec sets is taken as given; a count it leaves out is
an error that says to set it.

Light on purpose (no torch): ``TrainerConfig.from_spec`` calls it while a bad spec is still
reported before the trainer loads torch (a manifest is read with the data package, only for
``shards``).
"""

from __future__ import annotations

import os
from typing import Any

from training.common import aws, s3
from training.spec import SYNTHETIC_CLASSES, DatasetSource, DatasetSpec

FIELD = "job.dataset.num_classes"


class ClassCountError(ValueError):
    """The spec's class count and the data's differ, or neither is known."""


def data_classes(dataset: DatasetSpec, *, client: Any | None = None) -> tuple[int, str]:
    """(the data's class count, where it was read); raises ``OSError``/``ValueError`` (or
    botocore's errors) when the data cannot be listed. Not for synthetic data."""
    path = dataset.path or ""
    if dataset.source is DatasetSource.FOLDER:
        with os.scandir(path) as entries:
            count = sum(1 for e in entries if e.is_dir())
        return count, f"the class folders under {path}"
    if dataset.source is DatasetSource.S3:
        bucket, prefix = s3.parse_s3_uri(path)
        count = len(s3.list_prefixes(client or aws.client("s3"), bucket, prefix))
        return count, f"the class prefixes under {path}"
    from training.data.manifest import load_manifest  # the data package: shards only

    manifest, uri, _ = load_manifest(path, client=client)
    return len(manifest.classes), f"the classes of {uri}"


def resolve_num_classes(dataset: DatasetSpec, *, client: Any | None = None) -> int:
    """The classifier's width for ``dataset`` (see the module doc); ``ClassCountError``."""
    given = dataset.num_classes
    if dataset.source is DatasetSource.SYNTHETIC:
        return given if given is not None else SYNTHETIC_CLASSES
    try:
        found, where = data_classes(dataset, client=client)
    except Exception as e:
        if given is not None:
            return given  # cannot be checked here; the data path refuses labels past it
        raise ClassCountError(
            f"{FIELD} is not set and the dataset's classes cannot be listed here ({e}); set "
            f"{FIELD} to its number of classes"
        ) from e
    if found == 0:
        raise ClassCountError(f"job.dataset.path: no classes found ({where} are none)")
    if given is not None and given != found:
        raise ClassCountError(
            f"{FIELD} = {given}, but the dataset has {found} classes ({where}); set "
            f"{FIELD} = {found}, or leave it out: it defaults to the dataset's"
        )
    return found
