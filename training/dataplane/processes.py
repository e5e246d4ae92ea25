"""Data servers as child processes (``hetero serve``): for the demo, tests and local runs."""

from __future__ import annotations

import logging
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_LISTENING = "data server listening on "


@dataclass
class ServerProcess:
    """A ``hetero serve`` child process and the address it listens on."""

    process: subprocess.Popen[str]
    address: str

    def stop(self, timeout_s: float = 10.0) -> int:
        """Wait for the process to exit (after a Shutdown RPC); SIGTERM, then SIGKILL, if it does
        not within ``timeout_s``. Returns its exit code."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("data server %s did not exit; terminating it", self.address)
            self.process.terminate()
            try:
                return self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                return self.process.wait()


def start_server_process(
    spec_path: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    workers: int | None = None,
    memory_mb: int | None = None,
    timeout_s: float = 120.0,
    log_level: str = "WARNING",
    env: Mapping[str, str] | None = None,
    outcome_dir: Path | None = None,
) -> ServerProcess:
    """Start ``hetero serve`` for ``spec_path`` and wait until it prints the port it listens on.
    ``workers`` and ``memory_mb`` (None: the spec's) are passed as ``--workers``/``--memory-mb``;
    ``env`` is added to this process's environment for it; ``outcome_dir`` is its
    ``--outcome-dir``. Raises ``RuntimeError`` with the child's output if it exits or stays
    silent."""
    cmd = [sys.executable, "-m", "training.cli", "--log-level", log_level, "serve"]
    cmd += ["--spec", str(spec_path), "--host", host, "--port", str(port)]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    if memory_mb is not None:
        cmd += ["--memory-mb", str(memory_mb)]
    if outcome_dir is not None:
        cmd += ["--outcome-dir", str(outcome_dir)]
    child_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=child_env)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                break
            line = proc.stdout.readline()
            if not line:  # EOF: the child exited
                break
            seen.append(line.rstrip())
            if line.startswith(_LISTENING):
                bound_port = int(line.rsplit(":", 1)[1])
                return ServerProcess(proc, f"{host}:{bound_port}")
    proc.kill()
    proc.wait()
    output = "\n".join(seen[-20:])
    raise RuntimeError(
        f"data server did not start (exit code {proc.returncode}): {' '.join(cmd)}\n{output}"
    )
