"""The accuracy target a plan costs: the training samples needed to reach it.

Given as a number (``--samples-to-target N``) or read from a finished run's ``summary.json``
(``--from-run PATH [--target T]``), whose ``accuracy`` section the trainer writes:

    {"accuracy": {"metric": "top1",
                  "targets": [{"target": 0.8, "reached": true, "step": 120, "samples": 7680,
                               "wall_s": 55.2, "usd": 0.0123},
                              {"target": 0.95, "reached": false}],
                  "best": {"top1": 0.91, "step": 200, "samples": 12800, "wall_s": 90.1,
                           "usd": 0.02}}}

With ``--target T`` that target is used and must have been reached; without it, the highest
target reached; with none reached, the samples at the best accuracy the run reached (said so:
it is not a target). Every configuration is costed on the same sample count.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.planner.errors import PlanError

_OR_GIVE = "or give --samples-to-target N"


@dataclass(frozen=True)
class Target:
    samples: int
    """Training samples needed to reach it."""
    description: str
    """What is reached, in words, e.g. 'top1 >= 0.8 (from runs/a/summary.json, step 120)'."""
    metric: str | None = None
    value: float | None = None
    """The target (or, when ``best``, the best accuracy reached)."""
    best: bool = False
    """True when no target was reached and this is the best accuracy the run reached."""
    source: str | None = None
    """The summary.json it was read from; None for --samples-to-target."""
    step: int | None = None
    run_wall_s: float | None = None
    """What the run itself took to get there (as its summary says)."""
    run_usd: float | None = None

    def record(self) -> dict[str, Any]:
        """plan.json's ``target`` section."""
        return {
            "samples": self.samples,
            "description": self.description,
            "metric": self.metric,
            "value": self.value,
            "best_reached_not_a_target": self.best,
            "source": self.source,
            "step": self.step,
            "run_wall_s": self.run_wall_s,
            "run_usd": self.run_usd,
        }


def from_samples(samples: int) -> Target:
    """``--samples-to-target N``."""
    if samples < 1:
        raise PlanError(f"--samples-to-target must be at least 1, got {samples}")
    return Target(samples=samples, description="given with --samples-to-target")


def _fmt(value: float) -> str:
    return format(value, "g")


def _samples(entry: Mapping[str, Any], where: str, path: Path) -> int:
    samples = entry.get("samples")
    if isinstance(samples, bool) or not isinstance(samples, int | float) or samples < 1:
        raise PlanError(
            f"{path}: {where} has no valid 'samples' (got {samples!r}); the planner needs the "
            f"training samples seen when it was reached ({_OR_GIVE})"
        )
    return math.ceil(samples)


def _number(entry: Mapping[str, Any], key: str) -> float | None:
    value = entry.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _step(entry: Mapping[str, Any]) -> int | None:
    step = entry.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def read_accuracy(path: Path) -> dict[str, Any]:
    """The ``accuracy`` section of a run's summary.json (a run folder is taken to mean its
    summary.json)."""
    if path.is_dir():
        path = path / "summary.json"
    if not path.is_file():
        raise PlanError(
            f"--from-run: no such file {path}; pass the summary.json of a finished training run "
            f"(e.g. runs/NAME/summary.json), {_OR_GIVE}"
        )
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"--from-run: cannot read {path} as JSON ({e}); {_OR_GIVE}") from e
    accuracy = summary.get("accuracy") if isinstance(summary, dict) else None
    if not isinstance(accuracy, dict):
        raise PlanError(
            f"--from-run: {path} has no 'accuracy' section: the run was not evaluated against "
            "accuracy targets. Rerun training with validation and accuracy targets so that its "
            f"summary.json records the samples to each target, {_OR_GIVE}"
        )
    return accuracy


def from_run(path: Path, target: float | None = None) -> Target:
    """The target read from a run's summary.json (see the module docstring for the choice)."""
    source = path / "summary.json" if path.is_dir() else path
    accuracy = read_accuracy(path)
    metric = str(accuracy.get("metric") or "accuracy")
    targets = [t for t in accuracy.get("targets") or [] if isinstance(t, dict)]
    for t in targets:
        if _number(t, "target") is None:
            raise PlanError(f"--from-run: {source}: a target has no numeric 'target': {t!r}")
    reached = [t for t in targets if t.get("reached") is True]
    listed = ", ".join(_fmt(float(t["target"])) for t in targets) or "none"
    reached_list = ", ".join(_fmt(float(t["target"])) for t in reached) or "none"

    chosen: dict[str, Any] | None = None
    if target is not None:
        matching = [t for t in targets if math.isclose(float(t["target"]), target, abs_tol=1e-9)]
        if not matching:
            raise PlanError(
                f"--target {_fmt(target)} is not among the targets of {source} ({listed}); "
                f"the run reached: {reached_list}. Pass one of those reached, or leave out "
                "--target for the highest reached"
            )
        if matching[0].get("reached") is not True:
            raise PlanError(
                f"--target {_fmt(target)} was not reached in {source}; the run reached: "
                f"{reached_list}. Pass one of those, leave out --target for the highest reached "
                f"(or the best accuracy when none was), {_OR_GIVE}"
            )
        chosen = matching[0]
    elif reached:
        chosen = max(reached, key=lambda t: float(t["target"]))

    if chosen is not None:
        value = float(chosen["target"])
        step = _step(chosen)
        at = f", step {step}" if step is not None else ""
        return Target(
            samples=_samples(chosen, f"target {_fmt(value)}", source),
            description=f"{metric} >= {_fmt(value)} (from {source}{at})",
            metric=metric,
            value=value,
            source=str(source),
            step=step,
            run_wall_s=_number(chosen, "wall_s"),
            run_usd=_number(chosen, "usd"),
        )

    best = accuracy.get("best")
    if not isinstance(best, dict):
        raise PlanError(
            f"--from-run: no target was reached in {source} (targets: {listed}) and it records "
            f"no best accuracy; train longer or with lower targets, {_OR_GIVE}"
        )
    best_value = _number(best, metric)
    step = _step(best)
    reached_what = (
        f"{metric} {_fmt(best_value)}" if best_value is not None else f"its best {metric}"
    )
    at = f", step {step}" if step is not None else ""
    return Target(
        samples=_samples(best, "'best'", source),
        description=(
            f"the best accuracy reached, {reached_what}, not a target: no target ({listed}) "
            f"was reached (from {source}{at})"
        ),
        metric=metric,
        value=best_value,
        best=True,
        source=str(source),
        step=step,
        run_wall_s=_number(best, "wall_s"),
        run_usd=_number(best, "usd"),
    )
