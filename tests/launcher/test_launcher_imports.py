"""The launcher runs on every instance for the whole job, beside a trainer or a data server it
starts as a child process: it never imports torch, timm or torchvision (4 s of a core and
hundreds of MB each time an instance starts, for a process that only watches). Checked in a fresh
interpreter, through the modules an instance's launcher loads: the CLI's `launch` parser, the
EC2 start and job loop, its watches (the data server's health check included), the local run."""

from __future__ import annotations

import pytest
from fresh_imports import loaded_modules

HEAVY = ("torch", "timm", "torchvision")

LAUNCHER_MODULES = (
    "training.launcher.launch",
    "training.launcher.ec2_start",
    "training.launcher.ec2_job",
    "training.launcher.ec2_watches",
    "training.launcher.server_watch",
    "training.launcher.hang_watch",
    "training.local.run",
)


def loaded_heavy(*code: str) -> list[str]:
    """The heavy top-level packages a fresh interpreter holds after running ``code``."""
    return sorted({m.split(".")[0] for m in loaded_modules(*code)} & set(HEAVY))


@pytest.mark.parametrize("module", LAUNCHER_MODULES)
def test_a_launcher_module_loads_without_torch(module: str) -> None:
    assert loaded_heavy(f"import {module}") == [], f"{module} pulls in torch, timm or torchvision"


def test_the_launch_command_parses_without_torch() -> None:
    code = (
        "from training.cli import build_parser",
        "build_parser('launch').parse_args(['launch', '--spec', 'specs/rehearsal.toml'])",
    )
    assert loaded_heavy(*code) == []


def test_the_probe_sees_torch_when_it_is_loaded() -> None:
    """The check can fail: the data server's module does load them."""
    assert loaded_heavy("import training.dataplane.server") == sorted(HEAVY)
