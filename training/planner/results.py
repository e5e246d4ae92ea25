"""Measured figures the planner prefers to its priors, read from ``benchmarks/results/``.

Two kinds of file are read:

- ``throughput.json`` (the results store, written by ``hetero bench``): trainer samples/s per
  device, keyed by instance type or by GPU/CPU model, for one model, image size and precision,
  with the date and the versions it was measured with; and data-server images/s per vCPU for a
  recipe at an image size, with the trainer side's receive cost. Format::

      {"format": "hetero-throughput-v1",
       "results": [{"instance_type": "g5.xlarge",     # or null: then "device" is the key
                    "device": "A10G",                 # GPU model (or CPU model for CPU runs)
                    "model": "vit_base_patch16_224", "image_size": 224, "precision": "bf16",
                    "samples_per_s_per_device": 281.5,
                    "date": "2026-11-20",
                    "versions": {"torch": "2.15.0", "timm": "1.0.20", "cuda": "13.2"},
                    "source": "python -m benchmarks trainer_gpu"}],
       "dataprep": [{"instance_type": null, "device": "Intel Xeon ... x1",
                     "recipe": "randaugment", "image_size": 160,
                     "images_per_s_per_vcpu": 340.2,           # server CPU: decode .. send
                     "receive_images_per_s_per_vcpu": 5100.0,  # client CPU: receive, unpack
                     "date": "2026-11-22", "versions": {...}, "source": "hetero bench"}]}

- the benchmark outputs that already exist: ``dataplane.json`` (augmentation and receive CPU per
  image), ``offload.json`` (RandAugment CPU per batch) and ``checkpoint.json`` (save times).

A missing file means "not measured" (the priors apply); a malformed one is an error that names
the file and the field, never a silent fallback.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.planner import priors
from training.planner.errors import PlanError

log = logging.getLogger(__name__)

RESULTS_DIR = Path("benchmarks/results")
THROUGHPUT_FILE = "throughput.json"
THROUGHPUT_FORMAT = "hetero-throughput-v1"


@dataclass(frozen=True)
class ThroughputResult:
    instance_type: str | None
    device: str | None
    model: str
    image_size: int
    precision: str
    samples_per_s_per_device: float
    date: str
    versions: dict[str, str]
    source: str
    params: int | None = None
    """The model's parameter count (tells apart variants of one timm name under overrides);
    None: the entry is for the named model as timm builds it."""

    def describe(self) -> str:
        versions = ", ".join(f"{k} {v}" for k, v in sorted(self.versions.items()))
        key = self.instance_type or self.device
        return f"measured on {key} {self.date} ({versions})" if versions else f"measured {key}"


@dataclass(frozen=True)
class DataprepResult:
    """One measured data server: augmentation and receive CPU per image."""

    instance_type: str | None
    device: str | None
    recipe: str
    image_size: int
    images_per_s_per_vcpu: float
    receive_images_per_s_per_vcpu: float
    date: str
    source: str
    images_per_s_per_server: float | None = None
    """What one server delivered to an otherwise idle client (wall clock), if measured."""
    server_workers: int | None = None
    """Its augmentation workers."""
    shard_read_bytes_per_s: float | None = None
    """A prepared dataset's shards read whole from S3 into an empty cache, as a server's
    workers read them in an epoch that is not cached (``hetero bench`` on a shards spec)."""

    def describe(self) -> str:
        return f"measured by {self.source} on {self.instance_type or self.device} {self.date}"


def nearest(figures: list[tuple[float, int, str]], image_size: int) -> tuple[float, int, str]:
    """Of ``(rate, measured at px, source)`` figures, the one measured at the image size nearest
    ``image_size`` (by ratio: per-image costs do not scale with pixels at small sizes, so a
    figure from far away misleads), the later one on a tie."""
    return min(
        enumerate(figures), key=lambda item: (abs(math.log(item[1][1] / image_size)), -item[0])
    )[1]


@dataclass(frozen=True)
class Measured:
    """Everything the planner takes from measurements (or their priors), with provenance."""

    throughput: tuple[ThroughputResult, ...]
    augment_images_per_vcpu: dict[str, tuple[float, int, str]]
    """recipe -> (images/s per vCPU, at this image side in px, where the figure comes from)."""
    receive_images_per_vcpu: tuple[float, int, str]
    checkpoint_s3_s: tuple[float, str]
    checkpoint_async_stall_s: tuple[float, str]
    augment_candidates: dict[str, list[tuple[float, int, str]]] = field(default_factory=dict)
    """recipe -> every augmentation figure known (prior, benchmark outputs, hetero bench, in
    that order); ``augment_rate`` picks the one measured nearest the job's image size."""
    receive_candidates: list[tuple[float, int, str]] = field(default_factory=list)
    """Every receive figure known, in the same order; see ``receive_rate``."""
    shard_read_bytes_per_s: dict[str, tuple[float, str]] = field(default_factory=dict)
    """instance type -> (bytes/s a data server read a prepared dataset's shards from S3, where
    the figure comes from): measured by hetero bench only."""
    server_images_per_s: dict[str, tuple[float, int, int, str]] = field(default_factory=dict)
    """recipe -> (images/s one server delivered, at this image side, with this many workers,
    where the figure comes from): measured by hetero bench only."""

    def augment_rate(self, recipe: str, image_size: int) -> tuple[float, int, str]:
        """(images/s per vCPU, measured at px, source) for ``recipe``: of the figures known, the
        one measured nearest ``image_size`` (``nearest``); else ``augment_images_per_vcpu``."""
        found = self.augment_candidates.get(recipe)
        return nearest(found, image_size) if found else self.augment_images_per_vcpu[recipe]

    def receive_rate(self, image_size: int) -> tuple[float, int, str]:
        """(receive images/s per vCPU, measured at px, source): of the figures known, the one
        measured nearest ``image_size``; else ``receive_images_per_vcpu``."""
        found = self.receive_candidates
        return nearest(found, image_size) if found else self.receive_images_per_vcpu

    def trainer_result(
        self,
        instance_type: str,
        device: str | None,
        model: str,
        image_size: int,
        precision: str,
        params: int | None = None,
    ) -> ThroughputResult | None:
        """The newest result for this instance type, else for its GPU model; None if none.
        With ``params``, an entry that records a different parameter count does not match."""
        matching = [
            r
            for r in self.throughput
            if r.model == model
            and r.image_size == image_size
            and r.precision == precision
            and (params is None or r.params is None or r.params == params)
        ]
        for key_matches in (
            lambda r: r.instance_type == instance_type,
            lambda r: r.instance_type is None and device is not None and r.device == device,
        ):
            found = sorted((r for r in matching if key_matches(r)), key=lambda r: r.date)
            if found:
                return found[-1]
        return None


def load_measured(results_dir: Path = RESULTS_DIR) -> Measured:
    """Read every measured figure under ``results_dir``; priors fill what is not there.
    Precedence, per figure: ``hetero bench`` results (the newest), then the benchmark outputs,
    then the priors; for augmentation and receive rates, the figure measured nearest the job's
    image size comes first (``Measured.augment_rate``, ``receive_rate``)."""
    dataprep = read_dataprep(results_dir / THROUGHPUT_FILE)
    augment = {recipe: [figure] for recipe, figure in _augmentation(results_dir).items()}
    receive = [_receive(results_dir)]
    for r in dataprep:  # Oldest first: the newest is last.
        augment.setdefault(r.recipe, []).append(
            (r.images_per_s_per_vcpu, r.image_size, r.describe())
        )
        receive.append((r.receive_images_per_s_per_vcpu, r.image_size, r.describe()))
    return Measured(
        throughput=tuple(read_throughput(results_dir / THROUGHPUT_FILE)),
        augment_images_per_vcpu={recipe: figures[-1] for recipe, figures in augment.items()},
        augment_candidates=augment,
        receive_images_per_vcpu=receive[-1],
        receive_candidates=receive,
        checkpoint_s3_s=_checkpoint(results_dir, "s3"),
        checkpoint_async_stall_s=_checkpoint(results_dir, "async"),
        server_images_per_s={
            r.recipe: (r.images_per_s_per_server, r.image_size, r.server_workers, r.describe())
            for r in dataprep  # Oldest first: the newest per recipe wins.
            if r.images_per_s_per_server is not None and r.server_workers is not None
        },
        shard_read_bytes_per_s={
            r.instance_type: (r.shard_read_bytes_per_s, r.describe())
            for r in dataprep  # Oldest first: the newest per instance type wins.
            if r.instance_type and r.shard_read_bytes_per_s is not None
        },
    )


def _read_store(path: Path) -> dict[str, Any] | None:
    """The results store as read, its format checked; None when the file does not exist."""
    data = _read_json(path)
    if data is None:
        return None
    if not isinstance(data, dict) or data.get("format") != THROUGHPUT_FORMAT:
        raise PlanError(f'{path}: expected an object with "format": "{THROUGHPUT_FORMAT}"')
    return data


def read_throughput(path: Path) -> list[ThroughputResult]:
    """The results store's entries; [] when the file does not exist."""
    data = _read_store(path)
    if data is None:
        return []
    entries = data.get("results")
    if not isinstance(entries, list):
        raise PlanError(f'{path}: "results" must be a list of measured results')
    out = []
    for i, e in enumerate(entries):
        where = f"{path}: results[{i}]"
        if not isinstance(e, dict):
            raise PlanError(f"{where}: expected an object")
        if not (e.get("instance_type") or e.get("device")):
            raise PlanError(f'{where}: give "instance_type" or "device" (the GPU model)')
        rate = e.get("samples_per_s_per_device")
        if isinstance(rate, bool) or not isinstance(rate, int | float) or rate <= 0:
            raise PlanError(f"{where}.samples_per_s_per_device: expected a positive number")
        for key in ("model", "date", "precision"):
            if not isinstance(e.get(key), str) or not e[key]:
                raise PlanError(f"{where}.{key}: expected a non-empty string")
        size = e.get("image_size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 16:
            raise PlanError(f"{where}.image_size: expected an integer side in px (>= 16)")
        versions = e.get("versions", {})
        if not isinstance(versions, dict):
            raise PlanError(f"{where}.versions: expected an object of name -> version")
        params = e.get("params")
        if params is not None and (isinstance(params, bool) or not isinstance(params, int)):
            raise PlanError(f"{where}.params: expected the model's parameter count (an integer)")
        out.append(
            ThroughputResult(
                instance_type=e.get("instance_type") or None,
                device=e.get("device") or None,
                model=e["model"],
                image_size=size,
                precision=e["precision"],
                samples_per_s_per_device=float(rate),
                date=e["date"],
                versions={str(k): str(v) for k, v in versions.items()},
                source=str(e.get("source", "")),
                params=params,
            )
        )
    return out


def read_dataprep(path: Path) -> list[DataprepResult]:
    """The store's data-server entries, oldest first; [] when there are none."""
    data = _read_store(path)
    if data is None:
        return []
    entries = data.get("dataprep", [])
    if not isinstance(entries, list):
        raise PlanError(f'{path}: "dataprep" must be a list of measured data servers')
    out = []
    for i, e in enumerate(entries):
        where = f"{path}: dataprep[{i}]"
        if not isinstance(e, dict):
            raise PlanError(f"{where}: expected an object")
        rates = []
        for key in ("images_per_s_per_vcpu", "receive_images_per_s_per_vcpu"):
            rate = e.get(key)
            if isinstance(rate, bool) or not isinstance(rate, int | float) or rate <= 0:
                raise PlanError(f"{where}.{key}: expected a positive number")
            rates.append(float(rate))
        if e.get("recipe") not in priors.AUGMENT_IMAGES_PER_VCPU_PRIOR:
            known = ", ".join(priors.AUGMENT_IMAGES_PER_VCPU_PRIOR)
            raise PlanError(f"{where}.recipe: expected one of {known}")
        size = e.get("image_size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 16:
            raise PlanError(f"{where}.image_size: expected an integer side in px (>= 16)")
        if not isinstance(e.get("date"), str) or not e["date"]:
            raise PlanError(f"{where}.date: expected a non-empty string")
        delivered = e.get("images_per_s_per_server")
        workers = e.get("server_workers")
        if delivered is not None and (
            isinstance(delivered, bool) or not isinstance(delivered, int | float) or delivered <= 0
        ):
            raise PlanError(f"{where}.images_per_s_per_server: expected a positive number")
        if workers is not None and (
            isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
        ):
            raise PlanError(f"{where}.server_workers: expected a positive integer")
        reads = e.get("shard_read_mb_per_s")
        if reads is not None and (
            isinstance(reads, bool) or not isinstance(reads, int | float) or reads <= 0
        ):
            raise PlanError(f"{where}.shard_read_mb_per_s: expected a positive number")
        out.append(
            DataprepResult(
                instance_type=e.get("instance_type") or None,
                device=e.get("device") or None,
                recipe=e["recipe"],
                image_size=size,
                images_per_s_per_vcpu=rates[0],
                receive_images_per_s_per_vcpu=rates[1],
                date=e["date"],
                source=str(e.get("source") or "hetero bench"),
                images_per_s_per_server=None if delivered is None else float(delivered),
                server_workers=workers,
                shard_read_bytes_per_s=None if reads is None else float(reads) * 1e6,
            )
        )
    return sorted(out, key=lambda r: r.date)


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"{path}: not readable JSON ({e}); fix or remove the file") from e


def _number(data: Any, *keys: str | int) -> float | None:
    """``data[k0][k1]...`` as a float, or None if any step is missing or not a number."""
    for k in keys:
        in_dict = isinstance(data, dict) and isinstance(k, str) and k in data
        in_list = isinstance(data, list) and isinstance(k, int) and -len(data) <= k < len(data)
        if not (in_dict or in_list):
            return None
        data = data[k]
    if isinstance(data, bool) or not isinstance(data, int | float):
        return None
    return float(data)


def _augmentation(results_dir: Path) -> dict[str, tuple[float, int, str]]:
    """recipe -> the benchmark outputs' augmentation figure, else the prior's."""
    out = {
        recipe: (rate, 224, "prior (training/planner/priors.py)")
        for recipe, rate in priors.AUGMENT_IMAGES_PER_VCPU_PRIOR.items()
    }
    dataplane = _read_json(results_dir / "dataplane.json")
    cpu_s = _number(dataplane, "local_augmentation", "cpu_s_per_1000_images")
    size = _number(dataplane, "settings", "image_size")
    if cpu_s and size:
        out["standard"] = (
            1000.0 / cpu_s,
            int(size),
            "measured (benchmarks/results/dataplane.json)",
        )
    offload = _read_json(results_dir / "offload.json")
    batch_s = _number(offload, "regime", "augment_batch_cpu_s")
    batch = _number(offload, "settings", "batch_size")
    size = _number(offload, "settings", "image_size")
    recipe = offload.get("settings", {}).get("recipe") if isinstance(offload, dict) else None
    if batch_s and batch and size and recipe == "randaugment":
        out["randaugment"] = (
            batch / batch_s,
            int(size),
            "measured (benchmarks/results/offload.json)",
        )
    return out


def _receive(results_dir: Path) -> tuple[float, int, str]:
    """The data-plane benchmark's receive figure, else the prior's."""
    dataplane = _read_json(results_dir / "dataplane.json")
    cpu_s = _number(dataplane, "transport", "client_cpu_s_per_1000_images")
    size = _number(dataplane, "settings", "image_size")
    if cpu_s and size:
        return 1000.0 / cpu_s, int(size), "measured (benchmarks/results/dataplane.json)"
    return priors.RECEIVE_IMAGES_PER_VCPU_PRIOR, 224, "prior (training/planner/priors.py)"


def _checkpoint(results_dir: Path, which: str) -> tuple[float, str]:
    """Seconds for ViT-B/16 + AdamW: ``s3`` stop-to-durable, or the ``async`` save's stall."""
    data = _read_json(results_dir / "checkpoint.json")
    measured = "measured (benchmarks/results/checkpoint.json)"
    if isinstance(data, dict):
        if which == "s3":
            for row in data.get("stop_to_durable", []):
                if isinstance(row, dict) and str(row.get("target", "")).startswith("s3"):
                    seconds = _number(row, "seconds")
                    if seconds:
                        return seconds, measured
        else:
            for row in data.get("stall_per_save", []):
                if isinstance(row, dict) and row.get("mode") == "async":
                    seconds = _number(row, "stall_s_median")
                    if seconds:
                        return seconds, measured
    prior = priors.CHECKPOINT_S3_S_PRIOR if which == "s3" else priors.CHECKPOINT_ASYNC_STALL_S_PRIOR
    return prior, "prior (training/planner/priors.py)"
