"""The recipe from timm's factories: optimizer groups, the schedule, Mixup / CutMix, random
erasing, clipping, EMA, and a resume with all of them on that equals an uninterrupted run."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from timm.optim import Lamb
from timm.scheduler import CosineLRScheduler

from training.common.steps import MARKER
from training.spec import parse_spec
from training.trainer.config import ModelConfig
from training.trainer.local_run import run_local
from training.trainer.model import build_model
from training.trainer.recipe import (
    BatchRecipe,
    LearningRate,
    build_ema,
    build_optimizer,
    clip_gradients,
)

from .conftest import write_spec

ENV = {"OMP_NUM_THREADS": "1"}
RECIPE_KEYS = """
label_smoothing = 0.1
clip_grad_norm = 0.5
warmup_steps = 2
min_lr = 1e-5
schedule = "cosine"
layer_decay = 0.75
"""
RECIPE_MODEL_KEYS = "drop_path_rate = 0.1"
RECIPE_TABLES = """
[job.mixup]
mixup_alpha = 0.8
cutmix_alpha = 1.0
[job.ema]
decay = 0.9
warmup = true
[job.augmentation]
preset = "standard"
re_prob = 0.5
"""


def job(extra: str = "", tables: str = "", batch_size: int = 8):
    text = f"""
[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge"]
count = 1
[job]
batch_size = {batch_size}
steps = 20
lr = 0.01
{extra}
[job.model]
name = "vit-cpu-tiny"
[job.dataset]
num_classes = 10
image_size = 32
{tables}
"""
    import tomllib

    return parse_spec(tomllib.loads(text)).job


def tiny_model():
    return build_model(ModelConfig("vit-cpu-tiny", {}, 32, 10), seed=0)


def test_no_weight_decay_on_norms_biases_and_embeddings() -> None:
    model = tiny_model()
    opt = build_optimizer(model, job("weight_decay = 0.05"))
    assert isinstance(opt, torch.optim.AdamW)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decayed}
    undecayed = {n for n, _ in model.named_parameters()} - names
    assert "pos_embed" in undecayed and "cls_token" in undecayed
    assert all(n.endswith(".weight") for n in names)
    assert {n for n in undecayed if "norm" in n or n.endswith(".bias")} == {
        n for n, p in model.named_parameters() if p.ndim <= 1
    }
    assert all(g["weight_decay"] == 0.05 for g in opt.param_groups if g["weight_decay"])
    assert isinstance(build_optimizer(model, job('optimizer = "lamb"')), Lamb)
    sgd = build_optimizer(model, job('optimizer = "sgd"\nmomentum = 0.8'))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.8


def test_cosine_schedule_is_timms_stepped_per_update() -> None:
    model = tiny_model()
    j = job("warmup_steps = 4\nmin_lr = 0.001")
    opt = build_optimizer(model, j)
    rate = LearningRate(opt, j, total_steps=20)
    # timm's scheduler stepped per optimizer update, as its train.py does.
    ref_opt = build_optimizer(tiny_model(), j)
    ref = CosineLRScheduler(
        ref_opt, t_initial=16, lr_min=0.001, warmup_t=4, warmup_prefix=True, t_in_epochs=False
    )
    for step in range(5, 21):
        ref.step_update(num_updates=step)
        assert rate.at(step) == pytest.approx(ref_opt.param_groups[0]["lr"], rel=1e-12)
    assert [rate.at(s) for s in (1, 2, 4)] == pytest.approx([0.0025, 0.005, 0.01])
    assert rate.at(20) == pytest.approx(0.001)  # the floor at the last step
    assert rate.at(12) == pytest.approx(0.001 + 0.5 * (0.01 - 0.001))  # half way
    constant = LearningRate(opt, job('schedule = "constant"\nwarmup_steps = 2'), 20)
    assert [constant.at(s) for s in (1, 2, 3, 20)] == [0.005, 0.01, 0.01, 0.01]


def test_mixup_and_erasing_are_seeded_by_step_and_leave_the_global_rngs_alone() -> None:
    j = job(RECIPE_KEYS, RECIPE_TABLES)
    recipe = BatchRecipe(j, num_classes=10, device=torch.device("cpu"))
    images = torch.randn(8, 3, 32, 32)
    labels = torch.arange(8) % 10
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    a_img, a_t = recipe.apply(images.clone(), labels, step=3, micro=0)
    b_img, b_t = recipe.apply(images.clone(), labels, step=3, micro=0)
    c_img, _ = recipe.apply(images.clone(), labels, step=4, micro=0)
    assert torch.equal(a_img, b_img) and torch.equal(a_t, b_t)
    assert not torch.equal(a_img, c_img)
    after = (random.getstate(), np.random.get_state()[1], torch.get_rng_state())
    assert before[0] == after[0] and np.array_equal(before[1], after[1])
    assert torch.equal(before[2], after[2])
    # Soft targets: rows sum to 1, smoothing leaves no zero.
    assert a_t.shape == (8, 10) and torch.allclose(a_t.sum(1), torch.ones(8))
    assert (a_t > 0).all()
    loss = recipe.loss(torch.randn(8, 10), a_t)
    assert loss.ndim == 0 and torch.isfinite(loss)
    # A batch shortened to an odd size by an unreadable sample still mixes (all but one).
    odd_img, odd_t = recipe.apply(images[:7].clone(), labels[:7], step=3, micro=0)
    assert odd_img.shape[0] == 7 and odd_t.shape == (7, 10)
    assert odd_t[6].argmax() == labels[6] and odd_t[6].max() == pytest.approx(0.91)


def test_without_mixup_the_loss_is_cross_entropy_with_smoothing() -> None:
    recipe = BatchRecipe(job("label_smoothing = 0.2"), num_classes=10, device=torch.device("cpu"))
    assert not recipe.active
    logits, labels = torch.randn(4, 10), torch.tensor([1, 2, 3, 4])
    want = torch.nn.functional.cross_entropy(logits, labels, label_smoothing=0.2)
    assert torch.equal(recipe.loss(logits, labels), want)


def test_clipping_caps_the_total_norm() -> None:
    model = tiny_model()
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    before = clip_gradients(model, 1.0)
    assert before is not None and before > 1.0
    after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert after == pytest.approx(1.0, rel=1e-5)
    # Off (0): the norm is still measured, and the gradients are left exactly as they are.
    grads = [p.grad.clone() for p in model.parameters()]
    norm = clip_gradients(model, 0.0)
    assert norm == pytest.approx(float(after), rel=1e-6)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))


def test_ema_follows_timms_model_ema_v3() -> None:
    model = tiny_model()
    ema = build_ema(model, job(tables="[job.ema]\ndecay = 0.5"), torch.device("cpu"))
    assert ema is not None and build_ema(model, job(), torch.device("cpu")) is None
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model, step=2)  # timm: decay 0.5 from the second update on
    for k, v in ema.module.state_dict().items():
        torch.testing.assert_close(v, start[k] + 0.5, rtol=0, atol=1e-6)


def _all_state(path: Path) -> dict[str, torch.Tensor]:
    """Model and EMA weights of a checkpoint, read without a process group."""
    assert (path / MARKER).is_file()
    model, ema = tiny_model(), tiny_model()
    state = {"model": model.state_dict(), "ema": ema.state_dict()}
    dcp.load(state, checkpoint_id=str(path))
    return {f"{k}.{n}": t for k in state for n, t in state[k].items()}


SYNTHETIC_DATASET = "[job.dataset]\nnum_samples = 512\n"


@pytest.fixture(scope="module")
def prepared_digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real digits prepared into shards (``hetero dataset prep``), with a validation split."""
    from realdata import write_digits

    from training.data.prep import PrepRequest, prep

    root = tmp_path_factory.mktemp("digits")
    digits = write_digits(root / "folders", size=32)
    prep(PrepRequest(src=str(digits.train_dir), val_src=str(digits.val_dir),
                     out=str(root / "shards"), shard_bytes=64 * 1024))  # fmt: skip
    return root / "shards"


@pytest.mark.parametrize("data", ["synthetic", "shards"])
def test_resume_with_mixup_ema_and_cosine_equals_an_uninterrupted_run(
    tmp_path: Path, data: str, request: pytest.FixtureRequest
) -> None:
    """Two gloo ranks, 6 steps, every recipe feature on (layer decay, stochastic depth and the
    EMA's warm-up included); cut after step 3 and resumed: the losses, weights and EMA weights
    are bit for bit those of the uninterrupted run. On in-memory synthetic batches, and on real
    images read from a prepared dataset's shards in their shard-aware order (the local input:
    each rank's loader, no data server)."""

    def run(where: Path, *steps: str) -> Path:
        where.mkdir(parents=True, exist_ok=True)
        spec = write_spec(
            where, batch_size=4, steps=6, interval=3, job_keys=RECIPE_KEYS, tables=RECIPE_TABLES,
            model_keys=RECIPE_MODEL_KEYS,
        )  # fmt: skip
        argv = ["--spec", str(spec), "--run-dir", str(where / "run"), "--synthetic-data"]
        if data == "shards":
            shards = request.getfixturevalue("prepared_digits")
            text = spec.read_text()
            assert SYNTHETIC_DATASET in text
            spec.write_text(text.replace(
                SYNTHETIC_DATASET,
                f'[job.dataset]\nsource = "shards"\npath = "{shards}"\nshuffle_shards = 2\n',
            ))  # fmt: skip
            argv.remove("--synthetic-data")
        for s in steps:
            assert run_local([*argv, *s.split()], 2, env=ENV, timeout=240) == [0, 0]
        return where

    whole = run(tmp_path / "whole", "")
    cut = run(tmp_path / "cut", "--steps 3", "")
    summary = json.loads((cut / "run" / "summary.json").read_text())
    assert summary["start_step"] == 3 and summary["recipe"]["mixup"]["cutmix_alpha"] == 1.0

    def losses(d: Path) -> list[float]:
        lines = (d / "run" / "metrics.jsonl").read_text().splitlines()
        return [r["loss"] for r in map(json.loads, lines) if "loss" in r]

    assert losses(cut)[-3:] == losses(whole)[-3:]
    a, b = _all_state(whole / "checkpoints" / "step-6"), _all_state(cut / "checkpoints" / "step-6")
    assert set(a) == set(b) and any(k.startswith("ema.") for k in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # The EMA really is an average, not the weights.
    assert not torch.equal(a["ema.head.weight"], a["model.head.weight"])
