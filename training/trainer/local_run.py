"""Run the trainer in N local processes without torchrun, for tests and benchmarks.

Each process would otherwise spend seconds importing torch and timm; here a forkserver imports
them once and forks the ranks from it. The ranks get torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT on 127.0.0.1) and run ``training.trainer``'s
``main``, so the code path is the one torchrun runs. ``ranks_per_host`` makes the ranks look like
several hosts (each with its own LOCAL_RANK 0), and ``rank_args`` gives each rank flags of its
own (e.g. its host's own checkpoint folder).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from multiprocessing.process import BaseProcess

from training.trainer.__main__ import main

FORKSERVER_PRELOAD = ["torch", "timm", "training.trainer.train"]
"""Imported once by the forkserver that forks the ranks."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the rendezvous binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def as_torchrun_starts_it() -> None:
    """Give this rank the multiprocessing start method of a fresh interpreter, as a rank that
    torchrun starts has. A process forked by a forkserver inherits "forkserver": its DataLoader
    workers would each start from a new forkserver and import torch again (seconds per loader,
    every epoch and every evaluation pass; the local-input recipe test took 72 s, not 12 s)."""
    mp.set_start_method(None, force=True)


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    argv: list[str],
    env: dict[str, str],
    ranks_per_host: int,
) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % ranks_per_host),
        LOCAL_WORLD_SIZE=str(ranks_per_host),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    as_torchrun_starts_it()
    import torch

    # As torchrun does for several ranks on one host: one thread each, no oversubscription.
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.exit(main(argv))


class LocalJob:
    """``world_size`` trainer ranks running ``python -m training.trainer <argv>``."""

    def __init__(
        self,
        argv: Sequence[str],
        world_size: int,
        *,
        env: Mapping[str, str] | None = None,
        ranks_per_host: int | None = None,
        rank_args: Sequence[Sequence[str]] | None = None,
    ) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        port = free_port()
        per_host = ranks_per_host or world_size
        extra = [list(a) for a in rank_args] if rank_args is not None else [[]] * world_size
        if len(extra) != world_size:
            raise ValueError(f"rank_args has {len(extra)} entries for {world_size} ranks")
        self.processes: list[BaseProcess] = [
            ctx.Process(
                target=_rank_main,
                args=(rank, world_size, port, [*argv, *extra[rank]], dict(env or {}), per_host),
                name=f"trainer-rank-{rank}",
            )
            for rank in range(world_size)
        ]
        for p in self.processes:
            p.start()

    def wait(self, timeout: float) -> list[int | None]:
        """Exit codes per rank once all exit; ranks still running after ``timeout`` seconds
        are killed and reported as None."""
        deadline = time.monotonic() + timeout
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        codes = [p.exitcode for p in self.processes]
        for p in self.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
        return codes

    def signal(self, signum: int, ranks: Sequence[int] | None = None) -> None:
        """Send ``signum`` to every live rank (as the launcher forwards a Spot notice), or to
        ``ranks`` only."""
        for rank, p in enumerate(self.processes):
            if (ranks is None or rank in ranks) and p.pid is not None and p.is_alive():
                os.kill(p.pid, signum)


def run_local(
    argv: Sequence[str],
    world_size: int,
    *,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
    ranks_per_host: int | None = None,
    rank_args: Sequence[Sequence[str]] | None = None,
) -> list[int | None]:
    """Run the trainer on ``world_size`` local ranks to completion; exit codes per rank."""
    job = LocalJob(argv, world_size, env=env, ranks_per_host=ranks_per_host, rank_args=rank_args)
    return job.wait(timeout)
