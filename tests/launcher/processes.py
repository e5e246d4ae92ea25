"""Run a command as a real process while recording every descendant it ever had."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil


@dataclass
class Watched:
    """A finished process: its exit code, its output, and every descendant seen while it ran."""

    returncode: int
    output: str
    descendants: dict[int, psutil.Process] = field(default_factory=dict)

    def survivors(self) -> list[str]:
        """Descendants still alive (zombies count as gone: they hold no resources but a pid)."""
        alive = []
        for proc in self.descendants.values():
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
            except psutil.Error:
                pass
        return alive


def run_watched(
    cmd: Sequence[str],
    *,
    cwd: Path,
    timeout_s: float,
    env: dict[str, str] | None = None,
    act: Callable[[subprocess.Popen[str], str], bool] | None = None,
) -> Watched:
    """Run ``cmd``, polling its process tree every 50 ms. ``act(proc, output_so_far)`` is called
    on each poll until it returns True (e.g. to send a signal once training has started)."""
    proc = subprocess.Popen(
        list(cmd),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(proc.stdout.readline, "")))  # type: ignore[union-attr]
    reader.start()
    seen: dict[int, psutil.Process] = {}
    acted = act is None
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{cmd} still running after {timeout_s}s:\n{''.join(chunks)}")
            try:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    seen.setdefault(child.pid, child)
            except psutil.Error:
                pass
            if not acted and act is not None:
                acted = act(proc, "".join(chunks))
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        reader.join(timeout=10)
    return Watched(proc.returncode, "".join(chunks), seen)
