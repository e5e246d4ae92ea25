"""The model: ``timm.create_model`` with the spec's overrides, randomly initialised or from
``job.model.init``'s weights.

Presets are short names for small ViTs that finish CPU runs in seconds; any timm model name is
accepted as is. The input size and class count follow the dataset unless overridden.
"""

from __future__ import annotations

import difflib
import inspect
import json
import logging
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import timm
import torch
from timm.models import adapt_input_conv
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from training.spec import ClusterSpec, SpecError
from training.trainer.config import ConfigError, ModelConfig, TrainerConfig
from training.trainer.data_config import job_data_config
from training.trainer.init_weights import INIT_FIELD, InitWeights, read_init

log = logging.getLogger(__name__)

# name -> (timm model, overrides). The image size and class count come from the dataset.
PRESETS: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    # Two blocks of width 32: a training step on 32 px images takes milliseconds on one core.
    "vit-cpu-tiny": (
        "vit_tiny_patch16_224",
        {"patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2},
    ),
    # Four blocks of width 96 on 64 px images: the local heterogeneous demo.
    "vit-cpu-small": (
        "vit_tiny_patch16_224",
        {"patch_size": 8, "depth": 4, "embed_dim": 96, "num_heads": 3},
    ),
}


def resolve(config: ModelConfig) -> tuple[str, dict[str, Any]]:
    """The timm name and full keyword arguments for ``config``; raises ``ConfigError`` naming
    ``job.model.name`` when timm does not know the model."""
    name = config.name
    kwargs: dict[str, Any] = {}
    if name in PRESETS:
        name, preset = PRESETS[name]
        kwargs.update(preset)
    elif not timm.is_model(name):
        close = difflib.get_close_matches(name, [*PRESETS, *timm.list_models("vit*")], n=3)
        hint = f" (close: {', '.join(close)})" if close else ""
        raise ConfigError(
            [
                f"job.model.name = {config.name!r} is not a timm model or a preset{hint}; "
                f"presets: {', '.join(PRESETS)}"
            ]
        )
    kwargs.update(config.overrides)
    # The spec refuses setting a rate both here and in the overrides.
    for key, rate in (("drop_rate", config.drop_rate), ("drop_path_rate", config.drop_path_rate)):
        if rate is not None:
            kwargs[key] = rate
    kwargs.setdefault("img_size", config.image_size)
    kwargs.setdefault("num_classes", config.num_classes)
    return name, kwargs


def build_model(config: ModelConfig, *, seed: int) -> nn.Module:
    """The model in fp32 on the CPU, identical on every rank for one seed (FSDP keeps each
    rank's shard of its local copy, so the copies must agree): randomly initialised, or with
    ``config.init``'s weights (``job.model.init``; see ``load_init``)."""
    return start_model(config, seed=seed).model


@dataclass(frozen=True)
class StartedModel:
    model: nn.Module
    weights: InitWeights | None = None
    """What ``job.model.init`` held (its tensors dropped once loaded); None: random init."""


def start_model(config: ModelConfig, *, seed: int) -> StartedModel:
    """``build_model``, and what the init weights said about themselves (their data config:
    ``training.trainer.data_config``)."""
    name, kwargs = resolve(config)
    if config.init:
        return load_init(config, seed=seed)
    torch.manual_seed(seed)
    try:
        model = timm.create_model(name, pretrained=False, **kwargs)
    except TypeError as e:
        raise ConfigError([_rejected(name, kwargs, e)]) from e
    params = sum(p.numel() for p in model.parameters())
    log.info("model %s (%s): %.2fM parameters", config.name, name, params / 1e6)
    return StartedModel(model)


def _rejected(name: str, kwargs: Mapping[str, Any], error: Exception) -> str:
    return (
        f"job.model (overrides, drop_rate, drop_path_rate): timm's {name!r} rejects its "
        f"arguments {sorted(kwargs)}: {error}"
    )


# -- job.model.init ----------------------------------------------------------------------------


@dataclass(frozen=True)
class InitPlan:
    """What loading an init file will do, decided before any weight is loaded."""

    file_classes: int
    """The classifier width in the file (0: the file has no classifier)."""
    reinit: tuple[str, ...]
    """Keys left at their seeded random init (the classifier, when the class counts differ)."""
    resampled: tuple[str, ...]
    """Keys timm resamples to the model's shape: ``pos_embed`` for another image or patch size
    (``resample_abs_pos_embed``), the patch embedding's kernel for another patch size
    (``resample_patch_embed``), both in the ViT's ``checkpoint_filter_fn``."""
    tensors: int
    file_in_chans: int | None = None
    """The input channels of the file's first convolution when they differ from the model's,
    which timm's loader adapts (``adapt_input_conv``); None: the same."""


def load_init(config: ModelConfig, *, seed: int) -> StartedModel:
    """The model with ``config.init``'s weights (``training.trainer.init_weights``: a hub-form
    folder or a weights file, local or in S3, which is downloaded to a temporary folder and
    deleted after loading). ``plan_init`` checks them against the model first; then timm loads
    them (``create_model(..., pretrained=True, pretrained_cfg_overlay={"state_dict": ...})``:
    the model's own ``checkpoint_filter_fn`` resamples ``pos_embed`` for another image or patch
    size and the patch embedding's kernel for another patch size, timm's ``load_pretrained``
    adapts the first convolution from the file's input channels, named in the overlay's
    ``input_size``, and the classifier is dropped when the class counts differ). The model is
    built after ``torch.manual_seed(seed)``, so a classifier left out is initialised the same
    on every rank. ``ConfigError`` naming ``job.model.init`` and what differs otherwise."""
    assert config.init
    name, kwargs = resolve(config)
    with tempfile.TemporaryDirectory(prefix="hetero-init-") as tmp:
        weights = read_init(config, name, Path(tmp))
        plan = plan_init(config, weights)
        torch.manual_seed(seed)
        # A state dict in the overlay is timm's first weight source: nothing is downloaded.
        overlay: dict[str, Any] = {
            "state_dict": dict(weights.state_dict),
            "num_classes": plan.file_classes,
        }
        input_size = timm.get_pretrained_cfg_value(name, "input_size") or (3, 224, 224)
        if plan.file_in_chans is not None:
            # timm's loader adapts the first convolution from the channels its config names.
            overlay["input_size"] = (plan.file_in_chans, *input_size[1:])
            # ... and would build the model with them too, unless told its own.
            kwargs = {**kwargs, "in_chans": _in_chans(kwargs)}
        try:
            model = timm.create_model(
                name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs
            )
        except TypeError as e:
            raise ConfigError([_rejected(name, kwargs, e)]) from e
        except (RuntimeError, ValueError) as e:  # what the checks above did not foresee
            raise ConfigError(
                [f"{INIT_FIELD} = {weights.uri!r}: timm could not load it: {e}"]
            ) from e
    # The model's pretrained_cfg keeps the overlay: let the loaded tensors go.
    pretrained_cfg = getattr(model, "pretrained_cfg", None)
    if isinstance(pretrained_cfg, dict):
        pretrained_cfg["state_dict"] = None
        if plan.file_in_chans is not None:  # The model's own channels, not the file's.
            pretrained_cfg["input_size"] = tuple(input_size)
    weights = replace(weights, state_dict={})
    params = sum(p.numel() for p in model.parameters())
    log.info(
        "model %s (%s): %.2fM parameters; loaded %d tensors from %s (%s)",
        config.name,
        name,
        params / 1e6,
        plan.tensors - len(plan.reinit),
        f"the {weights.entry} entry of {weights.file}" if weights.entry else weights.file,
        f"{plan.file_classes} classes" if plan.file_classes else "no classifier",
    )
    if plan.reinit:
        log.info(
            "%s: re-initialised %s (seed %d): the file has %d classes, the model %d",
            INIT_FIELD,
            ", ".join(plan.reinit),
            seed,
            plan.file_classes,
            config.num_classes,
        )
    state = model.state_dict()
    for key in plan.resampled:
        log.info(
            "%s: timm resampled %s from %s to %s",
            INIT_FIELD, key, list(weights.shapes[key]), list(state[key].shape),
        )  # fmt: skip
    if plan.file_in_chans is not None:
        log.info(
            "%s: timm adapted %s from %d input channel(s) to %d (adapt_input_conv)",
            INIT_FIELD, _first_conv(model), plan.file_in_chans, _in_chans(resolve(config)[1]),
        )  # fmt: skip
    return StartedModel(model, weights)


def inspect_init(config: ModelConfig, *, tensors: bool = False) -> InitWeights:
    """``config.init`` read and checked against the model (``plan_init``) without building it:
    what ``check_init`` and the export's data config need. ``ConfigError`` as ``load_init``."""
    assert config.init
    name, _ = resolve(config)
    with tempfile.TemporaryDirectory(prefix="hetero-init-") as tmp:
        weights = read_init(config, name, Path(tmp), tensors=tensors)
    plan_init(config, weights)
    return weights


def check_init(spec: ClusterSpec) -> InitWeights | None:
    """Refuse, before anything is deployed, a ``job.model.init`` the trainer would refuse:
    missing, in no format timm reads, of another architecture, or with a data config the
    trainer cannot use. ``SpecError`` naming ``job.model.init`` and the fix; None when the spec
    has no init. Reads the weights (an ``s3://`` one is downloaded, so this needs credentials
    for its bucket)."""
    if not spec.job.model.init:
        return None
    try:
        model = TrainerConfig.from_spec(spec, run_dir=".", synthetic=True, environ={}).model
        weights = inspect_init(model)
        job_data_config(spec.job, weights.data, weights.data_from)
    except ConfigError as e:
        raise SpecError(e.problems, spec.source) from None
    return weights


def _classifier_keys(model: nn.Module) -> tuple[str, ...]:
    names = (getattr(model, "pretrained_cfg", None) or {}).get("classifier") or ()
    names = (names,) if isinstance(names, str) else tuple(names)
    return tuple(f"{n}.{p}" for n in names for p in ("weight", "bias"))


def plan_init(config: ModelConfig, weights: InitWeights) -> InitPlan:
    """Compare the weights' tensors (names and shapes) with the model ``config`` builds (on the
    meta device), and the architecture and arguments they name with the model's; ``ConfigError``
    naming ``job.model.init`` and every difference that is not the classifier's class count,
    ``pos_embed``'s token count, or the patch embedding's kernel or input channels (which timm
    resamples and adapts)."""
    uri = weights.uri
    name, kwargs = resolve(config)
    problems = _config_differences(name, kwargs, weights)
    shapes = dict(weights.shapes)
    _, _, meta = meta_model(config)
    expected = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    head = _classifier_keys(meta)
    weight = head[0] if head else None
    file_classes = shapes[weight][0] if weight in shapes else 0
    model_classes = expected[weight][0] if weight in expected else 0
    reinit: tuple[str, ...] = ()
    if file_classes != model_classes:
        reinit = tuple(k for k in head if k in expected)
        expected = {k: v for k, v in expected.items() if k not in head}
        shapes = {k: v for k, v in shapes.items() if k not in head}
    resampled = []
    file_in_chans = None
    first = f"{_first_conv(meta)}.weight"
    theirs, ours = shapes.get(first), expected.get(first)
    if theirs is not None and ours is not None and theirs != ours:
        kernel, chans = _first_conv_change(first, theirs, ours)
        if chans and not _timm_adapts_channels():
            problems.append(
                f"{first} has {theirs[1]} input channels, the model {ours[1]}: timm "
                f"{timm.__version__} cannot adapt them (timm >= 1.0.31's loader does); "
                "upgrade timm or give 3-channel weights"
            )
            shapes[first] = ours  # Said once, above.
        elif kernel or chans:
            resampled += [first] if kernel else []
            file_in_chans = theirs[1] if chans else None
            shapes[first] = ours
    pos = "pos_embed"
    # timm resamples the position embedding to another grid; its width must agree.
    if (
        pos in expected
        and pos in shapes
        and shapes[pos] != expected[pos]
        and (shapes[pos][0], shapes[pos][-1]) == (expected[pos][0], expected[pos][-1])
    ):
        resampled.append(pos)
        shapes[pos] = expected[pos]
    missing, unexpected, changed = shape_differences(expected, shapes)
    if missing:
        problems.append(f"the model has tensors the file lacks: {some_keys(missing)}")
    if unexpected:
        problems.append(f"the file has tensors the model lacks: {some_keys(unexpected)}")
    if changed:
        problems.append(
            "shapes differ (file vs model): "
            + some_keys([f"{k} {list(shapes[k])} vs {list(expected[k])}" for k in changed])
        )
    if problems:
        what = f"{name}" + (f" with {dict(config.overrides)}" if config.overrides else "")
        raise ConfigError(
            [
                f"{INIT_FIELD} = {uri!r} does not fit job.model ({config.name!r}: {what}): {p}"
                for p in problems
            ]
        )
    return InitPlan(
        file_classes=file_classes,
        reinit=reinit,
        resampled=tuple(resampled),
        tensors=len(shapes) + len(reinit),
        file_in_chans=file_in_chans,
    )


PATCH_EMBED = "patch_embed.proj.weight"
"""The ViT patch embedding, whose kernel timm's ``checkpoint_filter_fn`` resamples to another
patch size (``resample_patch_embed``)."""


def _first_conv(model: nn.Module) -> str:
    """The model's first convolution (timm's ``pretrained_cfg["first_conv"]``)."""
    name = (getattr(model, "pretrained_cfg", None) or {}).get("first_conv") or "patch_embed.proj"
    return str(name[0] if isinstance(name, list | tuple) else name)


def _in_chans(kwargs: Mapping[str, Any]) -> int:
    return int(kwargs.get("in_chans", 3))


def _first_conv_change(
    key: str, theirs: tuple[int, ...], ours: tuple[int, ...]
) -> tuple[bool, bool]:
    """(the kernel is resampled, the input channels are adapted) for the first convolution's
    weight of shape ``theirs`` in the file and ``ours`` in the model; (False, False) when timm
    does neither (another width, or another kernel outside a ViT patch embedding)."""
    if len(theirs) != 4 or len(ours) != 4 or theirs[0] != ours[0]:
        return False, False
    kernel = theirs[2:] != ours[2:]
    if kernel and key != PATCH_EMBED:
        return False, False
    return kernel, theirs[1] != ours[1]


def _timm_adapts_channels() -> bool:
    """Whether timm's ``load_pretrained`` adapts a first convolution from the channels its
    pretrained config names (timm 1.0.31: ``adapt_input_conv(base_chans=...)``; before, it only
    adapted 3-channel weights to a model of other channels)."""
    return "base_chans" in inspect.signature(adapt_input_conv).parameters


_FREE_ARGS = frozenset(
    {
        "num_classes", "img_size", "patch_size", "in_chans", "global_pool", "dynamic_img_size",
        "drop_rate", "drop_path_rate", "attn_drop_rate", "proj_drop_rate", "pos_drop_rate",
        "patch_drop_rate",
    }
)  # fmt: skip
"""``config.json`` arguments a fine-tune may change: the class count (the classifier is
re-initialised), the image size and patch size (timm resamples ``pos_embed`` and the patch
embedding), the input channels (timm adapts the first convolution), and what changes no tensor:
dropout and stochastic-depth rates, ``global_pool``, ``dynamic_img_size`` (a pooling that does
change tensors, e.g. ``avg`` adding ``fc_norm``, is refused by the tensor comparison)."""


def _config_differences(name: str, kwargs: Mapping[str, Any], weights: InitWeights) -> list[str]:
    """The architecture (``config.json``'s, a checkpoint's ``args.model``) and ``config.json``
    arguments of the weights that disagree with ours."""
    problems = []
    arch, args = weights.architecture, weights.model_args
    if arch is not None and arch.split(".", 1)[0] != name:
        problems.append(
            f"{weights.architecture_from} says architecture {arch!r}, the model is {name!r}"
        )
    if args is not None:
        for key in sorted(set(args) & set(kwargs) - _FREE_ARGS):
            theirs, ours = args[key], kwargs[key]
            if json.loads(json.dumps(theirs)) != json.loads(json.dumps(ours)):
                problems.append(f"its config.json has {key} = {theirs!r}, the model {ours!r}")
    return problems


def shape_differences(
    expected: Mapping[str, tuple[int, ...]], got: Mapping[str, tuple[int, ...]]
) -> tuple[list[str], list[str], list[str]]:
    """Tensor names (sorted) ``expected`` has and ``got`` lacks, ``got`` has and ``expected``
    lacks, and both have with other shapes."""
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    changed = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
    return missing, unexpected, changed


def some_keys(keys: list[str]) -> str:
    """The first five names, and how many more."""
    return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def meta_model(config: ModelConfig) -> tuple[str, dict[str, Any], nn.Module]:
    """The timm name, keyword arguments and the model on the meta device (no memory)."""
    name, kwargs = resolve(config)
    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False, **kwargs)
    return name, kwargs, model


def training_flops_per_sample(config: ModelConfig) -> float:
    """FLOPs of one training sample (forward + backward), counted by torch's FlopCounterMode on
    the meta device (no memory, no compute): ~105e9 for ViT-B/16 at 224 px."""
    _, _, model = meta_model(config)
    x = torch.empty(1, 3, config.image_size, config.image_size, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return float(counter.get_total_flops())
