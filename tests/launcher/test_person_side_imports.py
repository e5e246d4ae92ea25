"""The person's commands (run on their machine, with their credentials) never load the instance's
loop: `hetero job start`, `hetero status`, the SageMaker submission and its budget load no
`training.launcher` module; what they share with the instances is `training.costs` (the budget,
the bill, the prices, the backstop). The local run (`hetero local`, no AWS account) likewise
loads none: it shares `training.processes` with the instances. Checked in a fresh interpreter,
so an import anywhere in the chain counts."""

from __future__ import annotations

from pathlib import Path

import pytest
from fresh_imports import loaded_modules

PERSON_SIDE = {
    "training.workstation.jobstart": {"costs.backstop", "costs.budget"},
    "training.workstation.status": {"costs.bill", "costs.budget", "costs.deploy_prices"},
    "training.workstation.sagemaker_submit": set(),
    "training.workstation.sagemaker_budget": set(),
}
"""Each command's module and the shared modules it loads (``training.`` left out)."""
LOCAL_RUN = {
    "training.local.run": {"processes.roles", "processes.supervised", "processes.supervisor"},
    "training.local.tier": {"processes.supervisor"},
}
"""The local run's modules and the shared modules they load."""
SHARED = ("training.costs.", "training.processes.")
WORKSTATION = Path(__file__).resolve().parents[2] / "training" / "workstation"


def loaded(module: str, prefixes: tuple[str, ...]) -> set[str]:
    """The modules under ``prefixes`` a fresh interpreter holds after importing ``module``
    (``training.`` left out)."""
    found = loaded_modules(f"import {module}")
    return {m.removeprefix("training.") for m in found if m.startswith(prefixes)}


def launcher_modules(module: str) -> set[str]:
    """The ``training.launcher`` modules (the instance's side) loaded with ``module``."""
    return {m.removeprefix("launcher.") for m in loaded(module, ("training.launcher",))}


def test_every_module_of_the_person_side_is_checked() -> None:
    found = {f"training.workstation.{p.stem}" for p in WORKSTATION.glob("*.py")}
    assert found - {"training.workstation.__init__"} == set(PERSON_SIDE)


@pytest.mark.parametrize("module", sorted(PERSON_SIDE))
def test_a_command_of_the_person_loads_no_part_of_the_instance_loop(module: str) -> None:
    found = loaded(module, ("training.launcher", *SHARED))
    assert found == PERSON_SIDE[module], found


@pytest.mark.parametrize("module", sorted(LOCAL_RUN))
def test_the_local_run_loads_no_part_of_the_instance_loop(module: str) -> None:
    found = loaded(module, ("training.launcher", *SHARED))
    assert found == LOCAL_RUN[module], found


def test_the_probe_sees_the_instance_loop_when_it_is_loaded() -> None:
    """The check can fail: the EC2 start loads the job loop and its watches."""
    assert {"ec2_job", "ec2_watches", "plan"} <= launcher_modules("training.launcher.ec2_start")
