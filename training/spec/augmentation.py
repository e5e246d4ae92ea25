"""Parsing ``job.augmentation``: a preset name or a table over one."""

from __future__ import annotations

import re
from typing import Any

from training.spec.enums import RANDOM_ERASING_MODES, Interpolation, Recipe
from training.spec.reader import _fraction, _pair, _Reader
from training.spec.schema import AugmentationSpec


def _parse_augmentation(r: _Reader, raw: Any) -> AugmentationSpec:
    if isinstance(raw, str):
        try:
            return AugmentationSpec(preset=Recipe(raw))
        except ValueError:
            valid = ", ".join(repr(e.value) for e in Recipe)
            r.problem(None, f"{raw!r} is not a preset; use one of {valid} or a table")
            return AugmentationSpec()
    if not isinstance(raw, dict):
        r.problem(None, f"expected a preset name or a table, got {type(raw).__name__}")
        return AugmentationSpec()
    r.check_keys(raw, AugmentationSpec)
    preset = r.choice(raw, "preset", Recipe, Recipe.STANDARD)
    scale = _pair(r, raw, "scale", low=0.0)
    if scale is not None and not (scale[0] > 0 and scale[1] <= 1):
        r.problem("scale", f"area shares must be in (0, 1], got {list(scale)}")
    ratio = _pair(r, raw, "ratio", low=0.0)
    if ratio is not None and ratio[0] <= 0:
        r.problem("ratio", f"aspect ratios must be positive, got {list(ratio)}")
    hflip = _fraction(r, raw, "hflip", -1.0, low=0.0) if "hflip" in raw else None
    vflip = _fraction(r, raw, "vflip", -1.0, low=0.0) if "vflip" in raw else None
    jitter: float | tuple[float, ...] | None = None
    if "color_jitter" in raw:
        cj = raw["color_jitter"]
        if isinstance(cj, int | float) and not isinstance(cj, bool) and cj >= 0:
            jitter = float(cj)
        elif (
            isinstance(cj, list)
            and len(cj) in (3, 4)
            and all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in cj)
        ):
            jitter = tuple(float(v) for v in cj)
        else:
            r.problem(
                "color_jitter",
                f"expected a number >= 0 or [brightness, contrast, saturation(, hue)], got {cj!r}",
            )
    auto = r.get(raw, "auto_augment", str, None)
    if auto and not re.fullmatch(
        r"(rand|augmix|original|originalr|v0|v0r|3a)(-[a-z]+[\d.]*)*", auto
    ):
        r.problem(
            "auto_augment",
            f"{auto!r} is not a timm policy; use e.g. 'rand-m9-mstd0.5-inc1', 'augmix-m5-w4-d2', "
            "'original', '3a' or '' for none",
        )
    interp = r.choice(raw, "interpolation", Interpolation, None)
    re_mode = r.get(raw, "re_mode", str, "pixel")
    if re_mode not in RANDOM_ERASING_MODES:
        r.problem("re_mode", f"{re_mode!r} is not valid; use one of {RANDOM_ERASING_MODES}")
        re_mode = "pixel"
    spec = AugmentationSpec(
        preset=preset,
        scale=scale,
        ratio=ratio,
        hflip=hflip,
        vflip=vflip,
        color_jitter=jitter,
        auto_augment=auto,
        interpolation=interp,
        re_prob=_fraction(r, raw, "re_prob", 0.0),
        re_mode=re_mode,
        re_count=r.positive(raw, "re_count", 1),
    )
    if preset is Recipe.NONE:
        crop_keys = [k for k in ("scale", "ratio", "hflip", "vflip", "color_jitter", "auto_augment")
                     if k in raw]  # fmt: skip
        if crop_keys:
            r.problem(
                "preset",
                f"'none' only resizes and centre-crops, so {', '.join(crop_keys)} would be "
                "ignored; use preset = 'standard' to set them, or remove them",
            )
    return spec
