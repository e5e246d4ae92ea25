"""Checkpoint step folders: ``step-N`` (local and in S3), complete when ``COMPLETE`` is in them."""

from __future__ import annotations

import re

MARKER = "COMPLETE"
"""Written last into a finished ``step-N/``."""
STEP_PATTERN = re.compile(r"^step-(\d+)$")


PARTIAL_SUFFIX = ".partial"
"""A save in progress writes ``step-N.partial/``, renamed to ``step-N`` once complete."""


def step_name(step: int) -> str:
    return f"step-{step}"


def partial_name(step: int) -> str:
    return f"{step_name(step)}{PARTIAL_SUFFIX}"


def step_of(name: str) -> int | None:
    """N of a folder named ``step-N``; None for any other name."""
    m = STEP_PATTERN.match(name)
    return int(m.group(1)) if m else None
