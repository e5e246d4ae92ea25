"""A job over a folder with bad files: every unreadable training sample named, with its reason,
in summary.json, the metrics records and the console's table, the same from the local loader
and through a data server; kept across a resume; past ``job.dataset.max_unreadable`` the job
fails naming them, its ranks exiting ``EXIT_DATA`` (not retried); two ranks end with the same
list."""

from __future__ import annotations

import io
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from training.common.outcome import EXIT_DATA, Outcome, not_retried, read_rank_outcomes
from training.data.batch import Unreadable
from training.data.transforms import EvalTransform
from training.dataplane.server import create_server
from training.dataplane.sources import AugmentingBatchSource
from training.spec import SpecError, load_spec
from training.trainer.__main__ import main
from training.trainer.config import TrainerConfig
from training.trainer.train import Trainer
from training.trainer.unreadable import UnreadableDataError, UnreadableSamples

SPEC = """
name = "unreadable-test"
[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge"]
count = 1
[[groups]]
name = "dataprep"
role = "dataprep"
instance_types = ["c6i.4xlarge"]
count = 1
[job]
batch_size = 4
steps = {steps}
precision = "fp32"
log_every_steps = 1
[job.model]
name = "vit-cpu-tiny"
[job.dataset]
source = "folder"
path = "{path}"
num_classes = 3
image_size = 32
max_unreadable = {max_unreadable}
[job.checkpoint]
interval_steps = 4
dir = "{checkpoints}"
[job.dataplane]
workers_per_server = 1
"""

NOT_UTF8 = b"caf\xe9.png"  # Latin-1, as an archive made elsewhere names it


def png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (36, 44, 3), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def write_folder(root: Path) -> None:
    """30 valid PNGs in 3 classes and 4 bad files (``bad_names``)."""
    for c in range(3):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(10):
            (root / f"c{c}" / f"{i}.png").write_bytes(png(10 * c + i))
    (root / "c0" / "empty.png").write_bytes(b"")
    (root / "c1" / "notes.jpg").write_text("a text file named .jpg\n")
    (root / "c2" / "cut.png").write_bytes(png(99)[:120])
    with open(os.path.join(os.fsencode(root / "c2"), NOT_UTF8), "wb"):
        pass  # zero bytes, under a name that is not UTF-8


def bad_names(root: Path) -> set[str]:
    """The bad files' names as the job shows them (bytes that are not UTF-8 escaped)."""
    return {
        str(root / "c0" / "empty.png"),
        str(root / "c1" / "notes.jpg"),
        str(root / "c2" / "cut.png"),
        str(root / "c2") + "/caf\\xe9.png",
    }


def spec_file(tmp_path: Path, *, steps: int = 8, max_unreadable: float = 0.2) -> Path:
    folder = tmp_path / "images"
    if not folder.exists():
        write_folder(folder)
    path = tmp_path / f"spec-{max_unreadable}.toml"
    text = SPEC.format(
        steps=steps, path=folder, max_unreadable=max_unreadable,
        checkpoints=tmp_path / "checkpoints",
    )  # fmt: skip
    path.write_text(text)
    return path


def run(spec: Path, run_dir: Path, *, servers: list[str] | None = None, **kw: Any) -> Trainer:
    if servers:
        kw["data_servers"] = servers
    config = TrainerConfig.from_spec(load_spec(spec), run_dir=run_dir, environ={}, **kw)
    trainer = Trainer(replace(config, log_every_steps=1))
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


@pytest.fixture
def data_server(tmp_path: Path) -> Any:
    job = load_spec(spec_file(tmp_path)).job
    source = AugmentingBatchSource(
        job.dataset, eval_recipe=EvalTransform.from_spec(job.eval), workers=1, processes=False
    )
    server, port = create_server(source, port=0)
    yield f"127.0.0.1:{port}"
    server.stop(0)


@pytest.mark.parametrize("through", ["local loader", "data server"])
def test_a_job_names_every_unreadable_training_sample(
    tmp_path: Path, data_server: str, through: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """One epoch (34 files, batches of 4): the 4 bad files are left out, each named once with
    its reason in summary.json, counted in every metrics record from the step that met it, and
    listed in the console's table; the 30 good ones are trained on."""
    expected = bad_names(tmp_path / "images")
    servers = [data_server] if through == "data server" else None
    trainer = run(spec_file(tmp_path), tmp_path / "run", servers=servers)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    unreadable = summary["unreadable"]
    assert unreadable["count"] == 4
    assert {u["name"] for u in unreadable["samples"]} == expected
    for u in unreadable["samples"]:
        assert u["reason"].startswith("not a readable image: "), u
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    counts = [r["unreadable_samples"] for r in records if "kind" not in r]
    assert len(counts) == 8 and counts == sorted(counts) and counts[-1] == 4, counts
    assert len(records[-1]["unreadable_first"]) == 3
    table = capsys.readouterr().err  # the trainer's console is standard error
    assert "│ unreadable samples" in table and "4 (left out) │" in table
    lines = table[table.index("left out 4 unreadable training sample(s):") :].splitlines()[1:5]
    assert {line.strip().split(": ")[0] for line in lines} == expected, table
    assert trainer.unreadable.state_dict()["names"] == [
        [u["name"], u["reason"]] for u in unreadable["samples"]
    ]


def test_the_list_is_kept_across_a_resume(tmp_path: Path) -> None:
    """Stopped at step 4 and resumed to step 8: the bad files met before the stop are still
    named at the end (the checkpoint keeps the list), as in the uninterrupted run."""
    spec = spec_file(tmp_path)
    whole = run(spec, tmp_path / "whole")
    (tmp_path / "checkpoints").rename(tmp_path / "whole-checkpoints")
    first = run(spec, tmp_path / "first", steps=4)
    assert 0 < first.summary["unreadable"]["count"] < 4  # some met before the stop, not all
    resumed = run(spec, tmp_path / "resumed")
    assert resumed.restored is not None and resumed.step == 8
    assert resumed.summary["unreadable"] == whole.summary["unreadable"]


def test_past_max_unreadable_the_job_fails_naming_the_files(tmp_path: Path) -> None:
    """4 of 34 unreadable (12%) against max_unreadable = 0.05: judged once the first epoch's 32
    samples are met (a dataset of fewer than 1,000), the job fails with each name."""
    spec = spec_file(tmp_path, steps=12, max_unreadable=0.05)
    config = TrainerConfig.from_spec(load_spec(spec), run_dir=tmp_path / "run", environ={})
    trainer = Trainer(config)
    try:
        with pytest.raises(UnreadableDataError) as e:
            trainer.train()
    finally:
        trainer.close()
    assert trainer.step == 8
    message = str(e.value)
    assert message.startswith("4 of the first 32 training samples are unreadable (12.5%; ")
    assert "job.dataset.max_unreadable = 0.05" in message
    for name in ("empty.png", "notes.jpg", "cut.png", "caf\\xe9.png"):
        assert f"/{name} (not a readable image: " in message, message


def test_past_max_unreadable_the_rank_exits_so_that_no_restart_is_spent(tmp_path: Path) -> None:
    """Through the trainer's entry point: exit ``EXIT_DATA``, and ``rank-0.json`` says so (torchrun
    turns the exit code into 1), which the EC2 launcher ends the job on without a restart
    (``tests/launcher/test_launcher_ec2_job.py``): a restart resumes the same list and fails."""
    spec = spec_file(tmp_path, steps=12, max_unreadable=0.05)
    outcomes = tmp_path / "outcome"
    argv = ["--spec", str(spec), "--run-dir", str(tmp_path / "run"), "--outcome-dir", str(outcomes)]
    assert main(argv) == EXIT_DATA
    [rank] = read_rank_outcomes(outcomes)
    assert (rank.outcome, rank.exit_code, rank.step) == (Outcome.FAILED, EXIT_DATA, 8)
    assert rank.reason.startswith("UnreadableDataError: 4 of the first 32 training samples ")
    assert not_retried([rank]) == rank


def test_max_unreadable_is_a_share(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"job\.dataset\.max_unreadable.*must be in \[0, 1\]"):
        load_spec(spec_file(tmp_path, max_unreadable=1.5))


def test_the_judgement_waits_for_enough_samples_and_counts_each_name_once() -> None:
    from training.data.batch import Batch

    def batch(*names: str) -> Batch:
        import torch

        skipped = tuple(Unreadable(i, n, "not a readable image: x") for i, n in enumerate(names))
        return Batch(
            torch.zeros((1, 3, 8, 8), dtype=torch.uint8), torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64), skipped=skipped,
        )  # fmt: skip

    log = UnreadableSamples(0.01, epoch_samples=5000)
    log.met(batch("a", "b"))
    assert log.pending
    log.share(world_size=1)
    log.judge(samples_met=100)  # 2% of 100, but fewer than 1,000 met: not judged yet
    log.met(batch("a"))  # the same file in a later epoch
    log.share(world_size=1)
    assert log.summary() == {
        "count": 2,
        "samples": [
            {"name": "a", "reason": "not a readable image: x"},
            {"name": "b", "reason": "not a readable image: x"},
        ],
    }
    log.judge(samples_met=1000)  # 0.2%
    log.met(batch(*(f"f{i}" for i in range(9))))
    log.share(world_size=1)
    with pytest.raises(UnreadableDataError, match=r"^11 of the first 1000 training samples"):
        log.judge(samples_met=1000)


def _rank(rank: int, port: int, out: Path) -> None:
    """Rank ``rank`` of 2: meets its own bad files at its own steps, agrees and shares as the
    training loop does; writes its list after each step."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from training.data.batch import Batch
    from training.trainer.signals import StopSignal

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    met = {0: {1: ["r0-a"]}, 1: {2: ["r1-a", "r1-b"], 3: ["r0-a"]}}[rank]
    log, stop, seen = UnreadableSamples(0.5), StopSignal(), []
    for step in range(1, 5):
        skipped = tuple(Unreadable(step, n, f"from rank {rank}") for n in met.get(step, []))
        empty = Batch(
            torch.zeros((0, 3, 8, 8), dtype=torch.uint8), torch.zeros(0, dtype=torch.int64),
            torch.zeros(0, dtype=torch.int64), skipped=skipped,
        )  # fmt: skip
        log.met(empty)
        flags = stop.agree(unreadable=log.pending)
        if flags.unreadable:
            log.share(2, stop.group)
        seen.append([flags.unreadable, list(log.names.items())])
    (out / f"rank-{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_ranks_hold_the_same_list_after_each_step(tmp_path: Path) -> None:
    import multiprocessing

    import torch.multiprocessing as torch_mp

    from training.trainer.local_run import FORKSERVER_PRELOAD, free_port

    multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    torch_mp.start_processes(
        _rank, args=(free_port(), tmp_path), nprocs=2, start_method="forkserver"
    )
    seen = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert seen[0] == seen[1]
    a, b, c = ["r0-a", "from rank 0"], ["r1-a", "from rank 1"], ["r1-b", "from rank 1"]
    # The same file met by both ranks is listed once, with the reason first shared.
    assert seen[0] == [[True, [a]], [True, [a, b, c]], [True, [a, b, c]], [False, [a, b, c]]]
