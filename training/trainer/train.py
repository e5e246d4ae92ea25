"""The Trainer: one object that owns the process group, model, optimizer, input, checkpoints
and metrics of a run, and the training loop.

A run ends in one of the outcomes of ``training.common.outcome``: finished (steps or epochs
done, last checkpoint durable), stopped (a graceful stop with a durable checkpoint of the last
step) or failed (the last checkpoint could not be saved; errors raise out of ``train``). Every
wait for a peer is bounded: training collectives by ``HETERO_COLLECTIVE_TIMEOUT_S`` (default
60 s), checkpoint collectives, on a gloo group of their own, by ``HETERO_CHECKPOINT_TIMEOUT_S``
(default 600 s).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from training.common.outcome import Outcome, RankOutcome
from training.common.progress import ProgressWriter
from training.common.tensorboard_paths import tensorboard_uri
from training.data.batch import Batch
from training.dataplane.client import DataWaitInterrupted
from training.trainer.checkpoint import Checkpointer, Restored, completed_at
from training.trainer.checkpoint_policy import CheckpointPolicy
from training.trainer.checkpoint_s3 import S3CheckpointStore
from training.trainer.config import InputKind, TrainerConfig
from training.trainer.data_config import job_data_config
from training.trainer.distributed import DistEnv, gloo_group, init_distributed
from training.trainer.eval_data import ValidationBatches
from training.trainer.evaluate import EvaluationInterrupted, Scores, evaluate
from training.trainer.export import export_trained
from training.trainer.inputs import build_autoscaler, build_stream
from training.trainer.lookahead import Lookahead
from training.trainer.memory_use import local_state_bytes, peak_rss_bytes
from training.trainer.metrics import (
    EvalResult,
    EvalScores,
    Interval,
    MetricsLogger,
    RunFacts,
    peak_flops,
)
from training.trainer.model import start_model, training_flops_per_sample
from training.trainer.model_config import ExportError
from training.trainer.nonfinite import NonFiniteSteps, StepNumbers
from training.trainer.parallel_dims import ParallelDims
from training.trainer.parallelize import compile_blocks, parallelize
from training.trainer.recipe import (
    BatchRecipe,
    LearningRate,
    build_ema,
    build_optimizer,
    clip_gradients,
    describe_lr,
    is_stochastic,
    recipe_summary,
    unwrap,
)
from training.trainer.sample_log import SampleLog
from training.trainer.signals import StopSignal
from training.trainer.stream import BatchStream, DataInterrupted, EndOfData, to_device
from training.trainer.tensorboard_log import TensorBoardLog, run_text
from training.trainer.unreadable import UnreadableSamples

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class LoopState:
    """The training loop's state between steps, for one ``Trainer.train``."""

    start_step: int
    started: float
    """``time.perf_counter()`` when the loop started (the run's wall time counts from it)."""
    lr: float
    """The learning rate of the newest step (the last log line's)."""
    loss_sum: torch.Tensor
    """The applied steps' losses since the last log line, on the device."""
    interval: Interval = field(default_factory=Interval)
    stopped_by: str = "steps"
    eval_excluded: list[float] = field(default_factory=list)
    """Seconds spent evaluating (not training time)."""


@dataclass
class Accumulated:
    """One step's micro-batches through the model: where the data stood before them, their
    summed loss, their epoch and samples, and whether this rank was stopped waiting (void)."""

    data_state: Any
    loss: torch.Tensor
    epoch: int
    sample_ids: list[torch.Tensor] = field(default_factory=list)
    void: bool = False


class Trainer:
    """Trains ``config``'s model; ``train()`` returns the process exit code of its outcome
    (``self.outcome``): 0 finished, 75 stopped, 1 failed."""

    def __init__(
        self,
        config: TrainerConfig,
        *,
        stream: BatchStream | None = None,
        progress: ProgressWriter | None = None,
    ) -> None:
        self.config = config
        self.progress = progress or ProgressWriter(None, 0)
        """Where this rank says it made progress (``training.common.progress``)."""
        self.env = DistEnv.from_environ()
        timeouts = config.timeouts
        self.device, self._owns_group = init_distributed(self.env, timeouts.collective_s)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.step = 0
        self.outcome: RankOutcome | None = None
        self.dims = ParallelDims.resolve(
            config.parallel, world_size=self.world_size, local_world_size=self.env.local_world_size
        )
        self.mesh = self.dims.build_mesh(self.device.type, timeout_s=timeouts.collective_s)
        self.autocast = config.bf16 and self.device.type == "cuda"

        started = start_model(config.model, seed=config.seed)
        model, weights = started.model, started.weights
        # The data the model expects, the same for normalisation, validation and the export.
        self.data = job_data_config(
            config.spec.job, weights.data if weights else None,
            weights.data_from if weights else "the weights",
        )  # fmt: skip
        log.info("data config: %s", self.data.describe())
        if config.compile:
            compile_blocks(model)
        self.model: nn.Module = parallelize(
            model, self.dims, self.mesh, self.device, bf16=self.autocast,
            grad_compression=config.parallel.grad_compression,
        )  # fmt: skip
        job = config.spec.job
        self.optimizer = build_optimizer(self.model, job, world_size=self.world_size)
        log.info("peak learning rate %s", describe_lr(job, self.world_size))
        self.stream = stream or build_stream(
            config, rank=self.rank, world_size=self.world_size,
            pin_memory=self.device.type == "cuda",
        )  # fmt: skip
        self.autoscaler = build_autoscaler(config, self.stream, self.rank)
        self.schedule = LearningRate(
            self.optimizer, job, self._planned_steps(), world_size=self.world_size
        )
        self.nonfinite = NonFiniteSteps(job.max_nonfinite_steps)
        per_epoch = getattr(self.stream, "batches_per_epoch", None)
        self.unreadable = UnreadableSamples(
            job.dataset.max_unreadable,
            epoch_samples=per_epoch * config.batch_size * self.world_size if per_epoch else None,
        )
        self.recipe = BatchRecipe(
            job, num_classes=config.model.num_classes, device=self.device, rank=self.rank,
            stochastic_model=is_stochastic(model),
        )  # fmt: skip
        self.ema = build_ema(self.model, job, self.device)
        self.validation: ValidationBatches | None = None
        if job.dataset.has_validation and config.input.kind is not InputKind.SYNTHETIC:
            self.validation = ValidationBatches(
                config, rank=self.rank, world_size=self.world_size,
                eval_transform=self.data.eval_transform,
            )  # fmt: skip
        ckpt = config.checkpoint
        # Checkpoint collectives on a gloo group of their own, with a longer timeout (a slow
        # upload is not a lost peer); background saves' DCP collectives on another, so a
        # background thread never shares a group with the loop.
        self.checkpointer = Checkpointer(
            ckpt.dir, keep=ckpt.keep, rank=self.rank, world_size=self.world_size,
            local_rank=self.env.local_rank,
            store=S3CheckpointStore(ckpt.s3_uri) if ckpt.s3_uri else None,
            group=gloo_group(timeouts.checkpoint_s),
            async_group=gloo_group(timeouts.checkpoint_s) if ckpt.async_save else None,
        )  # fmt: skip
        if self.ema is not None:
            self.checkpointer.extra["ema"] = self.ema.module
        self.checkpointer.train_state["nonfinite"] = self.nonfinite
        self.checkpointer.train_state["unreadable"] = self.unreadable
        self.checkpointer.check_shared_folder()
        self.policy = CheckpointPolicy(
            self.checkpointer, interval_steps=ckpt.interval_steps, async_save=ckpt.async_save,
            final_retry_s=ckpt.final_save_retry_s,
        )  # fmt: skip
        # The step flags are all-reduced every step: on a CPU group, so they never sync the GPU.
        flags_group = gloo_group(timeouts.collective_s) if self.device.type == "cuda" else None
        self.stop = StopSignal(flags_group).install()
        # A stop request also ends a wait for data (the data servers may be stopping too).
        set_interrupt = getattr(self.stream, "set_interrupt", None)
        if set_interrupt is not None:
            set_interrupt(lambda: self.stop.local)
        if self.validation is not None:
            self.validation.set_interrupt(lambda: self.stop.local)
        self._data_state: dict[str, Any] | None = None
        """The data position to checkpoint instead of the stream's (after a voided step)."""
        self.inputs = Lookahead(self.stream)  # the stream, read one batch ahead in the loop
        self.take_ahead = self.device.type == "cuda"
        """Take the next step's first batch before the host reads this step's numbers: on a GPU
        that read waits for the step, and the batch is made meanwhile. On the CPU the read waits
        for nothing, and taking the batch early would only make the data wait start earlier."""

        mean = torch.tensor(self.data.mean, device=self.device).view(1, 3, 1, 1)
        std = torch.tensor(self.data.std, device=self.device).view(1, 3, 1, 1)
        self._mean, self._std = mean, std
        self.restored: Restored | None = None
        self.samples = (
            SampleLog(config.sample_log_dir, rank=self.rank, world_size=self.world_size)
            if config.sample_log_dir is not None
            else None
        )
        self.state_bytes: dict[str, int] = {}
        s3_uri = config.checkpoint.s3_uri
        self.metrics = MetricsLogger(
            config.run_dir, self._facts(), rank=self.rank, device=self.device,
            emf_cluster=config.emf_cluster,
            tensorboard=TensorBoardLog(
                config.run_dir, upload_uri=tensorboard_uri(s3_uri) if s3_uri else None
            ),
        )  # fmt: skip

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
            accuracy_targets=c.spec.job.accuracy_targets,
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
        # The checkpoint's own completion time: its age spans the restart (rank 0 reports it).
        saved_at = completed_at(self.restored.path) if self.rank == 0 else None
        self.policy.resumed(self.step, saved_at)
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

    def _planned_steps(self) -> int:
        """Optimizer steps of the job the spec plans (the schedule's length): ``job.steps``, or
        ``job.epochs`` times the steps in one epoch. ``--steps`` only moves where this run
        stops, so a run cut short and resumed follows the uninterrupted run's schedule."""
        job = self.config.spec.job
        if job.total_steps is not None:
            return job.total_steps
        batches = int(getattr(self.stream, "batches_per_epoch", 1))
        return max(1, batches // self.config.grad_accum_steps) * (job.epochs or 1)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (``recipe.LearningRate``: a function of
        the step, so resume needs no scheduler state)."""
        return self.schedule.at(step)

    def normalise(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW on the host -> normalised float on the device (``to_device``)."""
        x = to_device(images, self.device).float().div_(255)
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

    def _micro_step(self, batch: Batch, sync: bool, micro: int = 0) -> torch.Tensor:
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
        labels = to_device(batch.labels, self.device)
        if self.recipe.active:
            images, labels = self.recipe.apply(images, labels, step=self.step + 1, micro=micro)
        with (
            self._grad_sync(sync),
            torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast),
            self.recipe.model_randomness(step=self.step + 1, micro=micro),
        ):
            logits = self.model(images)
            loss = self.recipe.loss(logits, labels) / self.config.grad_accum_steps
            if empty:
                loss = loss * 0.0
            loss.backward()
        return loss.detach()

    def train(self) -> int:
        """Run until the step count, the epochs, ``--max-seconds`` or a stop signal;
        checkpoint and write metrics. Sets ``self.outcome`` and returns its exit code."""
        self.resume()
        self.progress.beat(self.step, "resumed")
        self._start_tensorboard()
        zero = torch.zeros((), device=self.device)
        run = LoopState(self.step, time.perf_counter(), self.lr_at(self.step + 1), zero)
        if self.config.spec.job.eval.at_start and self.step == 0 and self.validation is not None:
            # What the starting weights score, before any update (evaluation is not step time).
            run.interval.started += self._validate(run.started, run.eval_excluded)
        total = self.config.total_steps
        while (total is None or self.step < total) and self._step(run):
            pass
        return self._finish(run)

    def _accumulate(self, run: LoopState) -> Accumulated | None:
        """This step's micro-batches through the model (gradients accumulated, not applied);
        None at the end of the data (a partial accumulation dropped)."""
        c = self.config
        done = Accumulated(
            self.inputs.state_dict(),  # the position before this step's batches
            torch.zeros((), device=self.device),
            self.inputs.epoch,
        )
        try:
            for micro in range(c.grad_accum_steps):
                t0 = time.perf_counter()
                try:
                    batch = self.inputs.next()
                except DataInterrupted:
                    # Still run the micro-step (blank, zero weight): the other ranks'
                    # collectives need this rank; the step is then not applied.
                    done.void, batch = True, self._blank
                run.interval.data_wait_s += time.perf_counter() - t0
                self.unreadable.met(batch)
                if micro == 0:
                    done.epoch = self.inputs.epoch  # the epoch this step's first batch is from
                    self._show_inputs(batch)
                done.sample_ids.append(batch.sample_ids)
                last_micro = micro == c.grad_accum_steps - 1
                done.loss += self._micro_step(batch, sync=last_micro, micro=micro)
        except EndOfData:
            self.optimizer.zero_grad(set_to_none=True)
            run.stopped_by = "epochs"
            return None
        return done

    def _step(self, run: LoopState) -> bool:
        """One optimizer step: its batches, the ranks' agreement on it (stop, void, not
        finite), the update, the EMA, logs, checkpoints and evaluation. False when the loop
        ends here (``run.stopped_by`` says why)."""
        c = self.config
        job = c.spec.job
        interval = run.interval
        step_started, waited_before = time.perf_counter(), interval.data_wait_s
        run.lr = self.lr_at(self.step + 1)
        LearningRate.apply(self.optimizer, run.lr)
        done = self._accumulate(run)
        if done is None:
            return False
        elapsed = time.perf_counter() - run.started
        # Out of time stops the run unless this step is its last: a finished run is not
        # "stopped" (the same on every rank: they are at the same step).
        out_of_time = (
            (c.max_seconds is not None and elapsed >= c.max_seconds)
            or (c.deadline is not None and time.time() >= c.deadline)
        ) and (c.total_steps is None or self.step + 1 < c.total_steps)
        if out_of_time:
            self.stop.request()
        # The total gradient norm before clipping (clipped to job.clip_grad_norm) and this
        # rank's loss, read on the host: every rank learns below whether any is not finite.
        grad_norm = clip_gradients(self.model, job.clip_grad_norm)
        more = c.total_steps is None or self.step + 1 < c.total_steps
        if self.take_ahead and more and not self.stop.local:
            # While the GPU still runs this step: the read below waits for it to finish.
            interval.data_wait_s += self.inputs.take_ahead()
        numbers = StepNumbers.read(done.loss, grad_norm)
        flags = self.stop.agree(
            done.void, save_busy=self.policy.busy, nonfinite=not numbers.finite,
            unreadable=self.unreadable.pending,
        )  # fmt: skip
        if flags.unreadable:
            self.unreadable.share(self.world_size, self.stop.group)
        if flags.void:
            # A rank was stopped before it had this step's data: no rank applies the step,
            # and the checkpoint keeps every rank's position from before it (no sample lost
            # or repeated on resume).
            self.optimizer.zero_grad(set_to_none=True)
            self._data_state = done.data_state
            run.stopped_by = self.stop.signal_name or "peer"
            log.info("stopped while waiting for data: step %d not applied", self.step + 1)
            return False
        # A background save must have copied the state before the optimizer changes it.
        stall = self.policy.before_update()
        if flags.nonfinite:
            # No rank applies it; the step still counts (schedule, data, checkpoints).
            self.nonfinite.skip(self.step + 1, numbers)  # raises after too many in a row
            interval.skipped += 1
        else:
            self.nonfinite.applied()
            self.optimizer.step()
            interval.add_grad_norm(numbers.grad_norm)
            run.loss_sum += done.loss
            if not self.state_bytes:
                self.state_bytes = local_state_bytes(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        pace = c.pace_at(self.step + 1)
        if pace:  # a test's stand-in for a slower device: compute takes at least this
            busy = time.perf_counter() - step_started - (interval.data_wait_s - waited_before)
            time.sleep(max(0.0, pace - busy))
        self.step += 1
        interval.steps += 1
        self.progress.beat(self.step, "train")
        # Raises past the share: the samples met are the steps' global batches.
        self.unreadable.judge(self.step * self.metrics.facts.global_batch)
        if self.ema is not None and not flags.nonfinite:
            self.ema.update(unwrap(self.model), step=self.step)
        if self.samples is not None:
            self.samples.append(self.step, done.epoch, done.sample_ids)
        last = flags.stop or self.step == c.total_steps
        if self.step % c.log_every_steps == 0 or last:
            self._log(interval, run.loss_sum, run.lr)
            run.loss_sum.zero_()
            interval.reset()
        if flags.stop:
            run.stopped_by = self.stop.signal_name or ("max-seconds" if out_of_time else "peer")
            return False
        stall += self.policy.at_step(self.step, flags, self.model, self.optimizer, self._data())
        interval.started += stall  # Saving is not step time.
        interval.checkpoint_s += stall
        every = job.eval.every_steps
        if every and self.step % every == 0 and self.step != c.total_steps:
            # Evaluating is neither step time nor data wait.
            interval.started += self._validate(run.started, run.eval_excluded)
        return True

    def _finish(self, run: LoopState) -> int:
        """After the loop: the last log line, the final checkpoint, the outcome, the exported
        model of a finished run, and the summary. Returns the outcome's exit code."""
        c = self.config
        if run.interval.steps:
            self._log(run.interval, run.loss_sum, run.lr)
        self.progress.beat(self.step, "final-checkpoint")
        final_error = self.policy.finish(self.step, self.model, self.optimizer, self._data())
        self.outcome = self._outcome(run.stopped_by, final_error)
        exported: str | None = None
        if self.outcome.outcome is Outcome.FINISHED:
            if self.validation is not None:
                self._validate(run.started, run.eval_excluded)
            # The model a user loads: model.safetensors + config.json beside the checkpoints.
            self.progress.beat(self.step, "export")
            ema = self.ema.module if self.ema is not None else None
            try:
                result = export_trained(
                    self.model, ema, config=c, step=self.step, rank=self.rank, data=self.data
                )
                exported = result.out if result is not None else None
            except ExportError as e:
                # The job's work is durable in its checkpoint; `hetero export` can write the
                # model from it later. Raised on every rank alike, so none waits for another.
                log.error("model not exported (run `hetero export` on step %d): %s", self.step, e)
        memory = {**self.state_bytes, "peak_rss_bytes": peak_rss_bytes()}
        if self.device.type == "cuda":
            memory["gpu_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        per_rank: list[Any] = [memory]
        if self.world_size > 1:
            per_rank = [None] * self.world_size
            dist.all_gather_object(per_rank, memory)
        summary = self.metrics.finish(
            {
                "stopped_by": run.stopped_by,
                "outcome": self.outcome.outcome.value,
                "start_step": run.start_step,
                "resumed_from": str(self.restored.path) if self.restored else None,
                "wall_s": time.perf_counter() - run.started,
                "world_size": self.world_size,
                "strategy": str(self.dims.strategy),
                "grad_compression": str(self.config.parallel.grad_compression),
                "mesh": [self.dims.replicate, self.dims.shard],
                "cluster_usd_per_hour": self.config.spec.usd_per_hour(),
                "memory_per_rank": per_rank,
                "checkpoint": self.policy.summary(),
                "recipe": recipe_summary(self.config.spec.job, self.world_size),
                "nonfinite_steps": self.nonfinite.skipped,
                "unreadable": self.unreadable.summary(),
                "data_config": self.data.as_dict(),
                "model": exported,
            }
        )
        self.summary = summary
        self.progress.beat(self.step, "done")
        log.info(
            "training %s (%s) at step %d; newest checkpoint: step %s",
            self.outcome.outcome.value, self.outcome.reason, self.step,
            self.outcome.checkpoint_step,
        )  # fmt: skip
        # Only the finished job ends the data servers; a Spot stop leaves them to the successor.
        finished = self.outcome.outcome is Outcome.FINISHED
        self.stream.close(job_done=finished and self.rank == 0)
        return self.outcome.outcome.exit_code

    def _beating(self, items: Iterable[T], phase: str) -> Iterator[T]:
        """``items``, with this rank's progress said after each (``phase``)."""
        for item in items:
            yield item
            self.progress.beat(self.step, phase)

    def _validate(self, started: float, excluded: list[float]) -> float:
        """Score the raw weights (and the EMA's) on the whole validation set, log it, and
        return the seconds it took; ``excluded`` collects them (they are not training time)."""
        assert self.validation is not None
        t0 = time.perf_counter()
        wall = t0 - started - sum(excluded)  # training time so far, earlier evaluations out
        size = self.config.model.image_size

        def score(model: nn.Module) -> Scores:
            assert self.validation is not None
            batches = self._beating(self.validation.iter_batches(), "eval")
            return evaluate(
                model, batches, passes=self.validation.batches_per_rank,
                normalise=self.normalise, device=self.device, autocast=self.autocast,
                image_size=size, interrupted_by=(DataWaitInterrupted,),
            )  # fmt: skip

        try:
            raw = score(unwrap(self.model))
            ema = score(self.ema.module) if self.ema is not None else None
        except EvaluationInterrupted as e:
            eval_s = time.perf_counter() - t0
            log.info("step %d: validation not reported: %s", self.step, e)
            excluded.append(eval_s)
            return eval_s
        eval_s = time.perf_counter() - t0
        result = EvalResult(
            top1=raw.top1, top5=raw.top5, loss=raw.loss, samples=raw.samples, eval_s=eval_s,
            ema=EvalScores(top1=ema.top1, top5=ema.top5, loss=ema.loss) if ema else None,
        )  # fmt: skip
        self.metrics.log_eval(
            self.step, result, samples_seen=self.step * self.metrics.facts.global_batch,
            train_wall_s=wall,
        )  # fmt: skip
        excluded.append(eval_s)
        return eval_s

    def _outcome(self, stopped_by: str, final_error: str | None) -> RankOutcome:
        """Finished or stopped only with the last step durable; failed otherwise."""
        if final_error is not None:
            outcome = Outcome.FAILED
            reason = f"{stopped_by}; last checkpoint (step {self.step}) not saved: {final_error}"
        elif stopped_by in ("steps", "epochs"):
            outcome, reason = Outcome.FINISHED, stopped_by
        else:
            outcome, reason = Outcome.STOPPED, stopped_by
        return RankOutcome(
            rank=self.rank,
            outcome=outcome,
            step=self.step,
            checkpoint_step=self.policy.checkpoint_step,
            reason=reason,
        )

    def _data(self) -> Any:
        """The data position to checkpoint: after the last applied step."""
        return self._data_state if self._data_state is not None else self.inputs.state_dict()

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
        # Average loss (over applied steps: NaN without one) and data-wait share over ranks in
        # one small collective.
        loss_mean = loss_sum.float() / interval.applied if interval.applied else math.nan
        t = torch.stack(
            [torch.as_tensor(loss_mean, device=self.device, dtype=torch.float32),
             torch.tensor(interval.data_wait_s / elapsed, device=self.device)]
        )  # fmt: skip
        if self.world_size > 1:
            dist.all_reduce(t)
            t /= self.world_size
        loss, wait_share = (float(v) for v in t.tolist())
        if not math.isfinite(loss):
            log.warning("step %d: loss is %s", self.step, loss)
        extra = self.unreadable.record_fields()
        if self.autoscaler is not None:
            self.autoscaler.observe(self.step, wait_share)
            extra["data_servers"] = self.autoscaler.serving
            extra["data_servers_target"] = self.autoscaler.count
        self.metrics.log(
            self.step, interval, loss=loss, lr=lr, data_wait_share=wait_share,
            epoch=self.inputs.epoch, checkpoint_age_s=self.policy.checkpoint_age_s(),
            extra=extra, lrs=self._group_lrs(),
        )  # fmt: skip
        if self.metrics.tensorboard is not None:
            self.metrics.tensorboard.checkpointed(self.policy.checkpoint_step)

    def _group_lrs(self) -> list[float]:
        """Each param group's rate where the groups run at scales of their own (layer decay's
        ``lr_scale``), even when those rates meet (all 0 at a cosine's end); else none."""
        groups = self.optimizer.param_groups
        if len({g.get("lr_scale", 1.0) for g in groups}) < 2:
            return []
        return [float(g["lr"]) for g in groups]

    def _start_tensorboard(self) -> None:
        """Rank 0 opens its event files at the step it resumed at, with the spec and the run's
        layout as text."""
        tb = self.metrics.tensorboard
        if tb is None:
            return
        tb.start(self.step)
        c = self.config
        try:
            spec_text = Path(c.spec.source).read_text()
        except OSError:
            spec_text = repr(c.spec)
        tb.text("spec", "```toml\n" + spec_text + "\n```")
        layout = {
            "world_size": self.world_size, "strategy": str(self.dims.strategy),
            "mesh": [self.dims.replicate, self.dims.shard],
            "global_batch": self.metrics.facts.global_batch, "total_steps": c.total_steps,
            "resumed_at_step": self.step, "recipe": recipe_summary(c.spec.job, self.world_size),
            "data_config": self.data.as_dict(),
        }  # fmt: skip
        tb.text("run", run_text(layout))

    def _show_inputs(self, batch: Batch) -> None:
        """The run's first batch on rank 0, as the data servers sent it (once)."""
        tb = self.metrics.tensorboard
        if tb is not None:
            tb.inputs(batch.images, self.step + 1)

    def close(self) -> None:
        """Leave the process group (if this trainer created it), restore signal handlers, close
        the sample log and stop the checkpoint upload thread."""
        self.stop.restore()
        if self.metrics.tensorboard is not None:
            self.metrics.tensorboard.close()  # a run that failed before its summary
        if self.autoscaler is not None:
            self.autoscaler.close()
        if self.validation is not None:
            self.validation.close()
        if self.samples is not None:
            self.samples.close()
        self.checkpointer.close()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
