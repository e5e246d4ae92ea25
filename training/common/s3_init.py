"""``job.model.init = "s3://..."`` in a bucket the cluster cannot read: its copy in the checkpoint
bucket, made where the job is started.

The instance role and the SageMaker execution role may read the checkpoint bucket's checkpoint
prefix (and the dataset), nothing else, so the commands that start a job on AWS
(``hetero job start``, ``hetero sagemaker submit``) copy an ``s3://`` init that is not under the
checkpoint prefix there first, with the user's credentials, server-side (S3 ``CopyObject``, a
multipart ``UploadPartCopy`` above ``MULTIPART_COPY_BYTES``: boto3's managed ``copy``), and the
job reads the copy (``HETERO_INIT_URI``, as for a staged ``timm:`` init,
``training.common.timm_hub``).

``plan_s3_init`` reads the source (``HeadObject`` of a file and of the ``config.json`` beside it,
``ListObjectsV2`` of a folder, bounded by ``MAX_OBJECTS`` and ``MAX_BYTES``) and names the copy's
folder: ``<checkpoint prefix>/init/<sha256>/``, the digest of the source's URI and each object's
relative key, size and ETag (``source_sha256``), so a changed source gets a new folder and the
same one is found again. ``copy_staged`` copies each object unless it is there with its size
(``HeadObject``), with ``CopySourceIfMatch`` = the ETag read, so the copy is the version the
folder names. An init already under the checkpoint prefix is read where it is (no plan).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, replace
from typing import Any

from training.common.s3 import (
    error_code,
    head_object,
    is_denied,
    is_not_found,
    is_s3_uri,
    parse_s3_object,
    parse_s3_uri,
    s3_uri,
)
from training.common.timm_hub import (
    CONFIG_FILE,
    STAGED_FOLDER,
    WEIGHT_FILES,
    StagingError,
    human_size,
)

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pth.tar", ".pt", ".bin")
"""An ``s3://`` init ending in one of these names a weights file; any other names a folder
(``training.trainer.init_weights`` reads it so)."""
ZIP_SUFFIX = ".zip"
"""A zipped hub-form folder: one object, read as a folder by the trainer."""
MAX_OBJECTS = 100
"""A folder init with more objects is refused: a model's folder holds a few files."""
MAX_BYTES = 100 * 10**9
"""Nor is one above 100 GB copied (a ViT-L/16 is about 1.2 GB)."""
MULTIPART_COPY_BYTES = 32 << 20
"""Objects above this are copied in parts of this size (``UploadPartCopy``, boto3's managed copy;
CopyObject takes at most 5 GB), each part well within the client's read timeout."""


class S3InitError(ValueError):
    """The ``s3://`` init cannot be staged: the message names the URI and what to fix."""


def is_s3_init(init: str | None) -> bool:
    return bool(init) and is_s3_uri(str(init).strip())


def is_file_init(uri: str) -> bool:
    """Whether ``uri`` names one object (a weights file or a zip) rather than a folder."""
    return uri.lower().endswith((*WEIGHT_SUFFIXES, ZIP_SUFFIX))


def under_prefix(uri: str, checkpoint_base_uri: str) -> bool:
    """Whether ``uri`` is under the checkpoint prefix, which the cluster's roles read."""
    base = checkpoint_base_uri if checkpoint_base_uri.endswith("/") else checkpoint_base_uri + "/"
    return uri.strip().startswith(base)


@dataclass(frozen=True)
class SourceObject:
    """One object of the source: its key relative to the source's folder, size and ETag."""

    name: str
    size: int
    etag: str


@dataclass(frozen=True)
class StagedS3Init:
    """An ``s3://`` init and its copy in the checkpoint bucket."""

    init: str
    """``job.model.init`` as the spec gives it."""
    bucket: str
    folder: str
    """The source's folder (the file's for a file init), a key prefix ending in '/' or empty."""
    objects: tuple[SourceObject, ...]
    """What is copied, the entry first (the weights) and ``config.json`` last."""
    entry: str
    """The file the init names (relative to ``folder``), or "" for a folder."""
    staged: str
    """The copy's folder, ``s3://<checkpoint bucket>/<prefix>/init/<sha256>/``."""
    copied: tuple[str, ...] = ()
    """The objects copied now (``s3://`` URIs); empty when all were there (or a dry run)."""

    @property
    def uri(self) -> str:
        """What the job reads (``HETERO_INIT_URI``): the copy of the file, or the folder."""
        return self.staged + self.entry

    @property
    def size(self) -> int:
        return sum(o.size for o in self.objects)

    def describe(self) -> str:
        done = "copied now" if self.copied else "already there"
        return (
            f"{self.init} -> {self.uri} ({done} ({human_size(self.size)}, "
            f"{len(self.objects)} object(s)))"
        )


def source_sha256(init: str, objects: tuple[SourceObject, ...]) -> str:
    """sha256 of the source's URI and each object's name, size and ETag: the copy's folder."""
    digest = hashlib.sha256(f"{init.strip()}\0".encode())
    for o in sorted(objects, key=lambda o: o.name):
        digest.update(f"{o.name}\0{o.size}\0{o.etag}\0".encode())
    return digest.hexdigest()


def plan_s3_init(init: str, *, s3: Any, checkpoint_base_uri: str) -> StagedS3Init | None:
    """Where the ``s3://`` init ``init`` is copied under ``checkpoint_base_uri`` (nothing is
    copied yet), or None when it is under that prefix already. Reads the source only;
    ``S3InitError`` naming the URI and the fix when it is missing, unreadable, or too big."""
    uri = init.strip()
    if under_prefix(uri, checkpoint_base_uri):
        return None
    from botocore.exceptions import BotoCoreError, ClientError  # Deferred: boto3 where S3 is.

    try:
        if is_file_init(uri):
            bucket, folder, entry, objects = _file_source(s3, uri)
        else:
            bucket, folder = _split(uri)
            entry, objects = "", _folder_source(s3, uri, bucket, folder)
    except ClientError as e:
        raise S3InitError(_read_error(uri, e)) from e
    except BotoCoreError as e:
        raise S3InitError(f"job.model.init {uri}: S3 could not be reached: {e}") from e
    if sum(o.size for o in objects) > MAX_BYTES:
        raise S3InitError(_too_big(uri, objects))
    target_bucket, prefix = parse_s3_uri(checkpoint_base_uri)
    staged = s3_uri(target_bucket, f"{prefix}{STAGED_FOLDER}{source_sha256(uri, objects)}/")
    return StagedS3Init(init, bucket, folder, objects, entry, staged)


def _split(uri: str, *, file: bool = False) -> tuple[str, str]:
    """(bucket, key) of a file's URI, (bucket, prefix) of a folder's; ``S3InitError`` else."""
    try:
        return parse_s3_object(uri) if file else parse_s3_uri(uri)
    except ValueError as e:
        raise S3InitError(f"job.model.init = {e}") from None


def _file_source(s3: Any, uri: str) -> tuple[str, str, str, tuple[SourceObject, ...]]:
    """(bucket, folder, file name, objects) of a file init: the file, and the ``config.json``
    beside a weights file when the user may read one (the trainer reads it too)."""
    bucket, key = _split(uri, file=True)
    folder, _, name = key.rpartition("/")
    folder = f"{folder}/" if folder else ""
    found = head_object(s3, bucket, key)
    if found is None:
        raise S3InitError(
            f"job.model.init: no object at {uri}; check the bucket and key "
            f"(aws s3 ls s3://{bucket}/{folder}) and fix job.model.init"
        )
    objects = [_object(name, found)]
    if not name.lower().endswith(ZIP_SUFFIX):
        config = _optional_head(s3, bucket, folder + CONFIG_FILE)
        if config is not None:
            objects.append(_object(CONFIG_FILE, config))
    return bucket, folder, name, tuple(objects)


def _optional_head(s3: Any, bucket: str, key: str) -> dict[str, Any] | None:
    """HeadObject of an object that may be absent; a denied one counts as absent (the trainer,
    reading it itself, takes a file without its config.json too), with a warning."""
    from botocore.exceptions import ClientError

    try:
        return head_object(s3, bucket, key)
    except ClientError as e:
        if not is_denied(e):
            raise
        log.warning("job.model.init: s3://%s/%s cannot be read (%s): not copied", bucket, key, e)
        return None


def _folder_source(s3: Any, uri: str, bucket: str, folder: str) -> tuple[SourceObject, ...]:
    """Every object under ``folder`` (but folder markers), at most ``MAX_OBJECTS``, the weights
    first and ``config.json`` last; ``S3InitError`` when it is empty, too big or no hub-form
    folder (no weights file at its top)."""
    objects: list[SourceObject] = []
    token: dict[str, str] = {}
    while True:
        page = s3.list_objects_v2(Bucket=bucket, Prefix=folder, **token)
        objects += [
            SourceObject(o["Key"][len(folder) :], int(o["Size"]), _etag(o))
            for o in page.get("Contents", [])
            if not o["Key"].endswith("/")
        ]
        if len(objects) > MAX_OBJECTS:
            raise S3InitError(_too_big(uri, tuple(objects), listed_all=not page.get("IsTruncated")))
        if not page.get("IsTruncated"):
            break
        token = {"ContinuationToken": page["NextContinuationToken"]}
    if not objects:
        raise S3InitError(
            f"job.model.init: no object under {uri}; check the folder (aws s3 ls {uri}) and fix "
            "job.model.init"
        )
    if not {o.name for o in objects} & set(WEIGHT_FILES):
        raise S3InitError(
            f"job.model.init: {uri} has neither {' nor '.join(WEIGHT_FILES)} at its top, so it is "
            "no hub-form folder; point job.model.init at the folder that holds them, or at the "
            "weights file itself"
        )
    order = {name: i for i, name in enumerate(WEIGHT_FILES)}
    return tuple(
        sorted(objects, key=lambda o: (o.name == CONFIG_FILE, order.get(o.name, 9), o.name))
    )


def _object(name: str, head: dict[str, Any]) -> SourceObject:
    return SourceObject(name, int(head.get("ContentLength", 0)), _etag(head))


def _etag(answer: dict[str, Any]) -> str:
    return str(answer.get("ETag", "")).strip('"')


def _read_error(uri: str, error: Exception) -> str:
    """What a refused read of the source says: the URI, the error and the fix."""
    if error_code(error) == "NoSuchBucket":
        return f"job.model.init: no bucket for {uri} ({error}); fix job.model.init"
    if is_not_found(error):
        return f"job.model.init: no object at {uri} ({error}); fix job.model.init"
    if is_denied(error):
        return (
            f"job.model.init: your credentials cannot read {uri} ({error}); the job is started "
            "with a copy in the checkpoint bucket, made with them: allow them s3:GetObject on "
            "its objects and s3:ListBucket on its bucket (S3 also answers 403 for a missing "
            "object to credentials that may not list the bucket), or check the URI"
        )
    return f"job.model.init: cannot read {uri}: {error}"


def _too_big(uri: str, objects: tuple[SourceObject, ...], *, listed_all: bool = True) -> str:
    count = f"{len(objects)}" if listed_all else f"more than {MAX_OBJECTS}"
    return (
        f"job.model.init: {uri} holds {count} object(s), "
        f"{human_size(sum(o.size for o in objects))}{'' if listed_all else ' and more'}: more "
        f"than a model's folder (at most {MAX_OBJECTS} objects and {human_size(MAX_BYTES)} are "
        "copied into the checkpoint bucket); point job.model.init at the hub-form folder "
        "(config.json + model.safetensors) or at the weights file itself"
    )


# -- the copy -----------------------------------------------------------------------------------


def copy_staged(staged: StagedS3Init, s3: Any) -> StagedS3Init:
    """Copy ``staged``'s objects into its folder, server-side, unless each is there with its
    size (the folder names the source's ETags, so one there is the same object). The entry goes
    first and ``config.json`` last. ``StagingError`` naming both ends and the permissions when
    S3 refuses, or when the source changed since it was read."""
    from boto3.exceptions import Boto3Error  # Deferred: boto3 only where S3 is used.
    from boto3.s3.transfer import TransferConfig
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix = parse_s3_uri(staged.staged)
    config = TransferConfig(
        multipart_threshold=MULTIPART_COPY_BYTES, multipart_chunksize=MULTIPART_COPY_BYTES
    )
    copied: list[str] = []
    for o in staged.objects:
        source = s3_uri(staged.bucket, staged.folder + o.name)
        try:
            if (head_object(s3, bucket, prefix + o.name) or {}).get("ContentLength") == o.size:
                continue
            s3.copy(
                {"Bucket": staged.bucket, "Key": staged.folder + o.name},
                bucket,
                prefix + o.name,
                ExtraArgs={"CopySourceIfMatch": f'"{o.etag}"'} if o.etag else None,
                Config=config,
            )
        except (Boto3Error, BotoCoreError, ClientError) as e:
            raise StagingError(_copy_error(source, staged.staged + o.name, e)) from e
        copied.append(staged.staged + o.name)
    log.info(
        "job.model.init %s: %s %s",
        staged.init,
        f"copied {len(copied)} object(s) to" if copied else "already staged at",
        staged.staged,
    )
    return replace(staged, copied=tuple(copied))


def _copy_error(source: str, target: str, error: Exception) -> str:
    if error_code(error) in {"PreconditionFailed", "412"}:
        return (
            f"could not stage job.model.init: {source} changed while it was being copied to "
            f"{target}; run the command again"
        )
    return (
        f"could not copy job.model.init {source} to {target}: {error} (the copy is made with "
        "your credentials: s3:GetObject on the source, s3:GetObject and s3:PutObject on the "
        "checkpoint bucket's objects)"
    )


def stage_s3_init(init: str, *, s3: Any, checkpoint_base_uri: str) -> StagedS3Init | None:
    """``copy_staged(plan_s3_init(...), s3)``; None when ``init`` needs no copy."""
    staged = plan_s3_init(init, s3=s3, checkpoint_base_uri=checkpoint_base_uri)
    return copy_staged(staged, s3) if staged is not None else None
