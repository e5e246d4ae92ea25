"""The data a model expects (timm's data config): the mean and std the trainer normalises with,
and the interpolation and crop_pct of the eval transform.

One ``DataConfig`` per job, resolved once (``job_data_config``), reaches every place that
prepares pixels: the trainer's normalisation (training and validation batches), the eval
transform it asks the data servers (and its local loader) for, and the exported
``config.json``. Each value comes from the spec when it sets it (``job.model.mean`` / ``std``,
``job.eval.crop_pct`` / ``interpolation``), else from the weights ``job.model.init`` starts from
(their own data config: ``training.trainer.init_weights``), else the defaults of a model trained
here from scratch: ImageNet's mean and std, crop_pct 0.875, bilinear.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from training.data.transforms import EvalTransform
from training.spec import Interpolation, JobSpec
from training.trainer.config import ConfigError

Channels = tuple[float, float, float]

SPEC = "spec"
DEFAULT = "default"
EVAL_INTERPOLATIONS = (Interpolation.BILINEAR, Interpolation.BICUBIC, Interpolation.NEAREST)


def _channels(value: Any) -> Channels:
    a, b, c = (float(v) for v in value)
    return a, b, c


FIELDS = ("mean", "std", "interpolation", "crop_pct")
IMAGENET_MEAN = _channels(IMAGENET_DEFAULT_MEAN)
IMAGENET_STD = _channels(IMAGENET_DEFAULT_STD)


@dataclass(frozen=True)
class DataConfig:
    """What the model's input looks like; ``origin`` says where each value came from."""

    mean: Channels = IMAGENET_MEAN
    std: Channels = IMAGENET_STD
    interpolation: Interpolation = EvalTransform.interpolation
    crop_pct: float = EvalTransform.crop_pct
    origin: Mapping[str, str] = field(default_factory=dict)
    """Field name -> ``spec``, ``default`` or where the weights' value was read."""

    @property
    def eval_transform(self) -> EvalTransform:
        return EvalTransform(crop_pct=self.crop_pct, interpolation=self.interpolation)

    def as_dict(self) -> dict[str, Any]:
        """The values in timm's data-config form, and where each came from."""
        return {
            "mean": list(self.mean),
            "std": list(self.std),
            "interpolation": str(self.interpolation),
            "crop_pct": self.crop_pct,
            "origin": dict(self.origin),
        }

    def describe(self) -> str:
        values = self.as_dict()
        return ", ".join(f"{k} {values[k]} ({self.origin.get(k, DEFAULT)})" for k in FIELDS)


_SPEC_FIELD = {
    "mean": "job.model.mean",
    "std": "job.model.std",
    "interpolation": "job.eval.interpolation",
    "crop_pct": "job.eval.crop_pct",
}


def spec_values(job: JobSpec) -> dict[str, Any]:
    """The data-config values ``job`` sets (the others are None)."""
    return {
        "mean": job.model.mean,
        "std": job.model.std,
        "interpolation": job.eval.interpolation,
        "crop_pct": job.eval.crop_pct,
    }


def needs_weights(job: JobSpec) -> bool:
    """Whether a value is left to the weights (``job.model.init`` set, some value not)."""
    return bool(job.model.init) and any(v is None for v in spec_values(job).values())


def job_data_config(
    job: JobSpec, weights: Mapping[str, Any] | None = None, weights_from: str = "the weights"
) -> DataConfig:
    """``job``'s values over ``weights`` (timm's ``resolve_data_config`` of the init weights'
    config; None: no init) over the defaults. ``ConfigError`` naming the spec field to set when
    a weights' value is one the trainer cannot use (an interpolation other than bilinear,
    bicubic or nearest, a mean or std that is not three positive numbers)."""
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    problems: list[str] = []
    for name, value in spec_values(job).items():
        if value is not None:
            values[name], origin[name] = value, SPEC
        elif weights is not None and weights.get(name) is not None:
            try:
                values[name] = _from_weights(name, weights[name])
                origin[name] = weights_from
            except (TypeError, ValueError):
                problems.append(
                    f"job.model.init: {weights_from} gives {name} = {weights[name]!r}, which the "
                    f"trainer cannot use; set {_SPEC_FIELD[name]}"
                )
        else:
            origin[name] = DEFAULT
    if problems:
        raise ConfigError(problems)
    return DataConfig(**values, origin=origin)


def _from_weights(name: str, value: Any) -> Any:
    """A weights' data-config value as ``DataConfig`` holds it; ValueError when unusable."""
    if name == "interpolation":
        interpolation = Interpolation(value)
        if interpolation not in EVAL_INTERPOLATIONS:
            raise ValueError(value)
        return interpolation
    if name == "crop_pct":
        crop = float(value)
        if not 0 < crop <= 1:
            raise ValueError(value)
        return crop
    if isinstance(value, str) or len(value) != 3:
        raise ValueError(value)
    channels = _channels(value)
    if name == "std" and min(channels) <= 0:
        raise ValueError(value)
    return channels
