"""The training recipe, from timm's factories: optimizer (with layer-wise learning-rate decay),
learning-rate schedule (with timm's scaling of ``lr_base`` by the global batch), the batch
augmentations that run on the trainer's device (Mixup / CutMix, random erasing), the loss,
the gradient norm and its clipping, and the weight EMA (with timm's decay warm-up).

Everything here is a function of the spec and the optimizer step, so a resumed run makes the
same choices as an uninterrupted one: the schedule is evaluated at the step (no scheduler state
to save), Mixup's and random erasing's random draws are seeded by (seed, step, micro-step), the
model's own (dropout, stochastic depth) by (seed, step, micro-step, rank), and the EMA's weights
are saved with every checkpoint (``Checkpointer.extra``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from timm.data import Mixup
from timm.data.random_erasing import RandomErasing
from timm.layers import DropBlock2d, DropPath, PatchDropout
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV3
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from training.spec import JobSpec, Schedule

log = logging.getLogger(__name__)

# Stream ids that keep the seeds of the different random consumers of one step apart.
_MIXUP_STREAM = 1
_ERASING_STREAM = 2
_MODEL_STREAM = 3
_DROPOUTS = (
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
)  # fmt: skip


def unwrap(model: nn.Module) -> nn.Module:
    """The module under DDP (FSDP2 modifies the module in place: it is its own inner module)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def step_seed(seed: int, step: int, micro: int, stream: int, rank: int | None = None) -> int:
    """A 32-bit seed for one random consumer of one micro-step (of one rank, when given), the
    same on every resume."""
    entropy = [seed & 0xFFFFFFFFFFFFFFFF, step, micro, stream]
    mixed = np.random.SeedSequence(entropy if rank is None else [*entropy, rank])
    return int(mixed.generate_state(1, np.uint32)[0])


def is_stochastic(model: nn.Module) -> bool:
    """Whether the model draws random numbers in training: dropout, timm's stochastic depth
    (``DropPath``), ``DropBlock2d`` or ``PatchDropout`` at a rate above 0."""
    for m in model.modules():
        if isinstance(m, _DROPOUTS):
            rate = m.p
        elif isinstance(m, DropPath | DropBlock2d):
            rate = m.drop_prob
        elif isinstance(m, PatchDropout):
            rate = m.prob
        else:
            continue
        if rate > 0:
            return True
    return False


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seed Python's, NumPy's and torch's (CPU and ``device``) global generators for the block,
    then put them back as they were: timm's Mixup draws from NumPy, random erasing from Python
    and torch, and neither takes a generator."""
    py_state, np_state = random.getstate(), np.random.get_state()
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def describe_lr(job: JobSpec, world_size: int) -> str:
    """Where the peak learning rate with ``world_size`` trainer ranks comes from, for the log."""
    peak = job.peak_lr(world_size)
    if job.lr_base is None:
        return f"{peak:g} (job.lr)"
    scale = job.resolved_lr_base_scale
    return (
        f"{peak:g} = lr_base {job.lr_base:g} x {scale.value}(global batch "
        f"{job.global_batch(world_size)} / lr_base_size {job.lr_base_size}); global batch = "
        f"{job.batch_size} x {job.grad_accum_steps} accumulation x {world_size} ranks"
    )


def build_optimizer(
    model: nn.Module, job: JobSpec, *, world_size: int = 1
) -> torch.optim.Optimizer:
    """``timm.optim.create_optimizer_v2`` with timm's parameter groups: no weight decay on
    norms, biases and what the model's ``no_weight_decay()`` names (position embedding, class
    token); with ``job.layer_decay``, timm's layer-wise groups (``param_groups_layer_decay``),
    each with the ``lr_scale`` that ``LearningRate.apply`` multiplies the rate by. The rate is
    ``job.peak_lr(world_size)``."""
    kwargs: dict[str, Any] = {}
    if job.optimizer.value == "sgd":
        kwargs["momentum"] = job.momentum
    if job.layer_decay is not None:
        kwargs["layer_decay"] = job.layer_decay
    return create_optimizer_v2(
        unwrap(model),
        opt=job.optimizer.value,
        lr=job.peak_lr(world_size),
        weight_decay=job.weight_decay,
        filter_bias_and_bn=True,
        **kwargs,
    )


class LearningRate:
    """The learning rate at each optimizer step: linear warmup from 0 over ``warmup_steps``,
    then constant or timm's cosine decay to ``min_lr`` at ``total_steps``, peaking at
    ``job.peak_lr(world_size)``. A pure function of the step (``CosineLRScheduler._get_lr``), so
    resuming needs no scheduler state."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        job: JobSpec,
        total_steps: int,
        *,
        world_size: int = 1,
    ) -> None:
        self.peak = job.peak_lr(world_size)
        self.warmup = job.warmup_steps
        self.schedule = job.schedule
        self._cosine: CosineLRScheduler | None = None
        if job.schedule is Schedule.COSINE:
            # warmup_prefix: the cosine starts after the warmup and ends at the last step.
            self._cosine = CosineLRScheduler(
                optimizer,
                t_initial=max(1, total_steps - job.warmup_steps),
                lr_min=job.min_lr,
                warmup_t=job.warmup_steps,
                warmup_lr_init=0.0,
                warmup_prefix=True,
                t_in_epochs=False,
            )

    def at(self, step: int) -> float:
        """The rate for optimizer step ``step`` (1-based: the first update is step 1)."""
        if self.warmup and step <= self.warmup:
            return self.peak * step / self.warmup
        if self._cosine is None:
            return self.peak
        return float(self._cosine._get_lr(step)[0])

    @staticmethod
    def apply(optimizer: torch.optim.Optimizer, lr: float) -> None:
        for group in optimizer.param_groups:
            # timm's layer-decay groups carry a scale; plain groups have none.
            group["lr"] = lr * group.get("lr_scale", 1.0)


class BatchRecipe:
    """What happens to a normalised batch on the trainer's device before the forward pass, and
    the loss: Mixup / CutMix (soft targets), label smoothing, random erasing."""

    def __init__(
        self,
        job: JobSpec,
        *,
        num_classes: int,
        device: torch.device,
        rank: int = 0,
        stochastic_model: bool = False,
    ) -> None:
        """``stochastic_model``: the model draws random numbers in its forward pass
        (``is_stochastic``), which ``model_randomness`` then seeds."""
        self.seed = job.seed
        self.device = device
        self.rank = rank
        self.stochastic_model = stochastic_model
        self.label_smoothing = job.label_smoothing
        m = job.mixup
        self.mixup: Mixup | None = None
        if m.enabled:
            self.mixup = Mixup(
                mixup_alpha=m.mixup_alpha,
                cutmix_alpha=m.cutmix_alpha,
                prob=m.prob,
                switch_prob=m.switch_prob,
                mode=m.mode.value,
                label_smoothing=job.label_smoothing,
                num_classes=num_classes,
            )
        aug = job.augmentation
        self.erasing: RandomErasing | None = None
        if aug.re_prob > 0:
            self.erasing = RandomErasing(
                probability=aug.re_prob,
                mode=aug.re_mode,
                max_count=aug.re_count,
                device=str(device),
            )
        self._soft_loss = SoftTargetCrossEntropy()

    @property
    def active(self) -> bool:
        return self.mixup is not None or self.erasing is not None

    def model_randomness(self, *, step: int, micro: int) -> contextlib.AbstractContextManager[None]:
        """Around the forward pass of micro-step ``micro`` of optimizer step ``step``: the
        model's dropout and stochastic depth draw from generators seeded by (seed, step,
        micro-step, rank) (each rank its own draws), so a resumed run drops what the
        uninterrupted one dropped; nothing for a model that draws nothing."""
        if not self.stochastic_model:
            return contextlib.nullcontext()
        return seeded(step_seed(self.seed, step, micro, _MODEL_STREAM, self.rank), self.device)

    def apply(
        self, images: torch.Tensor, labels: torch.Tensor, *, step: int, micro: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Erase, then mix ``images`` (normalised floats) for optimizer step ``step``; returns
        the images and the targets (class indices, or soft targets with Mixup)."""
        if self.erasing is not None:
            with seeded(step_seed(self.seed, step, micro, _ERASING_STREAM), self.device):
                images = self.erasing(images)
        if self.mixup is not None:
            if len(images) % 2:
                # A batch shortened by unreadable samples: mix all but the last image.
                log.debug("step %d: odd batch of %d, last image not mixed", step, len(images))
                head, targets_head = self._mix(images[:-1], labels[:-1], step, micro)
                tail = self._smooth(labels[-1:], targets_head.shape[1])
                return torch.cat([head, images[-1:]]), torch.cat([targets_head, tail])
            return self._mix(images, labels, step, micro)
        return images, labels

    def _mix(
        self, images: torch.Tensor, labels: torch.Tensor, step: int, micro: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.mixup is not None
        if len(images) == 0:
            return images, self._smooth(labels, self.mixup.num_classes)
        with seeded(step_seed(self.seed, step, micro, _MIXUP_STREAM), self.device):
            return self.mixup(images, labels)  # type: ignore[no-any-return]

    def _smooth(self, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
        off = self.label_smoothing / num_classes
        targets = torch.full((len(labels), num_classes), off, device=labels.device)
        return targets.scatter_(1, labels.view(-1, 1), 1.0 - self.label_smoothing + off)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Soft-target cross-entropy for mixed targets, else cross-entropy with smoothing."""
        if targets.ndim == 2:
            return self._soft_loss(logits, targets)  # type: ignore[no-any-return]
        return F.cross_entropy(logits, targets, label_smoothing=self.label_smoothing)


def clip_gradients(model: nn.Module, max_norm: float) -> torch.Tensor:
    """The gradients' total norm before clipping, a plain tensor on the gradients' device (the
    same on every rank: DDP's gradients are already averaged, and a sharded model's norm is
    reduced over its mesh); the gradients are clipped to ``max_norm`` (0: not clipped, and
    scaled by exactly 1). One code path, torch's ``clip_grad_norm_``, for DDP and FSDP2."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
    if isinstance(norm, DTensor):  # FSDP2: a partial norm per shard, summed over the mesh
        norm = norm.full_tensor()
    return norm


def build_ema(model: nn.Module, job: JobSpec, device: torch.device) -> ModelEmaV3 | None:
    """``timm.utils.ModelEmaV3`` of the (unwrapped) model in fp32, or None when off; with
    ``job.ema.warmup``, timm's decay warm-up (``use_warmup``, ``warmup_power``,
    ``warmup_gamma``), a function of the step the trainer passes to ``update``."""
    e = job.ema
    if not e.enabled:
        return None
    return ModelEmaV3(
        unwrap(model),
        decay=e.decay,
        use_warmup=e.warmup,
        warmup_power=e.warmup_power,
        warmup_gamma=e.warmup_gamma,
        device=device,
    )


def recipe_summary(job: JobSpec, world_size: int = 1) -> dict[str, Any]:
    """The recipe as the run's summary records it (``lr``: the peak rate with ``world_size``
    trainer ranks)."""
    return {
        "augmentation": job.augmentation.describe(),
        "optimizer": job.optimizer.value,
        "lr": job.peak_lr(world_size),
        "lr_base": (
            {
                "lr_base": job.lr_base,
                "lr_base_size": job.lr_base_size,
                "lr_base_scale": job.resolved_lr_base_scale.value,
                "global_batch": job.global_batch(world_size),
            }
            if job.lr_base is not None
            else None
        ),
        "layer_decay": job.layer_decay,
        "drop_rate": job.model.drop_rate,
        "drop_path_rate": job.model.drop_path_rate,
        "weight_decay": job.weight_decay,
        "schedule": job.schedule.value,
        "warmup_steps": job.warmup_steps,
        "min_lr": job.min_lr,
        "clip_grad_norm": job.clip_grad_norm or None,
        "label_smoothing": job.label_smoothing,
        "mixup": asdict(job.mixup) if job.mixup.enabled else None,
        "ema_decay": job.ema.decay or None,
        "ema_warmup": (
            {"power": job.ema.warmup_power, "gamma": job.ema.warmup_gamma}
            if job.ema.enabled and job.ema.warmup
            else None
        ),
        "max_nonfinite_steps": job.max_nonfinite_steps,
    }
