"""The training recipe, from timm's factories: optimizer, learning-rate schedule, the batch
augmentations that run on the trainer's device (Mixup / CutMix, random erasing), the loss,
gradient clipping and the weight EMA.

Everything here is a function of the spec and the optimizer step, so a resumed run makes the
same choices as an uninterrupted one: the schedule is evaluated at the step (no scheduler state
to save), Mixup's and random erasing's random draws are seeded by (seed, step, micro-step), and
the EMA's weights are saved with every checkpoint (``Checkpointer.extra``).
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from timm.data import Mixup
from timm.data.random_erasing import RandomErasing
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV3
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from training.spec import JobSpec, Schedule

log = logging.getLogger(__name__)

# Stream ids that keep the seeds of the different random consumers of one step apart.
_MIXUP_STREAM = 1
_ERASING_STREAM = 2


def unwrap(model: nn.Module) -> nn.Module:
    """The module under DDP (FSDP2 modifies the module in place: it is its own inner module)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def step_seed(seed: int, step: int, micro: int, stream: int) -> int:
    """A 32-bit seed for one random consumer of one micro-step, the same on every resume."""
    mixed = np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, step, micro, stream])
    return int(mixed.generate_state(1, np.uint32)[0])


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


def build_optimizer(model: nn.Module, job: JobSpec) -> torch.optim.Optimizer:
    """``timm.optim.create_optimizer_v2`` with timm's parameter groups: no weight decay on
    norms, biases and what the model's ``no_weight_decay()`` names (position embedding, class
    token)."""
    kwargs: dict[str, Any] = {}
    if job.optimizer.value == "sgd":
        kwargs["momentum"] = job.momentum
    return create_optimizer_v2(
        unwrap(model),
        opt=job.optimizer.value,
        lr=job.lr,
        weight_decay=job.weight_decay,
        filter_bias_and_bn=True,
        **kwargs,
    )


class LearningRate:
    """The learning rate at each optimizer step: linear warmup from 0 over ``warmup_steps``,
    then constant or timm's cosine decay to ``min_lr`` at ``total_steps``. A pure function of
    the step (``CosineLRScheduler._get_lr``), so resuming needs no scheduler state."""

    def __init__(self, optimizer: torch.optim.Optimizer, job: JobSpec, total_steps: int) -> None:
        self.peak = job.lr
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

    def __init__(self, job: JobSpec, *, num_classes: int, device: torch.device) -> None:
        self.seed = job.seed
        self.device = device
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


def clip_gradients(model: nn.Module, max_norm: float) -> torch.Tensor | None:
    """Clip the gradients' total norm (across ranks for sharded parameters); returns the norm
    before clipping, or None when clipping is off."""
    if max_norm <= 0:
        return None
    params = [p for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def build_ema(model: nn.Module, job: JobSpec, device: torch.device) -> ModelEmaV3 | None:
    """``timm.utils.ModelEmaV3`` of the (unwrapped) model in fp32, or None when off."""
    if not job.ema.enabled:
        return None
    return ModelEmaV3(unwrap(model), decay=job.ema.decay, device=device)


def recipe_summary(job: JobSpec) -> dict[str, Any]:
    """The recipe as the run's summary records it."""
    return {
        "augmentation": job.augmentation.describe(),
        "optimizer": job.optimizer.value,
        "lr": job.lr,
        "weight_decay": job.weight_decay,
        "schedule": job.schedule.value,
        "warmup_steps": job.warmup_steps,
        "min_lr": job.min_lr,
        "clip_grad_norm": job.clip_grad_norm or None,
        "label_smoothing": job.label_smoothing,
        "mixup": asdict(job.mixup) if job.mixup.enabled else None,
        "ema_decay": job.ema.decay or None,
    }
