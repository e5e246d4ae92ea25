"""The planner's tables agree with the code they describe: the analytic ViT size with timm and
the trainer's own FLOP counter, the peak FLOP/s with the trainer's MFU table, and every catalogue
type has the facts a plan needs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from training import instance_types
from training.planner import priors
from training.planner.workload import vit_size

torch = pytest.importorskip("torch")
timm = pytest.importorskip("timm")


@pytest.mark.parametrize(
    "name", ["vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224"]
)
@pytest.mark.parametrize(
    ("image_size", "num_classes", "overrides"),
    [(224, 1000, {}), (160, 10, {"depth": 2, "embed_dim": 96, "num_heads": 3})],
)
def test_analytic_vit_size_matches_timm_and_the_flop_counter(
    name: str, image_size: int, num_classes: int, overrides: dict[str, Any]
) -> None:
    from training.trainer.config import ModelConfig
    from training.trainer.model import resolve, training_flops_per_sample

    config = ModelConfig(name, overrides, image_size, num_classes)
    timm_name, kwargs = resolve(config)
    with torch.device("meta"):
        model = timm.create_model(timm_name, pretrained=False, **kwargs)
    ours = vit_size(replace(priors.VIT_ARCHS[name], **overrides), image_size, num_classes)
    assert ours.params == sum(p.numel() for p in model.parameters())
    # The counter counts matrix products only, as ours does: equal.
    assert ours.train_flops_per_sample == pytest.approx(training_flops_per_sample(config), rel=1e-9)


def test_vit_b16_agrees_with_the_measured_flop_count() -> None:
    size = vit_size(priors.VIT_ARCHS["vit_base_patch16_224"], 224, 1000)
    assert size.train_flops_per_sample == pytest.approx(
        priors.VIT_B16_TRAIN_FLOPS_MEASURED, rel=1e-3
    )


def test_peak_flops_are_the_trainers_mfu_table() -> None:
    from training.trainer.metrics import PEAK_FLOPS

    trainer = dict(PEAK_FLOPS)
    for gpu, peak in priors.GPU_PEAKS.items():
        key = gpu.removesuffix("-80GB")
        assert trainer[key] == peak.bf16, gpu


def test_every_catalogue_type_has_what_a_plan_needs() -> None:
    for t in instance_types.CATALOG.values():
        if t.burstable:
            continue
        assert t.name in priors.BASELINE_GBPS, t.name
        if t.gpus:
            assert t.gpu_model in priors.GPU_PEAKS, t.name
    for name in priors.DATAPREP_TYPES:
        assert instance_types.CATALOG[name].gpus == 0
    for name, band in priors.INTERRUPTION_BAND.items():
        assert name in instance_types.CATALOG and band in priors.INTERRUPTION_BAND_RATE
    for name, burst in priors.BURST_GBPS.items():
        assert burst > priors.BASELINE_GBPS[name], name
