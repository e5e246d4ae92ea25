"""The fine-tuning recipe (issue 28, item 4), each piece against timm's own, on the tiny CPU ViT
in one process: layer-wise learning-rate decay (``param_groups_layer_decay``'s scales), the
learning rate scaled by the global batch (``lr_base``, as timm's ``train.py``), the EMA's decay
warm-up (``ModelEmaV3``), ``drop_path_rate`` in the blocks (its draws seeded, so a resume is
bit-equal), the gradient norm of each interval, non-finite steps skipped (and too many in a row
stopping the run, also across a resume), init weights of another patch size or channel count
resampled by timm's functions, and two gloo ranks under DDP and FSDP2."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from timm.layers import resample_abs_pos_embed, resample_patch_embed
from timm.models import adapt_input_conv
from timm.optim import param_groups_layer_decay

from training.spec import LrScale, load_spec, parse_spec
from training.trainer.config import ConfigError, ModelConfig, TrainerConfig
from training.trainer.inputs import build_stream
from training.trainer.model import build_model, inspect_init, plan_init
from training.trainer.nonfinite import NonFiniteError
from training.trainer.recipe import LearningRate, build_ema, build_optimizer, unwrap
from training.trainer.train import Trainer

from .conftest import write_spec

TINY = {"patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2}


def job(**fields: Any) -> Any:
    """A parsed ``[job]`` of the tiny model with these fields set."""
    doc = {
        "groups": [{"name": "t", "role": "trainer", "instance_types": ["g5.xlarge"], "count": 1}],
        "job": {
            "batch_size": 8,
            "steps": 10,
            "model": {"name": "vit-cpu-tiny"},
            "dataset": {"num_classes": 10, "image_size": 32},
            **fields,
        },
    }
    return parse_spec(doc).job


def tiny_model(**fields: Any) -> torch.nn.Module:
    return build_model(ModelConfig("vit-cpu-tiny", {}, 32, 10, **fields), seed=0)


# -- layer-wise learning-rate decay ---------------------------------------------------------


def test_layer_decay_gives_each_parameter_timms_scale_of_the_rate() -> None:
    model = tiny_model()
    j = job(layer_decay=0.75, lr=0.01, weight_decay=0.05)
    opt = build_optimizer(model, j)
    LearningRate.apply(opt, 0.004)
    lr = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    wd = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    # timm's own groups for the same model: the scale and weight decay of every parameter.
    theirs = param_groups_layer_decay(
        model, weight_decay=0.05, layer_decay=0.75,
        no_weight_decay_list=model.no_weight_decay(),  # type: ignore[operator]
    )  # fmt: skip
    scale = {id(p): g["lr_scale"] for g in theirs for p in g["params"]}
    decay = {id(p): g["weight_decay"] for g in theirs for p in g["params"]}
    params = dict(model.named_parameters())
    assert lr.keys() == scale.keys() == {id(p) for p in params.values()}
    for name, p in params.items():
        assert lr[id(p)] == 0.004 * scale[id(p)], name
        assert wd[id(p)] == decay[id(p)], name
    # Depth 2: the embeddings (layer 0), two blocks, the head at the full rate (layer 3).
    by_name = {n: lr[id(p)] / 0.004 for n, p in params.items()}
    assert by_name["head.weight"] == by_name["head.bias"] == 1.0
    assert by_name["blocks.1.attn.qkv.weight"] == 0.75
    assert by_name["blocks.0.attn.qkv.weight"] == 0.75**2
    assert by_name["pos_embed"] == by_name["patch_embed.proj.weight"] == 0.75**3
    assert wd[id(params["pos_embed"])] == 0.0 and wd[id(params["head.weight"])] == 0.05
    # Without layer_decay every group runs at the rate itself.
    plain = build_optimizer(model, job(lr=0.01))
    LearningRate.apply(plain, 0.004)
    assert {g["lr"] for g in plain.param_groups} == {0.004}


# -- the learning rate by global batch ----------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "world", "expected", "scale"),
    [
        # timm's train.py: sqrt for Adam-family optimizers and LAMB, linear otherwise.
        ({"batch_size": 64, "grad_accum_steps": 2}, 4, 1e-3 * math.sqrt(512 / 256), "sqrt"),
        ({"batch_size": 64, "optimizer": "lamb"}, 2, 1e-3 * math.sqrt(128 / 256), "sqrt"),
        ({"batch_size": 64, "optimizer": "sgd"}, 8, 1e-3 * 512 / 256, "linear"),
        ({"batch_size": 64, "lr_base_scale": "linear"}, 8, 1e-3 * 2, "linear"),
        ({"batch_size": 64, "lr_base_size": 512}, 8, 1e-3, "sqrt"),
    ],
)
def test_lr_base_is_scaled_to_the_global_batch_as_timms_train_py(
    fields: dict[str, Any], world: int, expected: float, scale: str
) -> None:
    j = job(lr_base=1e-3, schedule="constant", **fields)
    assert j.resolved_lr_base_scale is LrScale(scale)
    assert j.peak_lr(world) == pytest.approx(expected, rel=1e-15)
    opt = build_optimizer(tiny_model(), j, world_size=world)
    assert opt.defaults["lr"] == pytest.approx(expected, rel=1e-15)
    rate = LearningRate(opt, j, total_steps=10, world_size=world)
    assert rate.at(1) == rate.at(10) == pytest.approx(expected, rel=1e-15)
    assert job(lr=0.02).peak_lr(world) == 0.02  # an absolute lr ignores the batch


# -- EMA warm-up --------------------------------------------------------------------------------


def test_ema_warmup_follows_timms_decay_at_each_step() -> None:
    model = tiny_model()
    ema = build_ema(
        model,
        job(ema={"decay": 0.999, "warmup": True, "warmup_power": 0.75, "warmup_gamma": 2.0}),
        torch.device("cpu"),
    )
    assert ema is not None and ema.use_warmup
    for step in (1, 2, 3, 10, 100, 10_000):
        want = 0.0 if step == 1 else min(0.999, 1 - (1 + (step - 1) / 2.0) ** -0.75)
        assert ema.get_decay(step) == pytest.approx(want, rel=1e-12), step
    assert ema.get_decay(10**7) == 0.999  # capped at decay
    # The trainer's update at step 5 moves the average by 1 - decay(5).
    start = {k: v.clone() for k, v in ema.module.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model, step=5)
    d = 1 - (1 + 4 / 2.0) ** -0.75
    for k, v in ema.module.state_dict().items():
        torch.testing.assert_close(v, start[k] + (1 - d), rtol=0, atol=1e-6)
    plain = build_ema(model, job(ema={"decay": 0.999}), torch.device("cpu"))
    assert plain is not None and not plain.use_warmup and plain.get_decay(2) == 0.999


# -- drop rates ---------------------------------------------------------------------------------


def test_drop_path_rate_and_drop_rate_reach_the_model(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, model_keys="drop_path_rate = 0.2\ndrop_rate = 0.1")
    config = TrainerConfig.from_spec(load_spec(spec), run_dir=tmp_path, synthetic=True)
    assert (config.model.drop_path_rate, config.model.drop_rate) == (0.2, 0.1)
    model = build_model(config.model, seed=0)
    # timm's stochastic depth rule: 0 at the first block, rising linearly to the rate.
    assert isinstance(model.blocks[0].drop_path1, torch.nn.Identity)  # type: ignore[index]
    assert model.blocks[1].drop_path1.drop_prob == pytest.approx(0.2)  # type: ignore[index]
    assert model.head_drop.p == pytest.approx(0.1)  # type: ignore[union-attr]
    assert isinstance(tiny_model().blocks[1].drop_path1, torch.nn.Identity)  # type: ignore[index]


def test_the_trainer_refuses_another_channel_count_it_cannot_feed(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, tables="[job.model.overrides]\nin_chans = 1\n")
    with pytest.raises(ConfigError, match=r"job\.model\.overrides\.in_chans = 1, but the trainer"):
        TrainerConfig.from_spec(load_spec(spec), run_dir=tmp_path, synthetic=True)


# -- the gradient norm and non-finite steps (one process, the real Trainer) ---------------------


@pytest.fixture
def make_trainer(tmp_path: Path) -> Iterator[Any]:
    made: list[Trainer] = []

    def make(
        name: str,
        *,
        steps: int,
        job_keys: str = "",
        interval: int = 100,
        log_every: int = 1,
        model_keys: str = "",
        stop_at: int | None = None,
    ) -> Trainer:
        """``steps``: the job's; ``stop_at``: where this run stops (``--steps``)."""
        folder = tmp_path / name
        folder.mkdir(exist_ok=True)
        spec = write_spec(
            folder, batch_size=4, steps=steps, interval=interval, job_keys=job_keys,
            model_keys=model_keys,
        )  # fmt: skip
        config = TrainerConfig.from_spec(
            load_spec(spec), run_dir=folder / "run", synthetic=True, environ={}, steps=stop_at
        )
        trainer = Trainer(replace(config, log_every_steps=log_every))
        made.append(trainer)
        return trainer

    yield make
    for trainer in made:
        trainer.close()


def records(trainer: Trainer) -> list[dict[str, Any]]:
    lines = (trainer.config.run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "kind" not in r]


def nan_at(trainer: Trainer, steps: set[int]) -> None:
    """Make the logits NaN in the forward passes of these optimizer steps."""

    def hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        return output * math.nan if trainer.step + 1 in steps else None

    unwrap(trainer.model).register_forward_hook(hook)


def test_each_interval_records_the_gradient_norm_before_clipping(make_trainer: Any) -> None:
    trainer = make_trainer("norm", steps=2, job_keys="clip_grad_norm = 0.01")
    # The first step's gradients, computed here with plain torch from the same model and batch.
    model = build_model(trainer.config.model, seed=trainer.config.seed)
    batch = build_stream(trainer.config, rank=0, world_size=1).next()
    images = trainer.normalise(batch.images)
    F.cross_entropy(model(images), batch.labels).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    want = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
    assert trainer.train() == 0
    first, second = records(trainer)
    assert first["grad_norm"] == pytest.approx(want, rel=1e-6) and want > 0.01  # before clipping
    assert first["grad_norm_max"] == first["grad_norm"] and first["nonfinite_steps"] == 0
    # An interval of both steps: their mean and max (the same run, logged every 2 steps).
    both = make_trainer("both", steps=2, job_keys="clip_grad_norm = 0.01", log_every=2)
    assert both.train() == 0
    (pair,) = records(both)
    norms = [first["grad_norm"], second["grad_norm"]]
    assert pair["grad_norm"] == pytest.approx(sum(norms) / 2, rel=1e-12)
    assert pair["grad_norm_max"] == max(norms)
    assert both.summary["nonfinite_steps"] == 0


def test_a_nonfinite_step_changes_no_weight_and_is_counted(
    make_trainer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    constant = 'schedule = "constant"'  # step 1 at the same rate in both runs
    once = make_trainer("once", steps=2, job_keys=constant)
    nan_at(once, {2})
    with caplog.at_level(logging.WARNING, logger="training.trainer.nonfinite"):
        assert once.train() == 0
    assert "step 2: the loss or gradient norm is not finite on this rank" in caplog.text
    assert "(1 in a row; the run stops at 3, job.max_nonfinite_steps)" in caplog.text
    first, second = records(once)
    assert first["nonfinite_steps"] == 0 and math.isfinite(first["loss"])
    assert second["nonfinite_steps"] == 1 and second["grad_norm"] is None
    assert math.isnan(second["loss"])  # no applied step in the interval
    assert once.summary["nonfinite_steps"] == 1 and once.step == 2
    # The weights and the optimizer are those of one step: step 2 changed nothing.
    one = make_trainer("one", steps=1, job_keys=constant)
    assert one.train() == 0
    for (name, a), b in zip(
        once.model.state_dict().items(), one.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    sa, sb = once.optimizer.state_dict()["state"], one.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"]) for k in sa)
    assert all(float(sa[k]["step"]) == 1.0 for k in sa)


def test_too_many_nonfinite_steps_in_a_row_stop_the_run_with_what_to_try(
    make_trainer: Any,
) -> None:
    trainer = make_trainer("stop", steps=8, job_keys="max_nonfinite_steps = 2")
    nan_at(trainer, {2, 4, 5, 6})  # 2 alone is skipped; 4 and 5 make two in a row
    with pytest.raises(NonFiniteError) as info:
        trainer.train()
    assert str(info.value).startswith(
        "steps 4-5: 2 step(s) in a row had a non-finite loss or gradient norm (on this rank at "
        "step 5: loss nan, gradient norm nan), job.max_nonfinite_steps = 2: the run stops."
    )
    assert "Try: a lower job.lr (or job.lr_base)" in str(info.value)
    assert 'precision = "fp32"' in str(info.value)
    assert trainer.nonfinite.state_dict() == {"in_a_row": 2, "skipped": 3}


def test_the_nonfinite_counters_resume_with_the_checkpoint(make_trainer: Any) -> None:
    """Cut after a skipped step and resumed, the run stops at the step the uninterrupted run
    stops at: the count in a row comes back from the checkpoint."""
    keys = "max_nonfinite_steps = 2"
    cut = make_trainer("cut", steps=3, job_keys=keys, interval=1)
    nan_at(cut, {3})
    assert cut.train() == 0 and cut.policy.checkpoint_step == 3
    resumed = make_trainer("cut", steps=6, job_keys=keys, interval=1)
    nan_at(resumed, {4})
    with pytest.raises(NonFiniteError, match=r"^steps 3-4: 2 step\(s\) in a row"):
        resumed.train()
    assert resumed.restored is not None and resumed.restored.step == 3
    assert resumed.nonfinite.state_dict() == {"in_a_row": 2, "skipped": 2}


def test_stochastic_depth_draws_are_seeded_so_a_resume_equals_the_whole_run(
    make_trainer: Any,
) -> None:
    """Dropout and stochastic depth draw from generators seeded by (seed, step, micro-step,
    rank) in the forward pass: cut after step 2 and resumed, the weights at step 4 are those of
    the uninterrupted run, bit for bit."""
    keys = "drop_path_rate = 0.5\ndrop_rate = 0.3"
    whole = make_trainer("whole", steps=4, model_keys=keys)
    assert whole.recipe.stochastic_model
    assert whole.train() == 0
    cut = make_trainer("cut", steps=4, model_keys=keys, stop_at=2)
    assert cut.train() == 0
    resumed = make_trainer("cut", steps=4, model_keys=keys)
    assert resumed.train() == 0 and resumed.restored is not None
    for (name, a), b in zip(
        whole.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    # The draws matter: without stochastic depth the run ends elsewhere.
    plain = make_trainer("plain", steps=4)
    assert not plain.recipe.stochastic_model and plain.train() == 0
    assert not torch.equal(
        plain.model.state_dict()["head.weight"], whole.model.state_dict()["head.weight"]
    )


# -- init weights of another patch size or channel count ----------------------------------------


def source(folder: Path, config: dict[str, Any] | None = None, **overrides: Any) -> Path:
    """A weights file written by plain timm, with a ``config.json`` beside it."""
    torch.manual_seed(7)
    kwargs = {**TINY, **overrides}
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=10, **kwargs)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "w.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return path


def test_another_patch_size_and_channel_count_are_resampled_by_timm(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Its config.json differs from the model in what timm resamples (patch size, channels) and
    # in what changes no tensor (stochastic depth, pooling between "" and "token", dynamic size).
    args = {**TINY, "patch_size": 4, "in_chans": 1, "drop_path_rate": 0.3, "global_pool": "",
            "dynamic_img_size": False}  # fmt: skip
    path = source(
        tmp_path / "gray", {"architecture": "vit_tiny_patch16_224", "model_args": args},
        patch_size=4, in_chans=1,
    )  # fmt: skip
    saved = load_file(str(path))
    config = ModelConfig(
        "vit-cpu-tiny", {"global_pool": "token", "dynamic_img_size": True}, 32, 10,
        init=str(path), drop_path_rate=0.1,
    )  # fmt: skip
    plan = plan_init(config, inspect_init(config))
    assert plan.resampled == ("patch_embed.proj.weight", "pos_embed") and plan.file_in_chans == 1
    with caplog.at_level(logging.INFO, logger="training.trainer.model"):
        state = build_model(config, seed=0).state_dict()
    # timm's order (checkpoint_filter_fn, then load_pretrained): the kernel resampled from 4 x 4
    # to 8 x 8, then the single channel spread over three.
    kernel = resample_patch_embed(saved["patch_embed.proj.weight"], [8, 8], verbose=False)
    assert torch.equal(state["patch_embed.proj.weight"], adapt_input_conv(3, kernel, base_chans=1))
    grid = resample_abs_pos_embed(saved["pos_embed"], new_size=[4, 4], num_prefix_tokens=1)
    assert torch.equal(state["pos_embed"], grid) and grid.shape == (1, 17, 32)
    for key in saved.keys() - {"patch_embed.proj.weight", "pos_embed"}:
        assert torch.equal(state[key], saved[key]), key
    assert "timm resampled patch_embed.proj.weight from [32, 1, 4, 4] to [32, 3, 8, 8]" in (
        caplog.text
    )
    assert "timm adapted patch_embed.proj from 1 input channel(s) to 3" in caplog.text
    # Three channels and another patch size: the kernel alone is resampled.
    rgb = source(tmp_path / "rgb", patch_size=16)
    state = build_model(ModelConfig("vit-cpu-tiny", {}, 32, 10, init=str(rgb)), seed=0).state_dict()
    want = resample_patch_embed(load_file(str(rgb))["patch_embed.proj.weight"], [8, 8])
    assert torch.equal(state["patch_embed.proj.weight"], want)


def test_a_pooling_that_changes_tensors_is_still_refused(tmp_path: Path) -> None:
    # global_pool "avg" makes timm's ViT normalise in fc_norm instead of norm: other tensors.
    path = source(
        tmp_path / "avg", {"architecture": "vit_tiny_patch16_224",
                           "model_args": {**TINY, "global_pool": "avg"}}, global_pool="avg",
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"the model has tensors the file lacks: norm\.bias"):
        build_model(ModelConfig("vit-cpu-tiny", {}, 32, 10, init=str(path)), seed=0)


# -- two gloo ranks: the norm under DDP and FSDP2, and one rank's non-finite step ---------------


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's own images and labels (the ranks' gradients differ)."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)


def _rank(rank: int, port: int, tmp: Path, spec: Path) -> None:
    """Rank ``rank`` of 2: the flags, the gradient norm of a DDP and an FSDP2 model, and a
    Trainer whose rank 1 alone sees NaN logits at step 2; writes what it saw to ``tmp``."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from training.spec import Parallelism
    from training.trainer.config import ParallelConfig
    from training.trainer.parallel_dims import ParallelDims
    from training.trainer.parallelize import parallelize
    from training.trainer.recipe import clip_gradients
    from training.trainer.signals import StopSignal

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    seen: dict[str, Any] = {
        "flags": [StopSignal().agree(nonfinite=rank == 1).nonfinite, StopSignal().agree().nonfinite]
    }
    for strategy in (Parallelism.DDP, Parallelism.FSDP):
        dims = ParallelDims.resolve(
            ParallelConfig(strategy, None, None), world_size=2, local_world_size=2
        )
        model = parallelize(
            tiny_model(), dims, dims.build_mesh("cpu", timeout_s=30), torch.device("cpu"),
            bf16=False,
        )  # fmt: skip
        images, labels = _batch(rank)
        F.cross_entropy(model(images), labels).backward()
        norm = float(clip_gradients(model, 0.0))
        clipped = float(clip_gradients(model, norm / 2))  # clip to half ...
        after = float(clip_gradients(model, 0.0))  # ... and measure again
        seen[str(strategy)] = (norm, clipped, after)
    trainer = Trainer(
        TrainerConfig.from_spec(load_spec(spec), run_dir=tmp / "run", synthetic=True, environ={})
    )
    if rank == 1:
        nan_at(trainer, {2})
    seen["exit"] = trainer.train()
    seen["skipped"] = trainer.summary["nonfinite_steps"]
    seen["weights"] = {k: v.clone() for k, v in unwrap(trainer.model).state_dict().items()}
    trainer.close()
    torch.save(seen, tmp / f"rank-{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_ranks_agree_on_the_norm_and_skip_one_ranks_nonfinite_step(tmp_path: Path) -> None:
    import multiprocessing

    import torch.multiprocessing as torch_mp

    from training.trainer.local_run import FORKSERVER_PRELOAD, free_port

    spec = write_spec(tmp_path, batch_size=4, steps=3)
    multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    torch_mp.start_processes(
        _rank, args=(free_port(), tmp_path, spec), nprocs=2, start_method="forkserver"
    )
    seen = [torch.load(tmp_path / f"rank-{r}.pt") for r in (0, 1)]
    # The norm of the averaged gradients, from one process over both ranks' batches.
    model = tiny_model()
    for rank in (0, 1):
        images, labels = _batch(rank)
        (F.cross_entropy(model(images), labels) / 2).backward()
    want = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
    for s in seen:
        assert s["flags"] == [True, False]  # one rank's non-finite flag reaches both
        for strategy in ("ddp", "fsdp"):
            norm, clipped, after = s[strategy]
            assert norm == pytest.approx(want, rel=1e-5), strategy
            assert clipped == norm and after == pytest.approx(norm / 2, rel=1e-5), strategy
        assert s["exit"] == 0 and s["skipped"] == 1  # rank 1's NaN skipped step 2 everywhere
    for name, value in seen[0]["weights"].items():
        assert torch.equal(value, seen[1]["weights"][name]) and bool(value.isfinite().all()), name
