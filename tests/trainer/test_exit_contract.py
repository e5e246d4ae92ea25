"""The trainer's exit contract (``training.common.outcome``), through its real entry point in this
process: finished exits 0, a graceful stop 75 with a durable checkpoint of its last step, a bad
configuration 2; each writes ``rank-0.json`` with the same outcome. (Failures, exit 1: a lost
peer in test_spot_safety.py, a last save that S3 refused in test_checkpoint_s3.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from training.common.outcome import (
    EXIT_CONFIG,
    EXIT_FINISHED,
    EXIT_STOPPED,
    Outcome,
    RankOutcome,
    read_rank_outcomes,
)
from training.common.steps import MARKER
from training.spec import load_spec
from training.trainer.__main__ import main
from training.trainer.checkpoint import step_dirs
from training.trainer.config import ConfigError, TrainerConfig

from .conftest import write_spec


def run_main(tmp: Path, *extra: str, steps: int = 3) -> tuple[int, RankOutcome]:
    spec = write_spec(tmp, steps=steps, interval=100, batch_size=4)
    code = main(
        ["--spec", str(spec), "--run-dir", str(tmp / "run"), "--synthetic-data",
         "--outcome-dir", str(tmp / "outcome"), *extra]
    )  # fmt: skip
    [outcome] = read_rank_outcomes(tmp / "outcome")
    return code, outcome


def test_a_finished_job_exits_0_with_its_last_step_saved(tmp_path: Path) -> None:
    code, outcome = run_main(tmp_path)
    assert code == EXIT_FINISHED
    assert (outcome.rank, outcome.outcome, outcome.step) == (0, Outcome.FINISHED, 3)
    assert (outcome.checkpoint_step, outcome.reason) == (3, "steps")
    assert [s for s, _ in step_dirs(tmp_path / "checkpoints")] == [3]
    # Run again: it resumes at its last step, has nothing to do, and is still finished.
    code, outcome = run_main(tmp_path)
    assert code == EXIT_FINISHED and outcome.checkpoint_step == 3 and outcome.step == 3


def test_max_seconds_stops_with_75_and_a_durable_checkpoint_of_the_last_step(
    tmp_path: Path,
) -> None:
    code, outcome = run_main(tmp_path, "--max-seconds", "0.5", steps=100_000)
    assert code == EXIT_STOPPED
    assert outcome.outcome is Outcome.STOPPED and outcome.reason == "max-seconds"
    assert outcome.step >= 1 and outcome.checkpoint_step == outcome.step
    assert (tmp_path / "checkpoints" / f"step-{outcome.step}" / MARKER).is_file()


def test_time_running_out_on_the_last_step_still_finishes(tmp_path: Path) -> None:
    """The budget's deadline passed before the last step: the run has done every planned step,
    so it is finished (exit 0), not stopped (a resumed job would have nothing left to do)."""
    code, outcome = run_main(tmp_path, "--max-seconds", "0.001", steps=2)
    assert code == EXIT_STOPPED and outcome.step == 1  # out of time before step 2
    code, outcome = run_main(tmp_path, "--max-seconds", "0.001", steps=2)
    assert code == EXIT_FINISHED  # step 2 is the last: it runs and the run finishes
    assert (outcome.outcome, outcome.step, outcome.checkpoint_step) == (Outcome.FINISHED, 2, 2)


def test_the_budget_deadline_is_wall_clock_so_start_up_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``HETERO_BUDGET_DEADLINE`` 1 s from now, read at start-up: the trainer's own start-up
    (the model, the data) eats into it, as on AWS, where seconds counted from the training
    loop's start would let a trainer that started within its budget run on past it (a capped
    rehearsal ran to its end so in CI)."""
    import time

    monkeypatch.setenv("HETERO_BUDGET_DEADLINE", str(time.time() + 1.0))
    real_train = __import__("training.trainer.train", fromlist=["Trainer"]).Trainer.train

    def slow_start(self: object) -> int:
        time.sleep(1.2)  # start-up beyond the deadline
        return real_train(self)  # type: ignore[arg-type]

    monkeypatch.setattr("training.trainer.train.Trainer.train", slow_start)
    code, outcome = run_main(tmp_path, steps=100_000)
    assert code == EXIT_STOPPED and outcome.reason == "max-seconds"
    assert outcome.step == 1 and outcome.checkpoint_step == 1  # stopped after its first step
    monkeypatch.setenv("HETERO_BUDGET_DEADLINE", "soon")
    (tmp_path / "bad").mkdir()
    code, outcome = run_main(tmp_path / "bad", steps=3)
    assert code == EXIT_CONFIG
    assert "HETERO_BUDGET_DEADLINE must be epoch seconds, got 'soon'" in outcome.reason


def test_a_bad_configuration_exits_2_with_a_failed_outcome(tmp_path: Path) -> None:
    code, outcome = run_main(tmp_path, "--steps", "0")
    assert code == EXIT_CONFIG
    assert outcome.outcome is Outcome.FAILED and "--steps must be at least 1" in outcome.reason
    assert outcome.checkpoint_step is None


def test_environment_settings_are_read_once_and_bad_ones_named(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, async_save=True))
    config = TrainerConfig.from_spec(
        spec, run_dir=tmp_path, synthetic=True,
        environ={"HETERO_COLLECTIVE_TIMEOUT_S": "7", "HETERO_CHECKPOINT_TIMEOUT_S": "90",
                 "HETERO_FINAL_SAVE_RETRY_S": "5", "HETERO_SAMPLE_LOG_DIR": str(tmp_path / "s")},
    )  # fmt: skip
    assert (config.timeouts.collective_s, config.timeouts.checkpoint_s) == (7.0, 90.0)
    assert config.checkpoint.final_save_retry_s == 5.0 and config.checkpoint.async_save
    assert config.sample_log_dir == tmp_path / "s"
    defaults = TrainerConfig.from_spec(spec, run_dir=tmp_path, synthetic=True, environ={})
    assert (defaults.timeouts.collective_s, defaults.timeouts.checkpoint_s) == (60.0, 600.0)
    assert defaults.checkpoint.final_save_retry_s == 60.0 and defaults.sample_log_dir is None
    with pytest.raises(ConfigError) as bad:
        TrainerConfig.from_spec(
            spec, run_dir=tmp_path, synthetic=True,
            environ={"HETERO_COLLECTIVE_TIMEOUT_S": "soon", "HETERO_CHECKPOINT_TIMEOUT_S": "-1"},
        )  # fmt: skip
    assert bad.value.problems == [
        "HETERO_COLLECTIVE_TIMEOUT_S must be a positive number of seconds, got 'soon'",
        "HETERO_CHECKPOINT_TIMEOUT_S must be a positive number of seconds, got '-1'",
    ]


def test_async_save_must_be_a_boolean_in_the_spec(tmp_path: Path) -> None:
    from training.spec import SpecError

    path = write_spec(tmp_path)
    path.write_text(path.read_text().replace("async_save = false", 'async_save = "yes"'))
    with pytest.raises(SpecError, match=r"job\.checkpoint\.async_save.*expected bool"):
        load_spec(path)
