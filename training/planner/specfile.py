"""``--write-spec``: the plan's winner written into a copy of the spec.

The copy keeps every key of the original and changes only what the plan chose:
- the trainer group: instance types (the winner's first, then for Spot the other ranked types
  with the same GPU count and instance count, which AWS scored together), count, market;
- the dataprep group: the planned type and count (other dataprep groups are folded into it);
- ``availability_zone_index`` when a placement score picked the AZ;
- ``job.steps`` so the job still trains the spec's samples at the new world size;
- ``job.checkpoint.interval_steps``: the recommended interval;
- ``[job.prices] usd_per_hour`` for the written types, so ``hetero spec check`` shows the
  cluster at the prices the plan used;
- HSDP degrees are dropped (their defaults follow the new instances; the spec check verifies).

The winner is the plan's first row: the most expected samples per dollar, or, with an accuracy
target, the least expected USD to reach it (its header line says so).

The result is validated with ``training.spec.parse_spec`` before it is written; TOML comments
of the original are not carried over (a header says where the file came from).
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from training.planner.errors import PlanError
from training.planner.evaluate import Plan, PlanRow
from training.spec import ClusterSpec, Market, Role, SpecError, parse_spec

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def trainer_types(plan: Plan, winner: PlanRow) -> list[str]:
    """The winner's type, then (Spot only) its same-GPU, same-count alternatives by rank."""
    facts = plan.facts
    types = [winner.candidate.trainer.instance_type]
    if winner.candidate.trainer.market is not Market.SPOT:
        return types
    gpus = facts.instance(types[0]).gpus
    for r in plan.rows:
        t = r.candidate.trainer
        if (
            t.market is Market.SPOT
            and t.count == winner.candidate.trainer.count
            and facts.instance(t.instance_type).gpus == gpus
            and t.instance_type not in types
        ):
            types.append(t.instance_type)
    return types


def winner_document(raw: Mapping[str, Any], spec: ClusterSpec, plan: Plan) -> dict[str, Any]:
    """A copy of the spec's TOML document with the plan's winner written in."""
    if not plan.rows:
        raise PlanError("--write-spec: every configuration was excluded; nothing to write")
    winner = plan.rows[0]
    trainer = winner.candidate.trainer
    data = copy.deepcopy(dict(raw))
    groups = data.setdefault("groups", [])
    zone = winner.placement.zone if winner.placement and winner.placement.score else None

    types = trainer_types(plan, winner)
    tg = next(g for g in groups if g.get("role") == Role.TRAINER.value)
    tg.update(instance_types=types, count=trainer.count, market=trainer.market.value)
    tg.pop("processes_per_instance", None)  # the plan runs one rank per GPU

    dp = winner.dataprep
    dataprep_groups = [g for g in groups if g.get("role") == Role.DATAPREP.value]
    if dataprep_groups:
        dg = dataprep_groups[0]
        for extra in dataprep_groups[1:]:
            groups.remove(extra)
    else:
        dg = {"name": plan.dataprep_policy.group_name, "role": Role.DATAPREP.value}
        groups.append(dg)
    dg.update(instance_types=[dp.instance_type], count=dp.count, market=dp.market.value)
    dg.pop("processes_per_instance", None)

    if winner.placement is not None and winner.placement.zone_index is not None:
        data["availability_zone_index"] = winner.placement.zone_index

    job = data.setdefault("job", {})
    world = winner.gpus
    per_step = spec.job.batch_size * spec.job.grad_accum_steps * world
    if spec.job.epochs is None and plan.workload.samples_to_train is not None:
        job["steps"] = max(1, math.ceil(plan.workload.samples_to_train / per_step))
    checkpoint = job.setdefault("checkpoint", {})
    checkpoint["interval_steps"] = winner.interval_steps
    if "steps" in job:
        checkpoint["interval_steps"] = min(winner.interval_steps, job["steps"])
    parallelism = job.get("parallelism", {})
    parallelism.pop("shard_degree", None)
    parallelism.pop("replicate_degree", None)

    usd = job.setdefault("prices", {}).setdefault("usd_per_hour", {})
    for t in types:
        usd[t] = round(plan.prices.price(t, trainer.market, zone).usd_per_hour, 6)
    usd[dp.instance_type] = round(dp.price.usd_per_hour, 6)
    return data


def target_header(plan: Plan, winner: PlanRow) -> list[str]:
    """With a target, the comment line saying the winner is the cheapest to reach it."""
    if plan.target is None or winner.usd_to_target is None or winner.hours_to_target is None:
        return []
    return [
        f"# Cheapest expected cost to reach the target: {winner.usd_to_target:.4g} USD in "
        f"{winner.hours_to_target:.4g} h for {plan.target.samples:,} samples, "
        f"{plan.target.description}.",
    ]


def write_spec(source: Path, dest: Path, spec: ClusterSpec, plan: Plan) -> ClusterSpec:
    """Write the winner into a copy of ``source`` at ``dest``; returns the validated spec."""
    raw = tomllib.loads(source.read_text())
    data = winner_document(raw, spec, plan)
    try:
        written = parse_spec(data, source=str(dest))
    except SpecError as e:
        raise PlanError(f"--write-spec: the winner does not make a valid spec:\n{e}") from e
    winner = plan.rows[0]
    header = [
        f"# Written by `hetero plan` on {plan.created.strftime('%Y-%m-%d %H:%M UTC')} from "
        f"{source}: the winner of {len(plan.rows)} ranked configuration(s),",
        f"# {winner.label} + {winner.dataprep.count} x {winner.dataprep.instance_type} "
        f"{winner.dataprep.market.value}: {winner.expected_samples_per_usd:,.0f} expected "
        f"samples per USD at {winner.usd_per_hour:.3f} USD/h.",
        *target_header(plan, winner),
        *(f"# prices: {s}" for s in plan.price_sources),
        "# Comments of the original are not carried over.",
        "",
    ]
    text = "\n".join(header) + dumps(data)
    if tomllib.loads(text) != data:  # the writer below must be exact
        raise PlanError("--write-spec: internal error, the TOML written does not read back")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text)
    return written


# --------------------------------------------------------------------------------------------
# A small TOML writer for what tomllib reads from a spec (tables, arrays of tables, scalars).


def _key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else json.dumps(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # JSON string escapes are TOML basic-string escapes
    if isinstance(v, datetime.date | datetime.time):
        return v.isoformat()
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }"
    raise PlanError(f"--write-spec: cannot write a value of type {type(v).__name__}")


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _table(lines: list[str], path: list[str], table: Mapping[str, Any]) -> None:
    for k, v in table.items():
        if not isinstance(v, dict) and not _is_table_array(v):
            lines.append(f"{_key(k)} = {_value(v)}")
    for k, v in table.items():
        name = ".".join(_key(p) for p in [*path, k])
        if isinstance(v, dict):
            lines += ["", f"[{name}]"]
            _table(lines, [*path, k], v)
        elif _is_table_array(v):
            for item in v:
                lines += ["", f"[[{name}]]"]
                _table(lines, [*path, k], item)


def dumps(data: Mapping[str, Any]) -> str:
    """TOML text that ``tomllib.loads`` reads back as ``data``."""
    lines: list[str] = []
    _table(lines, [], data)
    return "\n".join(lines) + "\n"
