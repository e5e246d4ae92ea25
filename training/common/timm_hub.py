"""``job.model.init = "timm:NAME.TAG"``: a timm model's pretrained weights on the Hugging Face Hub,
found through the user's Hugging Face cache, and their content-addressed copy in S3.

``resolve_timm_init`` asks timm's registry for the pretrained config of ``NAME.TAG`` (its
``hf_hub_id``, e.g. ``timm/vit_base_patch16_224.augreg2_in21k_ft_in1k``) and huggingface_hub's
``hf_hub_download`` for the repository's ``config.json`` and ``model.safetensors`` (else
``pytorch_model.bin``, as timm's own hub loader falls back): from the cache when they are there,
else downloaded into it. huggingface_hub's settings apply as they do for timm (``HF_HUB_CACHE``,
``HF_HOME``, ``HF_HUB_OFFLINE``, ``HF_TOKEN``). The result is a hub-form folder (the snapshot
folder in the cache), which ``training.trainer.init_weights`` reads like any other.

The cluster's instances sit in subnets with no internet route, so the commands that start a job
on AWS (``hetero job start``, ``hetero sagemaker submit``) resolve the init on the machine they
run on and stage the folder's files into the checkpoint bucket first (``plan_staging`` says
where, ``upload_staged`` uploads): ``<checkpoint prefix>/init/<sha256>/``, the digest of the
files' names, sizes and bytes (``content_sha256``), each file uploaded only when absent. The job
then reads that folder (``HETERO_INIT_URI``). ``cdk deploy`` ships the same two files as a CDK
asset instead (``infra/init_asset.py``). The module imports neither timm nor huggingface_hub
until a ``timm:`` init is resolved (timm imports torch).
"""

from __future__ import annotations

import difflib
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.common.s3 import head_object, parse_s3_uri, s3_uri

log = logging.getLogger(__name__)

TIMM_SCHEME = "timm:"
"""``job.model.init = "timm:NAME.TAG"``: a timm model name with its pretrained tag."""
CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
"""A hub repository's weights file, in the order timm's hub loader takes them (timm's
``HF_SAFE_WEIGHTS_NAME``, ``HF_WEIGHTS_NAME``)."""
STAGED_FOLDER = "init/"
"""Under the checkpoint prefix: ``init/<sha256>/`` holds one staged init's files."""
_CHUNK = 8 << 20


class HubInitError(ValueError):
    """A ``timm:`` init that cannot be resolved; the message says why and the fix."""


class StagingError(RuntimeError):
    """An init's files could not be checked for, uploaded or copied to S3 (a ``timm:`` one's,
    here; an ``s3://`` one's, ``training.common.s3_init``): the message names where, the AWS
    error and the permissions it needs."""


def is_timm_init(init: str | None) -> bool:
    return bool(init) and str(init).strip().startswith(TIMM_SCHEME)


def timm_model_name(init: str) -> str:
    """``NAME.TAG`` of ``timm:NAME.TAG``; ``HubInitError`` saying what the form is otherwise
    (no timm needed: the spec checks the form with it)."""
    name = init.strip().removeprefix(TIMM_SCHEME)
    arch, dot, tag = name.partition(".")
    if not arch or not dot or not tag or any(c.isspace() or c in "/@:" for c in name):
        raise HubInitError(
            f"{init!r} is not timm:NAME.TAG: give a timm model name with its pretrained tag, "
            "e.g. timm:vit_base_patch16_224.augreg2_in21k_ft_in1k (timm.list_pretrained() "
            "lists them)"
        )
    return name


@dataclass(frozen=True)
class HubInit:
    """A ``timm:`` init resolved to its files in the Hugging Face cache."""

    init: str
    """``job.model.init`` as the spec gives it (``timm:NAME.TAG``)."""
    model: str
    """``NAME.TAG``."""
    repo_id: str
    """The Hub repository timm's pretrained config names (``hf_hub_id``)."""
    folder: Path
    """The snapshot folder in the cache: a hub-form folder."""
    files: tuple[Path, ...]
    """``config.json`` and the weights file, in ``folder``."""

    @property
    def size(self) -> int:
        """Bytes of ``files``."""
        return sum(f.stat().st_size for f in self.files)

    def describe(self) -> str:
        names = ", ".join(f.name for f in self.files)
        return (
            f"{self.init}: {human_size(self.size)} ({names}) from the Hugging Face Hub "
            f"repository {self.repo_id}, in the cache at {self.folder}"
        )


def human_size(size: int) -> str:
    """Bytes in decimal units (``22.9 MB``), as the Hub shows file sizes."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def resolve_timm_init(init: str) -> HubInit:
    """The files of ``timm:NAME.TAG`` in the Hugging Face cache, downloaded there first when
    missing (unless ``HF_HUB_OFFLINE``). ``HubInitError`` naming the fix: an unknown name or
    tag (with the close ones timm knows), weights timm does not take from the Hub, or files
    that are neither cached nor downloadable."""
    name = timm_model_name(init)
    # Deferred: timm imports torch; only a timm: init needs it.
    from timm.models import get_pretrained_cfg, is_model, list_pretrained

    arch, tag = name.split(".", 1)
    if not is_model(arch):
        raise HubInitError(f"{init!r}: timm has no model {arch!r}{_close(arch, list_pretrained())}")
    try:
        cfg = get_pretrained_cfg(name, allow_unregistered=False)
    except RuntimeError:
        tags = list_pretrained(f"{arch}.*")
        raise HubInitError(
            f"{init!r}: timm has no pretrained tag {tag!r} for {arch}"
            + (f"; its tags: {', '.join(t.split('.', 1)[1] for t in tags)}" if tags else "")
        ) from None
    hub_id = getattr(cfg, "hf_hub_id", None)
    hub_file = getattr(cfg, "hf_hub_filename", None)
    if not hub_id or (hub_file and hub_file not in WEIGHT_FILES):
        where = getattr(cfg, "url", None) or hub_file or "elsewhere"
        raise HubInitError(
            f"{init!r}: timm does not load these weights from a Hugging Face Hub repository in "
            f"timm's form ({where}); save them with timm on a machine with internet "
            f"(timm.models.save_for_hf(timm.create_model({name!r}, pretrained=True), DIR, "
            "safe_serialization=True)) and give DIR or its s3:// copy"
        )
    repo_id, _, revision = str(hub_id).partition("@")
    config = _download(init, repo_id, CONFIG_FILE, revision or None)
    assert config is not None  # missing_ok is off
    weights: Path | None = None
    not_cached: HubInitError | None = None
    for filename in WEIGHT_FILES:
        try:
            weights = _download(init, repo_id, filename, revision or None, missing_ok=True)
        except HubInitError as e:  # not cached: the other file may be
            not_cached = not_cached or e
            continue
        if weights is not None:
            break
    if weights is None:
        raise not_cached or HubInitError(
            f"{init!r}: the Hub repository {repo_id} has no {' or '.join(WEIGHT_FILES)}, so it "
            "is not in timm's hub form; give a hub-form folder or weights file instead"
        )
    if weights.parent != config.parent:
        raise HubInitError(
            f"{init!r}: {config.name} and {weights.name} of {repo_id} are from two revisions "
            f"({config.parent.name}, {weights.parent.name}); run the command again"
        )
    return HubInit(
        init=init.strip(),
        model=name,
        repo_id=repo_id,
        folder=config.parent,
        files=(config, weights),
    )


def _close(word: str, names: list[str]) -> str:
    archs = sorted({n.split(".", 1)[0] for n in names})
    close = difflib.get_close_matches(word, archs, n=3)
    return f" (close: {', '.join(close)})" if close else ""


def _download(
    init: str, repo_id: str, filename: str, revision: str | None, *, missing_ok: bool = False
) -> Path | None:
    """``hf_hub_download`` of one file: its path in the cache. None when the repository has no
    such file and ``missing_ok``; ``HubInitError`` naming the fix otherwise."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(hf_hub_download(repo_id, filename, revision=revision))
    except LocalEntryNotFoundError:
        # Not in the cache, and the Hub was not asked (offline) or could not be reached.
        raise HubInitError(_not_cached(init, repo_id, filename, constants)) from None
    except GatedRepoError as e:
        raise HubInitError(
            f"{init!r}: the Hub repository {repo_id} is gated: accept its terms on "
            f"huggingface.co and log in (hf auth login, or HF_TOKEN) ({_first_line(e)})"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise HubInitError(
            f"{init!r}: the Hub has no repository {repo_id} ({_first_line(e)}); check the name "
            "against timm.list_pretrained()"
        ) from None
    except EntryNotFoundError:
        if missing_ok:
            return None
        raise HubInitError(
            f"{init!r}: the Hub repository {repo_id} has no {filename}, so it is not in timm's "
            "hub form; give a hub-form folder or weights file instead"
        ) from None
    except OSError as e:  # the Hub's HTTP errors, a full disk
        raise HubInitError(
            f"{init!r}: cannot download {filename} of {repo_id}: {_first_line(e)}"
        ) from None


def _not_cached(init: str, repo_id: str, filename: str, constants: Any) -> str:
    offline = bool(getattr(constants, "HF_HUB_OFFLINE", False))
    why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face Hub could not be reached"
    return (
        f"{init!r}: {filename} of {repo_id} is not in the Hugging Face cache "
        f"({constants.HF_HUB_CACHE}) and {why}; download it once where the Hub is reachable "
        f"(hf download {repo_id} {CONFIG_FILE} {WEIGHT_FILES[0]}), or point HF_HUB_CACHE at a "
        "cache that has it"
    )


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# -- the staged copy ----------------------------------------------------------------------------


def content_sha256(files: tuple[Path, ...]) -> str:
    """sha256 of the files' names and bytes, in name order: the staged folder's name."""
    digest = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def staged_uri(checkpoint_base_uri: str, digest: str) -> str:
    """``<checkpoint prefix>/init/<digest>/``: where a staged init's files go."""
    bucket, prefix = parse_s3_uri(checkpoint_base_uri)
    return s3_uri(bucket, f"{prefix}{STAGED_FOLDER}{digest}/")


@dataclass(frozen=True)
class StagedInit:
    """A ``timm:`` init's files in the checkpoint bucket."""

    hub: HubInit
    uri: str
    """The staged hub-form folder, ``s3://bucket/<prefix>/init/<sha256>/``."""
    uploaded: tuple[str, ...]
    """The objects uploaded now (``s3://`` URIs); empty when the folder was there already (or
    nothing was uploaded: a dry run)."""

    @property
    def init(self) -> str:
        """``job.model.init`` as the spec gives it."""
        return self.hub.init

    @property
    def size(self) -> int:
        return self.hub.size

    def describe(self) -> str:
        done = (
            f"uploaded now ({human_size(self.hub.size)})"
            if self.uploaded
            else f"already there ({human_size(self.hub.size)})"
        )
        return f"{self.hub.init} -> {self.uri} ({done})"


def plan_staging(hub: HubInit, checkpoint_base_uri: str) -> StagedInit:
    """Where ``hub``'s files go under ``checkpoint_base_uri``: ``init/<content_sha256>/``
    (nothing is uploaded or asked of AWS)."""
    return StagedInit(hub, staged_uri(checkpoint_base_uri, content_sha256(hub.files)), ())


def stage_timm_init(hub: HubInit, *, s3: Any, checkpoint_base_uri: str) -> StagedInit:
    """``upload_staged(plan_staging(hub, checkpoint_base_uri), s3)``."""
    return upload_staged(plan_staging(hub, checkpoint_base_uri), s3)


def upload_staged(staged: StagedInit, s3: Any) -> StagedInit:
    """Upload ``staged``'s files to its folder unless each is there with its size (the key
    names the content, so a file there is the same file). The weights go first and
    ``config.json`` last. ``StagingError`` when S3 refuses or cannot be reached."""
    from boto3.exceptions import Boto3Error  # Deferred: boto3 only where S3 is used.
    from botocore.exceptions import BotoCoreError, ClientError

    hub, uri = staged.hub, staged.uri
    bucket, prefix = parse_s3_uri(uri)
    files = sorted(hub.files, key=lambda p: p.name == CONFIG_FILE)
    try:
        missing = [
            path
            for path in files
            if (head_object(s3, bucket, prefix + path.name) or {}).get("ContentLength")
            != path.stat().st_size
        ]
        for path in missing:
            s3.upload_file(str(path), bucket, prefix + path.name)
    except (Boto3Error, BotoCoreError, ClientError) as e:
        raise StagingError(
            f"could not stage job.model.init {hub.init} at {uri}: {e} (this needs s3:GetObject "
            "and s3:PutObject on the checkpoint bucket's objects, and s3:ListBucket on it)"
        ) from e
    uploaded = tuple(s3_uri(bucket, prefix + p.name) for p in missing)
    log.info(
        "job.model.init %s: %s %s",
        hub.init,
        f"uploaded {len(uploaded)} file(s) to" if uploaded else "already staged at",
        uri,
    )
    return StagedInit(hub, uri, uploaded)
