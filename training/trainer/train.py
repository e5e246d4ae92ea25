"""The Trainer: one object that owns the process group, model, optimizer, input, checkpoints
and metrics of a run, and the training loop."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from training.data import Batch
from training.trainer.checkpoint import Checkpointer, Restored
from training.trainer.checkpoint_s3 import S3CheckpointStore
from training.trainer.config import TrainerConfig
from training.trainer.inputs import BatchStream, DataInterrupted, EndOfData, build_stream
from training.trainer.metrics import Interval, MetricsLogger, RunFacts, peak_flops
from training.trainer.model import build_model, training_flops_per_sample
from training.trainer.parallel_dims import ParallelDims
from training.trainer.parallelize import compile_blocks, parallelize
from training.trainer.signals import StopSignal

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, from torchrun's environment (one process without it)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_environ(cls) -> DistEnv:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            world_size=world,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
        )


def init_distributed(env: DistEnv) -> tuple[torch.device, bool]:
    """Join the process group (NCCL on GPU, gloo on CPU) unless already in one; returns the
    device and whether this call created the group (and so must destroy it)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        return device, False
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "MASTER_ADDR" not in os.environ and env.world_size == 1:
        # A single process without torchrun: an in-memory store, no port to open.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, **kwargs)
    return device, True


class Trainer:
    """Trains ``config``'s model; ``train()`` returns the process exit code (0 on success and on
    a graceful stop)."""

    def __init__(self, config: TrainerConfig, *, stream: BatchStream | None = None) -> None:
        self.config = config
        self.env = DistEnv.from_environ()
        self.device, self._owns_group = init_distributed(self.env)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dims = ParallelDims.resolve(
            config.parallel, world_size=self.world_size, local_world_size=self.env.local_world_size
        )
        self.mesh = self.dims.build_mesh(self.device.type)
        self.autocast = config.bf16 and self.device.type == "cuda"

        model = build_model(config.model, seed=config.seed)
        if config.compile:
            compile_blocks(model)
        self.model: nn.Module = parallelize(
            model, self.dims, self.mesh, self.device, bf16=self.autocast
        )
        self.optimizer = torch.optim.AdamW(
            _param_groups(self.model, config.optim.weight_decay), lr=config.optim.lr
        )
        self.stream = stream or build_stream(config, rank=self.rank, world_size=self.world_size)
        ckpt = config.checkpoint
        self.checkpointer = Checkpointer(
            ckpt.dir, keep=ckpt.keep, rank=self.rank, world_size=self.world_size,
            local_rank=self.env.local_rank,
            store=S3CheckpointStore(ckpt.s3_uri) if ckpt.s3_uri else None,
        )  # fmt: skip
        # The stop flag is all-reduced every step: on a CPU group, so it never syncs the GPU.
        group = dist.new_group(backend="gloo") if self.device.type == "cuda" else None
        self.stop = StopSignal(group if isinstance(group, dist.ProcessGroup) else None).install()
        # A stop request also ends a wait for data (the data servers may be stopping too).
        set_interrupt = getattr(self.stream, "set_interrupt", None)
        if set_interrupt is not None:
            set_interrupt(lambda: self.stop.local)
        self._data_state: dict[str, Any] | None = None
        """The data position to checkpoint instead of the stream's (after a voided step)."""

        mean = torch.tensor(IMAGENET_DEFAULT_MEAN, device=self.device).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_DEFAULT_STD, device=self.device).view(1, 3, 1, 1)
        self._mean, self._std = mean, std
        self.step = 0
        self.restored: Restored | None = None
        self.state_bytes: dict[str, int] = {}
        self.metrics = MetricsLogger(
            config.run_dir, self._facts(), rank=self.rank, device=self.device
        )

    def _facts(self) -> RunFacts:
        c = self.config
        flops = peak = None
        if self.device.type == "cuda":
            peak = peak_flops(torch.cuda.get_device_name(self.device))
            flops = training_flops_per_sample(c.model)
        return RunFacts(
            global_batch=c.batch_size * c.grad_accum_steps * self.world_size,
            world_size=self.world_size,
            cluster_usd_per_hour=c.spec.usd_per_hour(),
            flops_per_sample=flops,
            peak_flops_per_rank=peak,
            total_steps=c.total_steps,
        )

    # ---------------------------------------------------------------------------------------

    def resume(self) -> None:
        """Load the newest complete checkpoint, if any, with this rank's data position."""
        self.restored = self.checkpointer.restore_latest(self.model, self.optimizer)
        if self.restored is None:
            where = self.config.checkpoint.s3_uri or self.config.checkpoint.dir
            log.info("no checkpoint in %s: starting at step 0", where)
            return
        self.step = self.restored.step
        positions = self.restored.data_state
        if self.restored.world_size == self.world_size and len(positions) == self.world_size:
            self.stream.load_state_dict(positions[self.rank])
        else:
            # Another rank count means other per-rank shards: restart the saved epoch.
            epoch = int(positions[0].get("epoch", 0)) if positions else 0
            log.warning(
                "checkpoint from %d ranks, now %d: data restarts at epoch %d",
                self.restored.world_size, self.world_size, epoch,
            )  # fmt: skip
            self.stream.load_state_dict({"epoch": epoch, "batch": 0})

    def lr_at(self, step: int) -> float:
        """Linear warmup to the peak over ``warmup_steps``, constant after (stateless in the
        step, so resume needs no scheduler state)."""
        o = self.config.optim
        if o.warmup_steps and step <= o.warmup_steps:
            return o.lr * step / o.warmup_steps
        return o.lr

    def normalise(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW on the host -> normalised float on the device."""
        x = images.to(self.device, non_blocking=True).float().div_(255)
        return x.sub_(self._mean).div_(self._std)

    @contextlib.contextmanager
    def _grad_sync(self, sync: bool) -> Iterator[None]:
        """Skip the gradient all-reduce / reduce-scatter on all but the last micro-step."""
        if isinstance(self.model, DistributedDataParallel) and not sync:
            with self.model.no_sync():
                yield
            return
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(sync)
        yield

    def _micro_step(self, batch: Batch, sync: bool) -> torch.Tensor:
        empty = len(batch) == 0
        if empty:
            # Every sample of this batch was unreadable. The rank still steps, so every rank
            # runs the same collectives: one blank image, its loss weighted 0 (zero gradients).
            size = self.config.model.image_size
            batch = Batch(
                images=torch.zeros((1, 3, size, size), dtype=torch.uint8),
                labels=torch.zeros(1, dtype=torch.int64),
                sample_ids=torch.full((1,), -1, dtype=torch.int64),
            )
        images = self.normalise(batch.images)
        labels = batch.labels.to(self.device, non_blocking=True)
        with (
            self._grad_sync(sync),
            torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast),
        ):
            loss = F.cross_entropy(self.model(images), labels) / self.config.grad_accum_steps
            if empty:
                loss = loss * 0.0
            loss.backward()
        return loss.detach()

    def train(self) -> int:
        """Run until the step count, the epochs, ``--max-seconds`` or a stop signal; checkpoint
        and write metrics. Returns 0."""
        c = self.config
        self.resume()
        start_step = self.step
        started = time.perf_counter()
        interval = Interval()
        loss_sum = torch.zeros((), device=self.device)
        stopped_by = "steps"
        last_saved = self.step
        while c.total_steps is None or self.step < c.total_steps:
            lr = self.lr_at(self.step + 1)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            data_state = self.stream.state_dict()  # the position before this step's batches
            void = False  # this rank was stopped while waiting for a batch
            step_loss = torch.zeros((), device=self.device)
            try:
                for micro in range(c.grad_accum_steps):
                    t0 = time.perf_counter()
                    try:
                        batch = self.stream.next()
                    except DataInterrupted:
                        # Still run the micro-step (blank, zero weight): the other ranks'
                        # collectives need this rank; the step is then not applied.
                        void, batch = True, self._blank
                    interval.data_wait_s += time.perf_counter() - t0
                    step_loss += self._micro_step(batch, sync=micro == c.grad_accum_steps - 1)
            except EndOfData:
                self.optimizer.zero_grad(set_to_none=True)  # A partial accumulation: dropped.
                stopped_by = "epochs"
                break
            elapsed = time.perf_counter() - started
            out_of_time = c.max_seconds is not None and elapsed >= c.max_seconds
            if out_of_time:
                self.stop.request()
            stop, any_void = self.stop.agree(void)
            if any_void:
                # A rank was stopped before it had this step's data: no rank applies the step,
                # and the checkpoint keeps every rank's position from before it (no sample lost
                # or repeated on resume).
                self.optimizer.zero_grad(set_to_none=True)
                self._data_state = data_state
                stopped_by = self.stop.signal_name or "peer"
                log.info("stopped while waiting for data: step %d not applied", self.step + 1)
                break
            self.optimizer.step()
            if self.step == start_step:
                self.state_bytes = local_state_bytes(self.model, self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)
            loss_sum += step_loss
            self.step += 1
            interval.steps += 1
            last = stop or self.step == c.total_steps
            if self.step % c.log_every_steps == 0 or last:
                self._log(interval, loss_sum, lr)
                loss_sum.zero_()
                interval.reset()
            if stop:
                stopped_by = self.stop.signal_name or ("max-seconds" if out_of_time else "peer")
                break
            if self.step % c.checkpoint.interval_steps == 0:
                t0 = time.perf_counter()
                self._save()
                last_saved = self.step
                interval.started += time.perf_counter() - t0  # Saving is not step time.
        if interval.steps:
            self._log(interval, loss_sum, lr)
        if self.step != last_saved:
            self._save()
        job_done = stopped_by in ("steps", "epochs")
        memory = {**self.state_bytes, "peak_rss_bytes": peak_rss_bytes()}
        if self.device.type == "cuda":
            memory["gpu_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        per_rank: list[Any] = [memory]
        if self.world_size > 1:
            per_rank = [None] * self.world_size
            dist.all_gather_object(per_rank, memory)
        summary = self.metrics.finish(
            {
                "stopped_by": stopped_by,
                "start_step": start_step,
                "resumed_from": str(self.restored.path) if self.restored else None,
                "wall_s": time.perf_counter() - started,
                "world_size": self.world_size,
                "strategy": str(self.dims.strategy),
                "mesh": [self.dims.replicate, self.dims.shard],
                "cluster_usd_per_hour": self.config.spec.usd_per_hour(),
                "memory_per_rank": per_rank,
            }
        )
        self.summary = summary
        log.info("training stopped by %s at step %d", stopped_by, self.step)
        # Only the finished job ends the data servers; a Spot stop leaves them to the successor.
        self.stream.close(job_done=job_done and self.rank == 0)
        return 0

    def _save(self) -> None:
        data = self._data_state if self._data_state is not None else self.stream.state_dict()
        self.checkpointer.save(self.step, self.model, self.optimizer, data)

    @property
    def _blank(self) -> Batch:
        """A batch with no image (the micro-step makes it a zero-weight step)."""
        size = self.config.model.image_size
        return Batch(
            images=torch.empty((0, 3, size, size), dtype=torch.uint8),
            labels=torch.empty(0, dtype=torch.int64),
            sample_ids=torch.empty(0, dtype=torch.int64),
        )

    def _log(self, interval: Interval, loss_sum: torch.Tensor, lr: float) -> None:
        elapsed = max(time.perf_counter() - interval.started, 1e-9)
        # Average loss and data-wait share over ranks in one small collective.
        t = torch.stack(
            [loss_sum.float() / max(interval.steps, 1),
             torch.tensor(interval.data_wait_s / elapsed, device=self.device)]
        )  # fmt: skip
        if self.world_size > 1:
            dist.all_reduce(t)
            t /= self.world_size
        loss, wait_share = (float(v) for v in t.tolist())
        if not math.isfinite(loss):
            log.warning("step %d: loss is %s", self.step, loss)
        self.metrics.log(
            self.step, interval, loss=loss, lr=lr, data_wait_share=wait_share,
            epoch=self.stream.epoch,
        )  # fmt: skip

    def close(self) -> None:
        """Leave the process group (if this trainer created it) and restore signal handlers."""
        self.stop.restore()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: no weight decay on biases, norms and what timm's ``no_weight_decay()``
    names (position embedding, class token)."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    skip: set[str] = set(getattr(inner, "no_weight_decay", set)())  # timm: pos_embed, ...
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in inner.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 or name in skip else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for ``t`` (its shard, for an FSDP DTensor)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def local_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes held by this rank, from the tensors."""
    params = grads = 0
    for p in model.parameters():
        params += _local_bytes(p)
        if p.grad is not None:
            grads += _local_bytes(p.grad)
    optim = sum(
        _local_bytes(v)
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.numel() > 1
    )
    return {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": optim}


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
