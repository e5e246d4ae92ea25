"""The person's commands (run on their machine, with their credentials) never load the instance's
loop: `hetero job start`, `hetero status`, the SageMaker submission and its budget reach only the
launcher modules they share with the instances (the budget, the bill, the prices, the backstop).
Checked in a fresh interpreter, so an import anywhere in the chain counts."""

from __future__ import annotations

import pytest
from fresh_imports import loaded_modules

PERSON_SIDE = {
    "training.launcher.jobstart": {"backstop", "budget", "jobstart"},
    "training.launcher.status": {"bill", "budget", "deploy_prices", "status"},
    "training.sagemaker_submit": set(),
    "training.sagemaker_budget": set(),
}
"""Each command's module and the launcher modules it may load (by their last name)."""


def launcher_modules(module: str) -> set[str]:
    """The ``training.launcher`` modules a fresh interpreter holds after importing ``module``."""
    prefix = "training.launcher."
    return {m[len(prefix) :] for m in loaded_modules(f"import {module}") if m.startswith(prefix)}


@pytest.mark.parametrize("module", sorted(PERSON_SIDE))
def test_a_command_of_the_person_loads_no_part_of_the_instance_loop(module: str) -> None:
    assert launcher_modules(module) == PERSON_SIDE[module]


def test_the_probe_sees_the_instance_loop_when_it_is_loaded() -> None:
    """The check can fail: the EC2 start loads the job loop and its watches."""
    assert {"ec2_job", "ec2_watches", "plan"} <= launcher_modules("training.launcher.ec2_start")
