"""ByteBudget: blocking, wake-up on release, oversize requests when idle, timeouts, order; and the
default budget derived from the host's memory."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from training.dataplane import budget as budget_module
from training.dataplane.budget import (
    MB,
    MIN_DEFAULT_BYTES,
    ByteBudget,
    default_memory_budget_bytes,
    host_memory_bytes,
)


class Acquirer:
    """``budget.acquire(nbytes, timeout)`` in a thread of its own; ``result`` once it returned."""

    def __init__(self, budget: ByteBudget, nbytes: int, timeout: float | None = 10.0) -> None:
        self.result: bool | None = None
        self.done = threading.Event()

        def run() -> None:
            self.result = budget.acquire(nbytes, timeout=timeout)
            self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


def test_acquire_within_the_limit_does_not_wait() -> None:
    budget = ByteBudget(100)
    assert budget.acquire(60, timeout=0) and budget.acquire(40, timeout=0)
    assert budget.used == 100
    budget.release(100)
    assert budget.used == 0


def test_acquire_blocks_until_a_release_makes_room() -> None:
    budget = ByteBudget(100)
    assert budget.acquire(80, timeout=0)
    waiter = Acquirer(budget, 30)
    assert not waiter.done.wait(0.3), "acquired more than the limit"
    budget.release(50)  # 30 in use: 30 + 30 fits
    assert waiter.done.wait(5), "a release did not wake the waiter"
    waiter.join()
    assert waiter.result is True and budget.used == 60


def test_request_bigger_than_the_budget_is_admitted_only_when_idle() -> None:
    budget = ByteBudget(100)
    assert budget.acquire(10, timeout=0)
    assert budget.acquire(500, timeout=0.1) is False  # something is in use: it waits
    waiter = Acquirer(budget, 500)
    assert not waiter.done.wait(0.2)
    budget.release(10)  # idle now: the oversize request goes through, alone
    assert waiter.done.wait(5)
    waiter.join()
    assert waiter.result is True and budget.used == 500
    assert budget.acquire(1, timeout=0.05) is False
    budget.release(500)


def test_timeout_returns_false_and_takes_nothing() -> None:
    budget = ByteBudget(100)
    assert budget.acquire(100, timeout=0)
    start = time.monotonic()
    assert budget.acquire(1, timeout=0.2) is False
    assert 0.15 <= time.monotonic() - start < 5
    assert budget.acquire(1, timeout=0) is False
    assert budget.used == 100


def test_waiters_are_served_in_order_and_not_overtaken() -> None:
    budget = ByteBudget(100)
    assert budget.acquire(100, timeout=0)
    first = Acquirer(budget, 60)
    time.sleep(0.1)
    second = Acquirer(budget, 30)
    time.sleep(0.1)
    budget.release(40)  # 60 in use: the second (30) would fit, but the first (60) is ahead
    assert not first.done.wait(0.2) and not second.done.is_set()
    # A request that does not wait may not overtake the waiters either.
    assert budget.acquire(10, timeout=0) is False
    budget.release(60)
    assert first.done.wait(5) and second.done.wait(5)
    first.join()
    second.join()
    assert budget.used == 90


def test_a_waiter_that_times_out_lets_the_next_one_go() -> None:
    budget = ByteBudget(100)
    assert budget.acquire(50, timeout=0)
    big = Acquirer(budget, 80, timeout=0.3)  # cannot fit while 50 are in use
    time.sleep(0.1)
    small = Acquirer(budget, 40)  # fits, but queued behind ``big``
    assert big.done.wait(5) and big.result is False
    assert small.done.wait(5)
    big.join()
    small.join()
    assert small.result is True and budget.used == 90


def test_bad_amounts_are_refused() -> None:
    with pytest.raises(ValueError, match="positive limit"):
        ByteBudget(0)
    budget = ByteBudget(10)
    with pytest.raises(ValueError, match="negative"):
        budget.acquire(-1)
    assert budget.acquire(5, timeout=0)
    with pytest.raises(ValueError, match="cannot release 6 bytes: 5 in use"):
        budget.release(6)


def test_default_budget_is_a_share_of_the_memory_with_a_floor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit_file = tmp_path / "memory.max"
    monkeypatch.setattr(budget_module, "_CGROUP_LIMIT_FILES", (limit_file,))
    limit_file.write_text("max\n")  # cgroup v2 without a limit: the host's memory counts
    host = host_memory_bytes()
    assert host > 0
    assert default_memory_budget_bytes() == max(MIN_DEFAULT_BYTES, host // 4)
    limit_file.write_text(f"{8 * 1024 * MB}\n")  # a container limited to 8 GiB
    assert host_memory_bytes() == min(host, 8 * 1024 * MB)
    limit_file.write_text(f"{512 * MB}\n")  # a small container: the floor
    assert default_memory_budget_bytes() == MIN_DEFAULT_BYTES
