"""``training.trainer.local_run``: ranks forked from a forkserver look, to multiprocessing, like
the fresh interpreters torchrun starts."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

from training.trainer import local_run


def _start_method(reset: bool) -> str:
    if reset:
        local_run.as_torchrun_starts_it()
    return multiprocessing.get_start_method()


def test_a_rank_gets_the_start_method_of_a_fresh_interpreter() -> None:
    fresh = subprocess.run(
        [sys.executable, "-c", "import multiprocessing; print(multiprocessing.get_start_method())"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    ctx = multiprocessing.get_context("forkserver")
    with ctx.Pool(1) as pool:
        inherited = pool.apply(_start_method, (False,))
        reset = pool.apply(_start_method, (True,))
    # Without the reset, a forkserver's child would start its DataLoader workers from a forkserver
    # of its own (on Linux before Python 3.14, a fresh interpreter forks them).
    assert inherited == "forkserver" != fresh or sys.version_info >= (3, 14)
    assert reset == fresh
