"""Spot made safe, in real gloo processes: a checkpoint request on one rank saves the same step on
every rank and training goes on; a lost peer fails the survivor within the collective timeout
(never NCCL's half hour); hosts without a shared checkpoint folder and without S3 stop at start;
ranks never count a step another rank could not finish, and never resume different steps."""

from __future__ import annotations

import json
import multiprocessing
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as torch_mp
from torch import nn

from training.common.outcome import EXIT_CONFIG, EXIT_FAILED, Outcome, read_rank_outcomes
from training.common.steps import MARKER
from training.data.order import epoch_order
from training.spec import load_spec
from training.trainer.checkpoint import Checkpointer, CheckpointStorageError, step_dirs
from training.trainer.local_run import FORKSERVER_PRELOAD, LocalJob, free_port, run_local
from training.trainer.sample_log import read_sample_log
from training.trainer.stream import rank_positions

from .conftest import write_spec

ENV = {"OMP_NUM_THREADS": "1"}
BATCH = 4


def wait_for_metrics(job: LocalJob, run_dir: Path, lines: int, timeout: float = 120) -> None:
    """Return once rank 0 has logged ``lines`` steps (every rank still running)."""
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert all(p.is_alive() for p in job.processes), "a rank exited early"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= lines:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {lines} metric lines within {timeout}s")


def planned_ids(seed: int, rank: int, world: int, step: int, num_samples: int = 512) -> list[int]:
    """The sample ids rank ``rank`` trains on at ``step`` (1-based): its positions ``rank,
    rank+world, ...`` of each epoch's permutation, a batch at a time."""
    per_epoch, positions = rank_positions(num_samples, rank, world, BATCH)
    epoch, batch = divmod(step - 1, per_epoch)
    order = epoch_order(seed, epoch, num_samples)
    mine = [int(order[p]) for p in positions]
    return mine[batch * BATCH : (batch + 1) * BATCH]


@pytest.mark.timeout(300)
def test_sigusr1_on_one_rank_saves_the_same_step_everywhere_and_training_goes_on(
    tmp_path: Path,
) -> None:
    steps = 150
    spec = write_spec(tmp_path, steps=steps, interval=100_000, batch_size=BATCH)
    run_dir, outcomes, samples = tmp_path / "run", tmp_path / "outcome", tmp_path / "samples"
    argv = ["--spec", str(spec), "--run-dir", str(run_dir), "--synthetic-data"]
    argv += ["--outcome-dir", str(outcomes)]
    # Two "hosts" (each rank its host's local rank 0) sharing one checkpoint folder.
    env = {**ENV, "HETERO_SAMPLE_LOG_DIR": str(samples)}
    job = LocalJob(argv, 2, env=env, ranks_per_host=1)
    try:
        wait_for_metrics(job, run_dir, lines=3)
        job.signal(signal.SIGUSR1, ranks=[1])  # a rebalance recommendation on rank 1 only
    finally:
        codes = job.wait(240)
    assert codes == [0, 0]
    ckpts = tmp_path / "checkpoints"
    requested = step_dirs(ckpts)[0][0]
    assert 3 <= requested < steps  # not an interval step (interval 100000), not the last
    assert [s for s, _ in step_dirs(ckpts)] == [requested, steps]
    assert all((p / MARKER).is_file() for _, p in step_dirs(ckpts))
    # Both ranks saved that step: each wrote its shard into it, and each rank's data position
    # in it is the one after that step.
    assert {"__0_0.distcp", "__1_0.distcp"} <= {
        p.name for p in (ckpts / f"step-{requested}").iterdir()
    }
    train = {"step": 0, "world_size": 0, "data": ""}
    dcp.load({"train": train}, checkpoint_id=str(ckpts / f"step-{requested}"))
    epoch, batch = divmod(requested, 64)  # 64 batches per rank and epoch
    assert train["step"] == requested and train["world_size"] == 2
    assert json.loads(str(train["data"])) == [{"epoch": epoch, "batch": batch}] * 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["stopped_by"] == "steps"
    assert [(r["step"], r["reason"], r["saved"]) for r in summary["checkpoint"]["saves"]] == [
        (requested, "requested", True),
        (steps, "final", True),
    ]
    ends = read_rank_outcomes(outcomes)
    assert [(o.rank, o.outcome, o.step, o.checkpoint_step, o.reason) for o in ends] == [
        (r, Outcome.FINISHED, steps, steps, "steps") for r in (0, 1)
    ]
    # The sample log: every applied step of every rank, the planned ids in the planned order.
    seed = load_spec(spec).job.seed
    for rank in (0, 1):
        lines = read_sample_log(samples / f"rank-{rank}.jsonl")
        assert [line["step"] for line in lines] == list(range(1, steps + 1))
        assert {(line["rank"], line["world_size"]) for line in lines} == {(rank, 2)}
        assert [line["sample_ids"] for line in lines] == [
            planned_ids(seed, rank, 2, s) for s in range(1, steps + 1)
        ]
        assert lines[-1]["epoch"] == (steps - 1) // 64  # 64 batches per rank and epoch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loss", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_lost_peer_fails_the_survivor_within_the_collective_timeout(
    tmp_path: Path, loss: signal.Signals
) -> None:
    timeout_s = 5
    spec = write_spec(tmp_path, steps=100_000, interval=100_000, batch_size=BATCH)
    run_dir, outcomes = tmp_path / "run", tmp_path / "outcome"
    argv = ["--spec", str(spec), "--run-dir", str(run_dir), "--synthetic-data"]
    argv += ["--outcome-dir", str(outcomes)]
    env = {**ENV, "HETERO_COLLECTIVE_TIMEOUT_S": str(timeout_s)}
    job = LocalJob(argv, 2, env=env)
    survivor = job.processes[0]
    try:
        wait_for_metrics(job, run_dir, lines=3)
        job.signal(loss, ranks=[1])
        t0 = time.monotonic()
        survivor.join(timeout_s + 30)
        took = time.monotonic() - t0
    finally:
        job.signal(signal.SIGKILL, ranks=[1])
        job.wait(30)
    assert survivor.exitcode == EXIT_FAILED
    assert took < timeout_s + 15, took
    [end] = read_rank_outcomes(outcomes)  # the lost rank wrote none
    assert end.rank == 0 and end.outcome is Outcome.FAILED and end.step >= 3
    assert end.checkpoint_step is None


@pytest.mark.timeout(120)
def test_hosts_without_a_shared_folder_or_s3_stop_at_start_naming_the_s3_flag(
    tmp_path: Path,
) -> None:
    spec = write_spec(tmp_path, steps=4)
    outcomes = tmp_path / "outcome"
    argv = ["--spec", str(spec), "--run-dir", str(tmp_path / "run"), "--synthetic-data"]
    argv += ["--outcome-dir", str(outcomes)]
    own_folders = [["--checkpoint-dir", str(tmp_path / f"host{r}")] for r in (0, 1)]
    codes = run_local(
        argv, 2, env=ENV, ranks_per_host=1, rank_args=own_folders, timeout=120
    )  # fmt: skip
    assert codes == [EXIT_CONFIG, EXIT_CONFIG]
    ends = read_rank_outcomes(outcomes)
    assert [(o.rank, o.outcome) for o in ends] == [(0, Outcome.FAILED), (1, Outcome.FAILED)]
    for end in ends:
        assert "not shared between the 2 trainer hosts" in end.reason
        assert "rank 1 on" in end.reason and "--checkpoint-s3-uri" in end.reason
    assert not list((tmp_path / "host0").glob("step-*"))  # nothing trained, nothing saved


# --- the Checkpointer's agreements, two gloo processes ----------------------------------------


def _tiny() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _agreements(rank: int, port: int, tmp: Path) -> None:
    """Rank ``rank`` of 2, each its own "host" (local rank 0); writes what it saw."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    seen: dict[str, object] = {}
    model, opt = _tiny()
    # 1. A shared folder where rank 0 cannot complete step 2 (a file is in the way).
    shared = Checkpointer(tmp / "shared", keep=3, rank=rank, world_size=2, local_rank=0)
    try:
        shared.save(2, model, opt, {"rank": rank})
        seen["save"] = "saved"
    except CheckpointStorageError as e:
        seen["save"] = str(e)
    # 2. Each host its own folder: rank 0 has step 4, rank 1 only step 2.
    own = Checkpointer(tmp / f"own{rank}", keep=3, rank=rank, world_size=2, local_rank=0)
    try:
        own.restore_latest(model, opt)
        seen["restore"] = "restored"
    except CheckpointStorageError as e:
        seen["restore"] = str(e)
    (tmp / f"seen-{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_ranks_agree_after_the_marker_and_on_the_step_they_resume(tmp_path: Path) -> None:
    model, opt = _tiny()
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "step-2").write_text("not a folder")
    for rank, step in ((0, 4), (1, 2)):
        Checkpointer(tmp_path / f"own{rank}", keep=3, rank=0, world_size=1).save(
            step, model, opt, {}
        )
    # The forkserver the trainer tests use (torch imported once, ranks forked from it).
    multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    torch_mp.start_processes(
        _agreements, args=(free_port(), tmp_path), nprocs=2, start_method="forkserver"
    )
    seen = [json.loads((tmp_path / f"seen-{r}.json").read_text()) for r in (0, 1)]
    # Rank 0 could not complete step 2: neither rank counts it as saved, none has a marker.
    for s in seen:
        assert s["save"].startswith("completing checkpoint step 2 failed on rank 0:"), s
    assert not (tmp_path / "shared" / "step-2.partial").exists()
    assert not list((tmp_path / "shared").glob(f"*/{MARKER}"))
    # Rank 0 chose step 4; rank 1's host lacks it: both stop, naming the step and the host.
    for s in seen:
        assert s["restore"].startswith("loading checkpoint step 4 failed: rank 1 on"), s
        assert "step-4 is missing" in s["restore"]
        assert "rank 0 on" not in s["restore"]


def test_sample_log_skips_blank_ids(tmp_path: Path) -> None:
    from training.trainer.sample_log import SampleLog

    log = SampleLog(tmp_path, rank=3, world_size=4)
    log.append(7, 1, [torch.tensor([5, -1, 9]), torch.tensor([-1]), torch.tensor([2])])
    log.close()
    [line] = read_sample_log(tmp_path / "rank-3.jsonl")
    assert line["sample_ids"] == [5, 9, 2]
    assert (line["step"], line["rank"], line["world_size"], line["epoch"]) == (7, 3, 4, 1)
