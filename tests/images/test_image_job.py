"""A job on real images (scikit-learn's digits, prepared into shards by `hetero dataset prep`) run
by the built images in real containers on the host network: two data-server containers feed a
trainer container (`python -m training.trainer`, CPU). The trainer is stopped midway by a plain
`docker stop` (the launch template's --stop-timeout, no timeout of its own): it saves a complete
checkpoint and exits with the stopped exit code, well inside the timeout. Started again, it
resumes from that checkpoint and finishes; its reported top-1 is what plain timm, with code that
shares nothing with the trainer (tests/realdata.py), gives the exported model."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
from realdata import exported_top1
from shards_support import prep_digits

from training.common.outcome import CONTAINER_STOP_TIMEOUT_S, EXIT_FINISHED, EXIT_STOPPED
from training.common.steps import MARKER

from .conftest import DATA_SERVER_IMAGE, TRAINER_IMAGE, Containers

pytestmark = pytest.mark.image
REPO = Path(__file__).resolve().parents[2]
STEPS = 200
STOP_AFTER = "step 60/"
PORTS = (50391, 50392)


def job_spec(tmp_path: Path, shards: Path) -> Path:
    """specs/digits.toml on the prepared shards, checkpoints every 20 steps into tmp_path."""
    text = (REPO / "specs" / "digits.toml").read_text()
    text = text.replace("\nsteps = 400\n", f"\nsteps = {STEPS}\n")
    text = text.replace("\nlog_every_steps = 50\n", "\nlog_every_steps = 20\n")
    text = text.replace(
        'source = "folder"\npath = "runs/digits/train"\nval_path = "runs/digits/val"\n',
        f'source = "shards"\npath = "{shards}"\n',
    )
    text = text.replace("\ninterval_steps = 200\n", "\ninterval_steps = 20\n")
    text = text.replace('dir = "runs/digits/checkpoints"', f'dir = "{tmp_path / "checkpoints"}"')
    path = tmp_path / "digits.toml"
    path.write_text(text)
    doc = tomllib.loads(text)  # every edit landed
    assert doc["job"]["steps"] == STEPS and doc["job"]["dataset"]["path"] == str(shards)
    assert doc["job"]["checkpoint"]["interval_steps"] == 20
    return path


def trainer_args(spec: Path, run_dir: Path) -> list[str]:
    servers = ",".join(f"127.0.0.1:{port}" for port in PORTS)
    return ["-m", "training.trainer", "--spec", str(spec), "--run-dir", str(run_dir),
            "--data-servers", servers]  # fmt: skip


@pytest.mark.timeout(900)
def test_data_server_containers_feed_a_trainer_container_that_stops_resumes_and_learns(
    containers: Containers, tmp_path: Path
) -> None:
    folders, shards = prep_digits(tmp_path)
    spec = job_spec(tmp_path, shards)
    run_dir = tmp_path / "run"
    servers = []
    for i, port in enumerate(PORTS):
        serve = ["serve", "--spec", str(spec), "--host", "127.0.0.1", "--port", str(port)]
        servers.append(containers.start(f"data-{i}", DATA_SERVER_IMAGE, serve, mounts=[tmp_path]))
    # As the launch template runs it: host network and IPC, its stop timeout.
    trainer_flags = ["--stop-timeout", str(CONTAINER_STOP_TIMEOUT_S), "--entrypoint", "python"]
    first = containers.start(
        "trainer-1", TRAINER_IMAGE, trainer_args(spec, run_dir),
        flags=trainer_flags, mounts=[tmp_path],
    )  # fmt: skip
    containers.wait_for_log(first, STOP_AFTER, timeout_s=300)
    took = containers.stop(first)
    code = containers.wait(first, timeout_s=30)
    log = containers.logs(first)
    assert code == EXIT_STOPPED, log[-4000:]
    assert took < CONTAINER_STOP_TIMEOUT_S / 2, took  # well inside: nothing was SIGKILLed
    assert containers.state(first)["OOMKilled"] is False
    saved = [int(s) for s in re.findall(r"checkpoint step (\d+) saved to", log)]
    assert saved, log[-4000:]
    last = max(saved)
    assert last >= 60
    assert (tmp_path / "checkpoints" / f"step-{last}" / MARKER).is_file()
    # The data servers keep serving: a stopped trainer does not end the job.
    assert all(containers.state(s)["Status"] == "running" for s in servers)

    second = containers.start(
        "trainer-2", TRAINER_IMAGE, trainer_args(spec, run_dir),
        flags=trainer_flags, mounts=[tmp_path],
    )  # fmt: skip
    assert containers.wait(second, timeout_s=600) == EXIT_FINISHED, containers.logs(second)[-4000:]
    resumed = containers.logs(second)
    assert f"(step {last})" in resumed, resumed[-4000:]
    # The finished trainer told both data servers to shut down; they exit 0.
    for server in servers:
        assert containers.wait(server, timeout_s=60) == 0, containers.logs(server)[-3000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    final = summary["accuracy"]["final"]
    assert final["step"] == STEPS and final["top1"] > 0.5, summary["accuracy"]  # chance: 0.1
    model_dir = Path(summary["model"])
    top1, config = exported_top1(model_dir, folders.val_dir)
    assert config["label_names"] == [str(i) for i in range(10)]
    assert round(top1 * folders.val_count) == round(final["top1"] * folders.val_count)
