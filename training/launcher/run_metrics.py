"""The trainer's last metrics in its run folder, as a running EC2 host's heartbeat puts them into
the job record (``ec2_watches``) for ``hetero status``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from training.common.names import LAST_EVAL_FILE


def last_metrics(run_dir: Path) -> dict[str, Any] | None:
    """The trainer's last interval record in ``metrics.jsonl`` (rank 0's host only) with, under
    ``"eval"``, its last validation record (``last_eval.json``: top-1, top-5, loss, the EMA's,
    ``targets_reached``), or None when there is neither."""
    value: dict[str, Any] | None = None
    try:
        with open(run_dir / "metrics.jsonl", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    for line in reversed(lines):  # Validation records have their own file: skip them here.
        try:
            record = json.loads(line)
        except ValueError:
            continue  # the tail's first line, cut
        if isinstance(record, dict) and record.get("kind") != "eval":
            value = record
            break
    try:
        last_eval = json.loads((run_dir / LAST_EVAL_FILE).read_text())
    except (OSError, ValueError):
        last_eval = None
    if isinstance(last_eval, dict):
        value = {**(value or {}), "eval": last_eval}
    return value
