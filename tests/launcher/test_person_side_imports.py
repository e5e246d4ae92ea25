"""The person's commands (run on their machine, with their credentials) never load the instance's
loop: `hetero job start`, `hetero status`, the SageMaker submission and its budget reach only the
launcher modules they share with the instances (the budget, the bill, the prices, the backstop).
The local run (`hetero local`, no AWS account) likewise reaches only the process modules it
shares with the instances. Checked in a fresh interpreter, so an import anywhere in the chain
counts."""

from __future__ import annotations

from pathlib import Path

import pytest
from fresh_imports import loaded_modules

PERSON_SIDE = {
    "training.workstation.jobstart": {"backstop", "budget"},
    "training.workstation.status": {"bill", "budget", "deploy_prices"},
    "training.workstation.sagemaker_submit": set(),
    "training.workstation.sagemaker_budget": set(),
}
"""Each command's module and the launcher modules it may load (by their last name)."""
LOCAL_RUN = {
    "training.local.run": {"roles", "supervised", "supervisor"},
    "training.local.tier": {"supervisor"},
}
"""The local run's modules and the launcher modules they may load."""
WORKSTATION = Path(__file__).resolve().parents[2] / "training" / "workstation"


def launcher_modules(module: str) -> set[str]:
    """The ``training.launcher`` modules a fresh interpreter holds after importing ``module``."""
    prefix = "training.launcher."
    return {m[len(prefix) :] for m in loaded_modules(f"import {module}") if m.startswith(prefix)}


def test_every_module_of_the_person_side_is_checked() -> None:
    found = {f"training.workstation.{p.stem}" for p in WORKSTATION.glob("*.py")}
    assert found - {"training.workstation.__init__"} == set(PERSON_SIDE)


@pytest.mark.parametrize("module", sorted(PERSON_SIDE))
def test_a_command_of_the_person_loads_no_part_of_the_instance_loop(module: str) -> None:
    assert launcher_modules(module) == PERSON_SIDE[module]


@pytest.mark.parametrize("module", sorted(LOCAL_RUN))
def test_the_local_run_loads_no_part_of_the_instance_loop(module: str) -> None:
    assert launcher_modules(module) == LOCAL_RUN[module]


def test_the_probe_sees_the_instance_loop_when_it_is_loaded() -> None:
    """The check can fail: the EC2 start loads the job loop and its watches."""
    assert {"ec2_job", "ec2_watches", "plan"} <= launcher_modules("training.launcher.ec2_start")
