"""Suite-wide check: no test leaves a process behind.

At the start of the session a unique marker goes into this process's environment, so every
process the tests start (and every process those start) carries it. After each test, any process
that carries the marker, other than this pytest process and its own multiprocessing helpers, and
was not already running when the test began (a process of a module-scoped fixture), is a leak: it
gets a few seconds to exit, then it is killed and the test fails, naming it.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import aws_calls
import psutil
import pytest

from training.common import call_log

SESSION_ENV = "HETERO_TEST_SESSION"
# How long a leftover process gets to finish exiting before it is killed and reported.
EXIT_GRACE_S = 5.0
# This pytest process's own multiprocessing helpers: they live as long as it does, and die with it.
_OWN_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


def pytest_configure(config: pytest.Config) -> None:
    # Before any test starts a process: every child inherits the environment.
    os.environ[SESSION_ENV] = uuid.uuid4().hex


SLOW_FIRST = (
    "tests/rehearsal/test_rehearse_silent.py",
    "tests/rehearsal/test_rehearse_e2e.py",
    "tests/rehearsal/test_rehearse_budget.py",
    "tests/trainer/test_recipe.py",
    "tests/trainer/test_learns_real_images.py",
    "tests/infra/test_security_mutants.py",
    "tests/launcher/test_local_elastic.py",
    "tests/launcher/test_launcher_local_run.py",
    "tests/launcher/test_sagemaker_run.py",
    "tests/dataplane/test_shards_over_s3.py",
    "tests/trainer/test_checkpoint_s3.py",
    "tests/trainer/test_remote.py",
    "tests/trainer/test_distributed.py",
    "tests/test_benchmarks_planner.py",
    "tests/trainer/test_benchmarks.py",
)
"""Test files of a minute or more, the slowest first (measured with ``--durations``). `make test`
runs the suite on every core (pytest-xdist, work stealing): the longest start first, so the
others fill in around them instead of leaving one core alone with a long test at the end."""


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Every test that records AWS calls is marked, so `make aws-calls` can run them all.
    for item in items:
        if "record_aws_calls" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.aws_calls)

    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return SLOW_FIRST.index(path) if path in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: the order inside a file, and of the other files, stays


def _is_own_helper(proc: psutil.Process) -> bool:
    try:
        if proc.ppid() != os.getpid():
            return False
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return any(helper in cmdline for helper in _OWN_HELPERS)


def session_processes() -> set[psutil.Process]:
    """Running processes started by this test session: they carry the session's marker in their
    environment. Excludes this process and its own multiprocessing helpers."""
    marker = os.environ[SESSION_ENV]
    me = psutil.Process()
    found: set[psutil.Process] = set()
    for proc in psutil.process_iter(["create_time"]):
        # Cheap filter first: a process older than this session cannot carry its marker.
        if proc.pid == me.pid or (proc.info["create_time"] or 0) < me.create_time() - 1:
            continue
        try:
            if proc.environ().get(SESSION_ENV) != marker:
                continue
        except psutil.Error:  # gone, a zombie, or not ours to read
            continue
        if not _is_own_helper(proc):
            found.add(proc)
    return found


def _describe(proc: psutil.Process) -> str:
    try:
        cmdline = " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        cmdline = "?"
    if len(cmdline) > 200:
        cmdline = cmdline[:200] + "..."
    return f"pid {proc.pid}: {cmdline}"


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    """Fail the test (after killing them) if processes it started are still running after it."""
    already_running = session_processes()
    yield
    left = session_processes() - already_running
    if not left:
        return
    _, alive = psutil.wait_procs(left, timeout=EXIT_GRACE_S)
    if not alive:
        return
    described = [_describe(p) for p in alive]  # before the kill: a dead process has no cmdline
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=EXIT_GRACE_S)
    pytest.fail(
        f"the test left {len(alive)} process(es) running (killed now):\n" + "\n".join(described),
        pytrace=False,
    )


@pytest.fixture
def aws() -> Iterator[object]:
    """A fresh moto server (EC2, Auto Scaling, S3, SSM) on 127.0.0.1, set up as the rehearsal's
    ``AwsEmulator`` (training/rehearsal/aws.py): for the rehearsal's and the launcher's tests."""
    from training.rehearsal.aws import AwsEmulator

    emulator = AwsEmulator().start()
    try:
        yield emulator
    finally:
        emulator.stop()


@pytest.fixture
def record_aws_calls(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., Path]]:
    """``record_aws_calls(names, principal)`` switches the AWS call recorder on for this test's
    clients and processes (``training.common.call_log``); when the test ends, every call they
    made must be in ``tests/aws_calls.json`` (``tests/aws_calls.py``)."""
    started: list[tuple[Path, aws_calls.Names]] = []

    def start(names: aws_calls.Names, principal: str = "user") -> Path:
        folder = tmp_path_factory.mktemp("aws-calls")
        monkeypatch.setenv(call_log.ENV_CALL_LOG, str(folder))
        monkeypatch.setenv(call_log.ENV_PRINCIPAL, principal)
        started.append((folder, names))
        return folder

    yield start
    for folder, names in started:
        aws_calls.check(folder, names)
