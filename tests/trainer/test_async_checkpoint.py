"""Background (async) checkpoints: the same bytes as a foreground save of the same step, in one
process and across two FSDP ranks that complete each save together; the stall per save is
recorded; the optimizer waits for the state to be copied out; a save that comes due while one
is in flight waits for it."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from training.common.steps import MARKER
from training.spec import load_spec
from training.trainer.checkpoint import PendingSave, step_dirs
from training.trainer.checkpoint_policy import CheckpointPolicy
from training.trainer.config import TrainerConfig
from training.trainer.local_run import run_local
from training.trainer.train import Trainer

from .conftest import load_params, train_to_end, write_spec

ENV = {"OMP_NUM_THREADS": "1"}


def run_in_process(tmp: Path, *, async_save: bool, steps: int) -> Trainer:
    tmp.mkdir(parents=True, exist_ok=True)
    spec = write_spec(tmp, interval=2, batch_size=4, async_save=async_save)
    config = TrainerConfig.from_spec(
        load_spec(spec), run_dir=tmp / "run", steps=steps, synthetic=True
    )
    assert config.checkpoint.async_save is async_save
    return train_to_end(config)


def assert_same_weights(a: Path, b: Path) -> None:
    pa, pb = load_params(a), load_params(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def test_a_background_save_holds_the_same_weights_as_a_foreground_save(tmp_path: Path) -> None:
    sync = run_in_process(tmp_path / "sync", async_save=False, steps=6)
    background = run_in_process(tmp_path / "async", async_save=True, steps=6)
    for step in (2, 4, 6):
        assert_same_weights(
            tmp_path / "sync" / "checkpoints" / f"step-{step}",
            tmp_path / "async" / "checkpoints" / f"step-{step}",
        )
    saves = background.summary["checkpoint"]
    assert saves["mode"] == "async" and saves["checkpoint_step"] == 6
    assert [(r["step"], r["mode"], r["reason"], r["saved"]) for r in saves["saves"]] == [
        (2, "async", "interval", True),
        (4, "async", "interval", True),
        (6, "async", "interval", True),  # the last step's save was already due: no extra one
    ]
    assert all(r["stall_s"] > 0 for r in saves["saves"])
    assert saves["stall_s_max"] == max(r["stall_s"] for r in saves["saves"])
    assert sync.summary["checkpoint"]["mode"] == "sync"
    # The stall is in the metrics too: every interval line says how long the loop saved.
    lines = [json.loads(x) for x in (tmp_path / "async" / "run" / "metrics.jsonl").open()]
    assert all("checkpoint_stall_s" in x for x in lines)
    assert sum(x["checkpoint_stall_s"] for x in lines) > 0
    assert background.outcome is not None and background.outcome.checkpoint_step == 6


@pytest.mark.timeout(300)
def test_two_ranks_complete_background_saves_together_with_foreground_weights(
    tmp_path: Path,
) -> None:
    for mode in ("sync", "async"):
        folder = tmp_path / mode
        folder.mkdir()
        spec = write_spec(
            folder, strategy="fsdp", batch_size=4, steps=4, interval=2,
            async_save=mode == "async",
        )  # fmt: skip
        argv = ["--spec", str(spec), "--run-dir", str(folder / "run"), "--synthetic-data"]
        assert run_local(argv, 2, env=ENV, timeout=240) == [0, 0]
        ckpts = folder / "checkpoints"
        assert [s for s, _ in step_dirs(ckpts)] == [2, 4]
        assert all((p / MARKER).is_file() for _, p in step_dirs(ckpts))
        # Both ranks' shards are in each step: every rank wrote before it was completed.
        assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in (ckpts / "step-2").iterdir()}
    summary = json.loads((tmp_path / "async" / "run" / "summary.json").read_text())
    assert summary["checkpoint"]["saved_steps"] == [2, 4]
    for step in (2, 4):
        assert_same_weights(
            tmp_path / "sync" / "checkpoints" / f"step-{step}",
            tmp_path / "async" / "checkpoints" / f"step-{step}",
        )


class _FakeCheckpointer:
    """Stands in for the Checkpointer: background saves that finish when the test says."""

    def __init__(self) -> None:
        self.write: Future[None] = Future()
        self.staged: Future[None] = Future()
        self.started: list[int] = []

    def start_async(self, step: int, *_: object) -> PendingSave:
        self.started.append(step)
        return PendingSave(step, Path("p"), Path("f"), write=self.write, staged=self.staged)

    def advance(self, pending: PendingSave) -> Path:
        return pending.final


def test_the_optimizer_waits_for_the_copy_and_a_due_save_waits_for_the_one_in_flight() -> None:
    from training.trainer.signals import StepFlags

    fake = _FakeCheckpointer()
    policy = CheckpointPolicy(
        fake,  # type: ignore[arg-type]
        interval_steps=2, async_save=True, final_retry_s=1,
    )  # fmt: skip
    busy = StepFlags(stop=False, void=False, checkpoint_now=False, saves_done=False)
    policy.at_step(2, busy, None, None, {})  # type: ignore[arg-type]
    assert fake.started == [2] and policy.in_flight == 2 and policy.busy

    threading.Timer(0.3, fake.staged.set_result, args=(None,)).start()
    t0 = time.perf_counter()
    waited = policy.before_update()  # the next optimizer step must not run before the copy
    assert time.perf_counter() - t0 > 0.25 and waited > 0.25

    threading.Timer(0.3, fake.write.set_result, args=(None,)).start()
    t0 = time.perf_counter()
    policy.at_step(3, busy, None, None, {})  # type: ignore[arg-type]
    assert policy.checkpoint_step is None and policy.in_flight == 2  # still writing
    fake.write, fake.staged = Future(), Future()
    fake.staged.set_result(None)
    policy.at_step(4, busy, None, None, {})  # type: ignore[arg-type]
    # Step 4 came due with step 2 in flight: the loop waited for step 2, then started step 4.
    assert time.perf_counter() - t0 > 0.25
    assert policy.checkpoint_step == 2 and fake.started == [2, 4] and policy.in_flight == 4
    fake.write.set_result(None)
    assert policy.finish(4, None, None, {}) is None  # type: ignore[arg-type]
    assert policy.checkpoint_step == 4
    assert [r.saved for r in policy.records] == [True, True]
