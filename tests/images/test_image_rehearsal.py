"""`hetero rehearse --image`: every emulated instance's launcher in the built image of its role,
started by the user data's own `docker run` line (training.common.launch_line, with only the
host-only parts stood in), against the rehearsal's IMDS emulators and moto. Without a fault and
with a Spot interruption of a trainer, the job finishes with every sample applied exactly once
and final weights bit-equal to the process rehearsal's (the checkout's venv on this machine):
the images train exactly as the tests do. The containers' AWS calls are recorded and checked
against tests/aws_calls.json like every rehearsal's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from rehearsal.cli_run import (
    TIMEOUT_S,
    assert_clean_end,
    assert_exactly_once_and_equal,
    context,
    rehearse,
)

from training.rehearsal.containers import ROLE_TAGS, STAND_INS

from .conftest import DATA_SERVER_IMAGE, TRAINER_IMAGE

pytestmark = pytest.mark.image


def in_containers(out: Path, report: dict[str, object]) -> None:
    """The report says every launcher ran in its role's image, and each instance's folder holds
    the deployed spec the line mounted (the process rehearsal writes none)."""
    assert report["containers"] == {
        "images": {"trainer": TRAINER_IMAGE, "dataprep": DATA_SERVER_IMAGE},
        "stand_ins": dict(STAND_INS),
    }
    assert set(ROLE_TAGS) == {"trainer", "dataprep"}
    folders = sorted((out / "instances").iterdir())
    assert folders and all((f / "deployed" / "cluster.toml").is_file() for f in folders)


@pytest.mark.timeout(3 * TIMEOUT_S + 300)
def test_image_rehearsals_match_the_process_rehearsal_bit_for_bit(
    docker: str, tmp_path: Path
) -> None:
    process = tmp_path / "process"
    proc, base = rehearse(process, "--no-baseline")
    assert proc.returncode == 0 and base["failed_invariants"] == [], context(proc)
    assert "containers" not in base

    plain = tmp_path / "image"
    proc, report = rehearse(plain, "--image", "--baseline", str(process))
    assert_clean_end(proc, report)
    assert proc.returncode == 0, context(proc)
    assert_exactly_once_and_equal(report)
    assert report["replacements"] == []
    in_containers(plain, report)

    step = random.randint(3, 9)  # early: the replacement joins (tests/rehearsal)
    spot = tmp_path / "spot"
    proc, report = rehearse(
        spot, "--image", "--baseline", str(process), "--interrupt", f"trainer:1@{step}"
    )
    why = f"notice at step {step}\n{context(proc)}"
    assert_clean_end(proc, report)
    assert proc.returncode == 0, why
    assert_exactly_once_and_equal(report)
    assert report["steps_lost"] == 0, why
    notices = [i for i in report["interruptions"] if i["fault"].startswith("interrupt")]
    assert [n["state"] for n in notices] == ["done"], why
    assert [r["group"] for r in report["replacements"]] == ["trainer"], report["replacements"]
    in_containers(spot, report)
