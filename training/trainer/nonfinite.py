"""Steps whose loss or gradient norm is not finite: skipped on every rank, counted, and after
``job.max_nonfinite_steps`` in a row the run stops with an error that says what to try.

One NaN or inf in a loss or a gradient would, once applied, make every weight (and the EMA's)
NaN for the rest of the run. So each step's loss and total gradient norm (before clipping) are
read on the host once (the one GPU synchronisation per step this costs, as torch's
``GradScaler`` does for fp16), each rank says whether its own are finite in the per-step flag
all-reduce (``training.trainer.signals``), and when any rank's are not, no rank applies the
step: its gradients are dropped, the optimizer and the EMA do not move, and the step counts
(the schedule, the data position and the checkpoint interval go on as for any step). The
counters are saved with every checkpoint (``Checkpointer.train_state``), so a resumed run stops
where the uninterrupted one would.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

FIELD = "job.max_nonfinite_steps"


class NonFiniteError(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient norm; the run stops (outcome
    ``failed``). Raised on every rank at the same step."""


@dataclass(frozen=True)
class StepNumbers:
    """One step's loss (this rank's, summed over its micro-steps) and total gradient norm
    before clipping (the same on every rank), read on the host."""

    loss: float
    grad_norm: float

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)

    @classmethod
    def read(cls, loss: torch.Tensor, grad_norm: torch.Tensor) -> StepNumbers:
        """Both values in one device-to-host copy."""
        values = torch.stack([loss.detach().float(), grad_norm.detach().float()]).tolist()
        return cls(loss=float(values[0]), grad_norm=float(values[1]))


class NonFiniteSteps:
    """Counts skipped steps and stops the run after ``limit`` in a row; its state is two
    integers (``state_dict``), the same on every rank."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        self.in_a_row = 0
        """Skipped steps since the last applied one."""
        self.skipped = 0
        """Skipped steps in the whole job (across resumes)."""

    def applied(self) -> None:
        """The step was applied: the run of skipped steps is over."""
        self.in_a_row = 0

    def skip(self, step: int, numbers: StepNumbers) -> None:
        """Count step ``step`` as skipped (``numbers``: this rank's view of it); raises
        ``NonFiniteError`` when it makes ``limit`` in a row."""
        self.in_a_row += 1
        self.skipped += 1
        where = "on this rank" if not numbers.finite else "on another rank"
        if self.in_a_row >= self.limit:
            first = step - self.in_a_row + 1
            steps = f"step {step}" if first == step else f"steps {first}-{step}"
            raise NonFiniteError(
                f"{steps}: {self.in_a_row} step(s) in a row had a non-finite loss or gradient "
                f"norm ({where} at step {step}: loss {numbers.loss:.6g}, gradient norm "
                f"{numbers.grad_norm:.6g}), {FIELD} = {self.limit}: the run stops. The skipped "
                "steps changed no weight; the newest checkpoint holds the weights before them. "
                "Try: a lower job.lr (or job.lr_base), a longer job.warmup_steps, "
                'job.clip_grad_norm (e.g. 1.0), precision = "fp32" instead of bf16, and '
                "check the data for corrupt images"
            )
        log.warning(
            "step %d: the loss or gradient norm is not finite %s (this rank: loss %.6g, "
            "gradient norm %.6g): update skipped on every rank (%d in a row; the run stops at "
            "%d, %s)",
            step, where, numbers.loss, numbers.grad_norm, self.in_a_row, self.limit, FIELD,
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {"in_a_row": self.in_a_row, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.in_a_row = int(state.get("in_a_row", 0))
        self.skipped = int(state.get("skipped", 0))
