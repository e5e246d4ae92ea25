"""The entry points: ``parse_spec`` (a parsed TOML document), ``parse_augmentation`` and
``load_spec`` (a file)."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from training.spec.augmentation import _parse_augmentation
from training.spec.enums import Parallelism, Role, SpecError
from training.spec.groups import _parse_group
from training.spec.job import _parse_job
from training.spec.reader import _Reader
from training.spec.schema import AugmentationSpec, ClusterSpec, InstanceGroup

DEFAULT_SPEC_PATH = Path("cluster.toml")
_NAME_RE = re.compile(r"[a-z][a-z0-9-]{0,30}")
"""Cluster names: they become CloudFormation stack names (``<name>-cluster``), which allow
letters, digits and '-' only."""


def parse_spec(data: Mapping[str, Any], source: str = "cluster spec") -> ClusterSpec:
    """Validate a parsed TOML document and build the spec; raises ``SpecError``."""
    r = _Reader()
    r.check_keys(data, ClusterSpec, internal=("source",))
    name = r.get(data, "name", str, "hetero")
    if not _NAME_RE.fullmatch(name):
        r.problem("name", f"{name!r} must be lowercase letters, digits and '-', 1-31 characters")
    az_index = r.positive(data, "availability_zone_index", 0, minimum=0)

    groups: list[InstanceGroup] = []
    raw_groups = data.get("groups", [])
    if not isinstance(raw_groups, list) or not raw_groups:
        r.problem("groups", "missing; add [[groups]] tables: one 'trainer' group, 0+ 'dataprep'")
        raw_groups = []
    for i, g in enumerate(raw_groups):
        with r.at(f"groups[{i}]"):
            if not isinstance(g, dict):
                r.problem(None, "expected a table ([[groups]])")
                continue
            parsed = _parse_group(r, g)
            if parsed is not None:
                groups.append(parsed)

    names = [g.name for g in groups]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        r.problem("groups", f"group name {dup!r} is used twice; names must be unique")
    trainers = [g for g in groups if g.role is Role.TRAINER]
    if raw_groups and not trainers and len(groups) == len(raw_groups):
        r.problem("groups", "no group has role 'trainer'; add one (GPU instances that train)")
    if len(trainers) > 1:
        r.problem(
            "groups",
            f"{len(trainers)} trainer groups ({', '.join(g.name for g in trainers)}); use one "
            "trainer group and list alternative types in its instance_types",
        )

    with r.at("job"):
        job = _parse_job(r, r.table(data, "job"))

    if len(trainers) == 1:
        tg = trainers[0]
        world = tg.count * tg.ranks_per_instance
        par = job.parallelism
        if par.strategy is Parallelism.HSDP:
            shard = par.shard_degree or tg.ranks_per_instance
            replicate = par.replicate_degree or max(1, world // shard)
            if shard * replicate != world:
                r.problem(
                    "job.parallelism",
                    f"shard_degree ({shard}) x replicate_degree ({replicate}) = "
                    f"{shard * replicate}, but the trainer group has {world} ranks "
                    f"({tg.count} instances x {tg.ranks_per_instance}); make the product {world}",
                )

    if len(trainers) == 1 and job.lr_base is not None:
        world = trainers[0].count * trainers[0].ranks_per_instance
        peak = job.peak_lr(world)
        if job.min_lr > peak:
            r.problem(
                "job.min_lr",
                f"must be at most the peak learning rate, {peak:g} (lr_base {job.lr_base:g} "
                f"scaled to the global batch of {job.global_batch(world)}), got "
                f"{job.min_lr:g}; lower min_lr or raise lr_base",
            )
    if job.ema.enabled and job.parallelism.strategy is not Parallelism.DDP:
        r.problem(
            "job.ema",
            f"weight EMA keeps a full copy of the model on every rank, which strategy "
            f"'{job.parallelism.strategy}' exists to avoid; use strategy = 'ddp' or remove "
            "[job.ema]",
        )
    if r.problems:
        raise SpecError(r.problems, source)
    return ClusterSpec(
        name=name,
        groups=tuple(groups),
        job=job,
        availability_zone_index=az_index,
        source=source,
    )


def parse_augmentation(raw: Any, source: str = "augmentation") -> AugmentationSpec:
    """An ``AugmentationSpec`` from a preset name or a table (as in ``job.augmentation``);
    raises ``SpecError`` naming each bad field."""
    r = _Reader()
    spec = _parse_augmentation(r, raw)
    if r.problems:
        raise SpecError(r.problems, source)
    return spec


def load_spec(path: str | Path | None = None) -> ClusterSpec:
    """Read and validate the spec at ``path`` (default ``cluster.toml``)."""
    p = Path(path) if path is not None else DEFAULT_SPEC_PATH
    if not p.is_file():
        raise SpecError([f"{p}: no such file; pass --spec PATH or create {p}"], str(p))
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SpecError([f"not valid TOML: {e}"], str(p)) from e
    return parse_spec(data, source=str(p))
