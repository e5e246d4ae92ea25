"""``job.model.init``: the weights a fine-tune starts from, in the forms users have them.

``job.model.init`` is ``timm:NAME.TAG`` (a timm model's pretrained weights on the Hugging Face
Hub: their hub-form folder in the Hugging Face cache, ``training.common.timm_hub``; on AWS the
copy staged in S3, ``ModelConfig.init_uri``), or a local path or an ``s3://`` URI of:

- a hub-form folder, as timm's ``save_for_hf`` / ``push_to_hf_hub`` (and this project's export)
  write one: ``config.json`` and ``model.safetensors``, else ``pytorch_model.bin``. An ``s3://``
  URI whose name is not a weights file's (``WEIGHT_SUFFIXES``) is such a folder;
- a weights file in a format timm's ``load_state_dict`` reads: ``.safetensors``, or a
  ``torch.save`` file (``.pth``, ``.pt``, ``.bin``) of a state dict or of a checkpoint of timm's
  ``train.py`` (``checkpoint-*.pth.tar``, ``model_best.pth.tar``: ``state_dict`` and, trained
  with ``--model-ema``, ``state_dict_ema``). From a checkpoint that holds both, the EMA weights
  are taken unless ``job.model.init_ema`` is false, as timm's ``load_checkpoint(use_ema=...)``
  does. A ``config.json`` beside a file is read too;
- a zipped hub-form folder (``.zip``: what ``cdk deploy`` stages a ``timm:`` init as), which is
  extracted into the temporary folder and read as a folder.

``read_init`` reads the tensors with timm's ``load_state_dict`` and
``torch.load(weights_only=True)`` (a file may hold tensors and plain data, ``train.py``'s
``argparse.Namespace`` included, never code), and what the weights say about themselves: their
architecture (``config.json``'s, or a checkpoint's ``args.model``), ``config.json``'s
``model_args``, and their data config (mean, std, interpolation, crop_pct) from timm's
``resolve_data_config`` of, in this order: ``config.json``'s ``pretrained_cfg``; a ``train.py``
checkpoint's arguments over the architecture's pretrained config in timm's registry (what timm's
``train.py`` resolved them against); for a bare file, the architecture's registry config (what
timm's own ``train.py --pretrained-path`` assumes). ``training.trainer.model`` checks the
tensors against the model and loads them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from timm.data import resolve_data_config
from timm.models import clean_state_dict, get_pretrained_cfg, load_state_dict
from timm.models._hub import HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME

from training.common import aws, s3
from training.common.s3_init import WEIGHT_SUFFIXES, ZIP_SUFFIX
from training.common.timm_hub import HubInit, HubInitError, is_timm_init, resolve_timm_init
from training.trainer.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)

INIT_FIELD = "job.model.init"
CONFIG_FILE = "config.json"
"""timm's hub config, in a folder or beside a weights file (this project's export writes one)."""
FOLDER_WEIGHTS = (HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME)
"""A hub-form folder's weights file, in the order they are looked for (timm's hub names)."""
# WEIGHT_SUFFIXES: an s3:// URI ending in one names a file, any other a folder; ZIP_SUFFIX: a
# zipped hub-form folder (how `cdk deploy` stages a timm: init). Defined in
# training.common.s3_init: the staging of an s3:// init where a job starts reads URIs the same.
FORMS = (
    "a hub-form folder (config.json + model.safetensors or pytorch_model.bin, as "
    "timm.models.save_for_hf writes) or a weights file timm reads (.safetensors, .pth, "
    ".pth.tar from timm's train.py, .bin), a local path or s3:// URI, or timm:NAME.TAG (a timm "
    "model's pretrained weights on the Hugging Face Hub)"
)
_DATA_KEYS = ("mean", "std", "interpolation", "crop_pct")


@dataclass(frozen=True)
class InitWeights:
    """What ``job.model.init`` holds, read before anything is loaded into a model."""

    uri: str
    """``job.model.init`` as the spec gives it."""
    file: str
    """The weights file read: a local path or an ``s3://`` URI."""
    shapes: Mapping[str, tuple[int, ...]]
    """Tensor names (timm's ``clean_state_dict``: no ``module.`` prefix) and shapes."""
    state_dict: Mapping[str, torch.Tensor]
    """The tensors (empty when read with ``tensors=False``)."""
    entry: str
    """The checkpoint entry the weights came from (``state_dict_ema``, ``state_dict``, ...);
    empty when the file is a state dict itself."""
    architecture: str | None
    """timm name the weights say they are for (``config.json``; a checkpoint's ``args.model``)."""
    architecture_from: str
    """Where ``architecture`` was read, as the start of a sentence."""
    model_args: Mapping[str, Any] | None
    """``config.json``'s ``model_args`` (the ``create_model`` keyword arguments)."""
    data: Mapping[str, Any]
    """Their data config: ``mean``, ``std``, ``interpolation``, ``crop_pct`` (timm's
    ``resolve_data_config``)."""
    data_from: str
    """Where ``data`` was read, for logs and ``DataConfig.origin``."""
    hub: HubInit | None = None
    """A ``timm:`` init read from the Hugging Face cache: its repository, files and size."""


def read_init(config: ModelConfig, name: str, tmp: Path, *, tensors: bool = True) -> InitWeights:
    """Read ``config.init`` (an ``s3://`` one is downloaded into ``tmp``), for the model whose
    timm name is ``name``. ``tensors=False`` reads the names, shapes and configs only (a torch
    file memory-mapped). ``ConfigError`` naming ``job.model.init`` and the fix when it is
    missing or in no format timm reads."""
    assert config.init
    uri = config.init.strip()
    location, hub = _location(config)
    path, config_path, source = _fetch(location, tmp)
    file_config = _read_config(uri, config_path) if config_path is not None else None
    shapes, state, entry, args = _read_weights(uri, path, use_ema=config.init_ema, tensors=tensors)
    architecture, architecture_from = (file_config or {}).get("architecture"), "its config.json"
    if not isinstance(architecture, str):
        architecture, architecture_from = (args or {}).get("model"), "its train.py args.model"
    model_args = (file_config or {}).get("model_args")
    data, data_from = _data_config(file_config, args, architecture, name)
    return InitWeights(
        uri=uri,
        file=source,
        shapes=shapes,
        state_dict=state,
        entry=entry,
        architecture=architecture if isinstance(architecture, str) else None,
        architecture_from=architecture_from,
        model_args=model_args if isinstance(model_args, Mapping) else None,
        data=data,
        data_from=data_from,
        hub=hub,
    )


# -- where the files are ------------------------------------------------------------------------


def _location(config: ModelConfig) -> tuple[str, HubInit | None]:
    """Where ``config.init``'s files are: its staged copy (``init_uri``), the Hugging Face
    cache's folder of a ``timm:`` init (downloaded into the cache when missing), or ``init``."""
    assert config.init
    uri = config.init.strip()
    if config.init_uri:
        log.info("%s = %r: reading its staged copy %s", INIT_FIELD, uri, config.init_uri)
        return config.init_uri.strip(), None
    if not is_timm_init(uri):
        return uri, None
    try:
        hub = resolve_timm_init(uri)
    except HubInitError as e:
        raise ConfigError([f"{INIT_FIELD} = {e}"]) from None
    log.info("%s = %s", INIT_FIELD, hub.describe())
    return str(hub.folder), hub


def _fetch(uri: str, tmp: Path) -> tuple[Path, Path | None, str]:
    """(local weights file, local config.json or None, the weights file's own location)."""
    if uri.lower().endswith(ZIP_SUFFIX):
        return _fetch_zip(uri, tmp)
    if s3.is_s3_uri(uri):
        return _fetch_s3(uri, tmp)
    path = Path(uri).expanduser()
    if path.is_dir():
        found = next((path / n for n in FOLDER_WEIGHTS if (path / n).is_file()), None)
        if found is None:
            raise ConfigError(
                [
                    f"{INIT_FIELD} = {uri!r} is a folder without {' or '.join(FOLDER_WEIGHTS)}; "
                    f"give {FORMS}"
                ]
            )
        config = path / CONFIG_FILE
        return found, config if config.is_file() else None, str(found)
    if not path.is_file():
        raise ConfigError([f"{INIT_FIELD} = {uri!r} is not a file or folder; give {FORMS}"])
    config = path.parent / CONFIG_FILE
    return path, config if config.is_file() else None, str(path)


def _fetch_zip(uri: str, tmp: Path) -> tuple[Path, Path | None, str]:
    """A zipped hub-form folder (local or in S3), extracted into ``tmp``, read as a folder."""
    from botocore.exceptions import BotoCoreError, ClientError

    archive = Path(uri).expanduser()
    if s3.is_s3_uri(uri):
        try:
            bucket, key = s3.parse_s3_object(uri)
            archive = tmp / "init.zip"
            aws.client().download_file(bucket, key, str(archive))
        except (ValueError, ClientError, BotoCoreError) as e:
            raise ConfigError([f"{INIT_FIELD}: cannot download {uri!r}: {e}"]) from e
    folder = tmp / "init"
    try:
        with zipfile.ZipFile(archive) as z:
            z.extractall(folder)  # zipfile drops absolute paths and ".." from member names
    except (OSError, zipfile.BadZipFile) as e:
        raise ConfigError(
            [f"{INIT_FIELD}: {uri!r} is not a readable zip of a hub-form folder ({e})"]
        ) from e
    if archive.parent == tmp:
        archive.unlink()  # the extracted files are what is read
    path, config, _ = _fetch(str(folder), tmp)
    return path, config, f"{path.name} in {uri}"


def _fetch_s3(uri: str, tmp: Path) -> tuple[Path, Path | None, str]:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        if uri.lower().endswith(WEIGHT_SUFFIXES):
            bucket, key = s3.parse_s3_object(uri)
            keys = [key]
            folder = key.rpartition("/")[0]
            folder = f"{folder}/" if folder else ""
        else:
            bucket, folder = s3.parse_s3_uri(uri)
            keys = [folder + n for n in FOLDER_WEIGHTS]
    except ValueError as e:
        raise ConfigError([f"{INIT_FIELD} = {uri!r}: {e}; give {FORMS}"]) from None
    client = aws.client()
    path: Path | None = None
    for key in keys:
        target = tmp / Path(key).name
        try:
            client.download_file(bucket, key, str(target))
        except ClientError as e:
            if len(keys) > 1 and (s3.is_not_found(e) or s3.is_denied(e)):
                # A folder: try its next weights file (S3 answers 403 for a missing one to a
                # reader that may not list the bucket: the deploy's grant, infra/stacks.py).
                continue
            raise ConfigError([f"{INIT_FIELD} = {uri!r}: cannot download it: {e}"]) from e
        except BotoCoreError as e:
            raise ConfigError([f"{INIT_FIELD} = {uri!r}: cannot download it: {e}"]) from e
        path, source = target, s3.s3_uri(bucket, key)
        break
    if path is None:
        raise ConfigError(
            [
                f"{INIT_FIELD} = {uri!r}: cannot download it: the folder has neither "
                f"{' nor '.join(FOLDER_WEIGHTS)} that these credentials can read; give {FORMS}"
            ]
        )
    config = tmp / CONFIG_FILE
    try:
        client.download_file(bucket, folder + CONFIG_FILE, str(config))
    except ClientError:
        return path, None, source  # No config.json beside it: a bare weights file.
    return path, config, source


def _read_config(uri: str, path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("%s = %r: its config.json is unreadable (%s): not used", INIT_FIELD, uri, e)
        return None
    return value if isinstance(value, dict) else None


# -- the tensors --------------------------------------------------------------------------------


@contextlib.contextmanager
def _train_py_globals() -> Iterator[None]:
    """Lets ``torch.load(weights_only=True)`` read timm ``train.py`` checkpoints, whose ``args``
    is an ``argparse.Namespace`` (timm >= 1.0.26 allows it in its own loader; older timm does
    not, and torch < 2.5 has no ``safe_globals``: such a checkpoint is then refused)."""
    allow = getattr(torch.serialization, "safe_globals", None)
    if allow is None:
        yield
        return
    with allow([argparse.Namespace]):
        yield


def _entry(checkpoint: Any, use_ema: bool) -> str:
    """The entry timm's ``load_state_dict`` takes the weights from ('' for a state dict)."""
    if not isinstance(checkpoint, dict):
        return ""
    # timm's order (timm.models._helpers.load_state_dict), restated to report what was taken.
    if use_ema and checkpoint.get("state_dict_ema") is not None:
        return "state_dict_ema"
    if use_ema and checkpoint.get("model_ema") is not None:
        return "model_ema"
    return next((k for k in ("state_dict", "model") if k in checkpoint), "")


def _read_weights(
    uri: str, path: Path, *, use_ema: bool, tensors: bool
) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.Tensor], str, dict[str, Any] | None]:
    """(shapes, tensors or {}, entry, a ``train.py`` checkpoint's arguments or None)."""
    what = f"{INIT_FIELD} = {uri!r}"
    if path.name.endswith(".safetensors"):  # timm's load_state_dict decides by the name too
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        except (SafetensorError, OSError, ValueError) as e:
            raise ConfigError(
                [f"{what} is not a safetensors file ({e}); give a model.safetensors or {FORMS}"]
            ) from e
        state = load_state_dict(str(path), use_ema=use_ema, weights_only=True) if tensors else {}
        return dict(shapes), state, "", None
    try:
        with _train_py_globals():
            try:  # Memory-mapped: only the pickled structure is read.
                checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                checkpoint = torch.load(path, map_location="cpu", weights_only=True)
            entry = _entry(checkpoint, use_ema)
            weights = checkpoint[entry] if entry else checkpoint
            if not isinstance(weights, Mapping) or not all(
                isinstance(v, torch.Tensor) for v in weights.values()
            ):
                raise ValueError(f"its {entry or 'content'} is not a state dict of tensors")
            shapes = {k: tuple(v.shape) for k, v in clean_state_dict(dict(weights)).items()}
            state = {}
            if tensors:
                state = load_state_dict(str(path), use_ema=use_ema, weights_only=True)
    except Exception as e:  # torch.load's errors: not a torch file, truncated, unsafe globals
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            [
                f"{what}: torch.load(weights_only=True) and timm's load_state_dict cannot read "
                f"it as weights ({type(e).__name__}: {first}); give {FORMS} (a file that needs "
                "code to load, such as a pickled model, is refused)"
            ]
        ) from e
    args = checkpoint.get("args") if isinstance(checkpoint, dict) else None
    if isinstance(args, argparse.Namespace):
        args = vars(args)
    if use_ema and entry == "state_dict":
        log.info("%s: the checkpoint has no EMA weights; using its state_dict", INIT_FIELD)
    return shapes, state, entry, args if isinstance(args, dict) else None


# -- their data config --------------------------------------------------------------------------


def _registry_cfg(names: list[str]) -> tuple[dict[str, Any], str]:
    """The first of ``names`` timm's registry has a pretrained config for, and that config."""
    for name in names:
        try:
            cfg = get_pretrained_cfg(name)
        except RuntimeError:  # a tag timm does not know for that architecture
            continue
        if cfg is not None:
            tag = getattr(cfg, "tag", None)
            return cfg.to_dict(), f"{name.split('.', 1)[0]}.{tag}" if tag else name
    return {}, names[-1]


def _data_config(
    file_config: Mapping[str, Any] | None,
    args: Mapping[str, Any] | None,
    architecture: Any,
    name: str,
) -> tuple[dict[str, Any], str]:
    """(mean, std, interpolation, crop_pct of the weights, where they came from)."""
    pretrained = (file_config or {}).get("pretrained_cfg")
    if isinstance(pretrained, Mapping) and pretrained:
        data = resolve_data_config(pretrained_cfg=dict(pretrained))
        where = "the weights' config.json"
    else:
        names = [architecture, name] if isinstance(architecture, str) else [name]
        registry, registry_name = _registry_cfg(names)
        registry = registry or {"architecture": name}
        if args is not None:
            given = {k: args.get(k) for k in _DATA_KEYS}
            data = resolve_data_config(args=given, pretrained_cfg=registry)
            where = f"the checkpoint's train.py arguments over timm's {registry_name} config"
        else:
            data = resolve_data_config(pretrained_cfg=registry)
            where = f"timm's pretrained config of {registry_name} (the weights carry none)"
    return {k: data[k] for k in _DATA_KEYS}, where
