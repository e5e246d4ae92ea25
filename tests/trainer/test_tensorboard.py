"""The trainer's TensorBoard event files, read back with TensorBoard's own reader
(``EventAccumulator``): every scalar the run measures under its tag, once per logged step, also
across a rollback (a resumed run purges what an earlier one logged from its first step on), the
ones that depend on settings (validation, EMA, layer decay, accuracy targets, a GPU's MFU, the
data tier), the spec and the run as text, the first batch's inputs as images; and their upload
to S3 (moto): once per change, at most once per interval but always at close, what a host lost
without notice leaves out, and never in a step's way when S3 fails or hangs."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from training.common.tensorboard_paths import every_job_uri, tensorboard_uri
from training.spec import load_spec
from training.trainer.config import TrainerConfig
from training.trainer.tensorboard_log import TensorBoardLog

from .conftest import train_to_end, write_spec

TRAIN = ("loss", "lr", "grad_norm", "grad_norm_max", "nonfinite_steps", "samples_per_s",
         "step_time_s", "data_wait_share")  # fmt: skip


def events(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


def steps(acc: EventAccumulator, tag: str) -> list[int]:
    return [e.step for e in acc.Scalars(tag)]


def run(spec: Path, run_dir: Path, total: int) -> Any:
    config = TrainerConfig.from_spec(load_spec(spec), run_dir=run_dir, steps=total, synthetic=True)
    return train_to_end(config)


def test_a_run_writes_every_scalar_each_step_with_the_spec_and_its_inputs(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, steps=3, batch_size=4)
    trainer = run(spec, tmp_path / "run", 3)
    acc = events(tmp_path / "run")
    tags = acc.Tags()
    for name in TRAIN:
        assert steps(acc, f"train/{name}") == [1, 2, 3], name
    loss = [e.value for e in acc.Scalars("train/loss")]
    assert loss == pytest.approx([r["loss"] for r in trainer.metrics.records])
    assert set(tags["tensors"]) >= {"spec/text_summary", "run/text_summary"}
    assert tags["images"] == ["inputs/augmented"]
    (image,) = acc.Images("inputs/augmented")
    # The first batch's four 32 px images, tiled in one row.
    assert image.step == 1 and (image.width, image.height) == (4 * 32, 32)


def test_a_resumed_run_continues_the_curves_with_no_gap_and_no_repeat(tmp_path: Path) -> None:
    """Five steps logged, the last durable checkpoint at step 4 (step 5's is lost): the resumed
    run logs 5 to 7 again, and each step has one value, the resumed run's."""
    spec = write_spec(tmp_path, interval=2, batch_size=4)
    run(spec, tmp_path / "run", 5)
    shutil.rmtree(tmp_path / "checkpoints" / "step-5")  # the generation's last save lost
    second = run(spec, tmp_path / "run", 7)
    assert second.summary["start_step"] == 4
    acc = events(tmp_path / "run")
    assert len(list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert steps(acc, "train/loss") == [1, 2, 3, 4, 5, 6, 7]
    resumed = {r["step"]: r["loss"] for r in second.metrics.records}
    logged = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert logged[5] == pytest.approx(resumed[5])


def test_the_job_folder_of_an_s3_checkpoint_uri() -> None:
    assert tensorboard_uri("s3://ckpt/checkpoints/j-1/") == "s3://ckpt/checkpoints/tensorboard/j-1/"
    assert every_job_uri("s3://ckpt/checkpoints/j-1/") == "s3://ckpt/checkpoints/tensorboard/"
    assert (
        tensorboard_uri("s3://ckpt/checkpoints/sagemaker/vit-1")
        == "s3://ckpt/checkpoints/sagemaker/tensorboard/vit-1/"
    )


def test_event_files_are_uploaded_when_they_change(tmp_path: Path, mock_s3: Any) -> None:
    """Uploaded by the thread as soon as a checkpoint is durable (not an hour later), again only
    once changed, and at close."""
    mock_s3.create_bucket(Bucket="ckpt")
    uri = "s3://ckpt/checkpoints/tensorboard/j-1/"
    tb = TensorBoardLog(tmp_path, upload_uri=uri, s3_client=lambda: mock_s3, every_s=3600)
    tb.start(0)
    tb.train({"step": 1, "loss": 2.0, "lr": 0.1})
    tb.checkpointed(1)
    deadline = time.monotonic() + 10
    while "Contents" not in mock_s3.list_objects_v2(Bucket="ckpt") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "Contents" in mock_s3.list_objects_v2(Bucket="ckpt")
    assert tb.upload() == 0  # unchanged: not sent again
    tb.train({"step": 2, "loss": 1.5, "lr": 0.1})
    tb.close()  # flushes, and uploads what changed
    listed = mock_s3.list_objects_v2(Bucket="ckpt", Prefix="checkpoints/tensorboard/j-1/")
    (key,) = [o["Key"] for o in listed["Contents"]]
    local = next((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert key == f"checkpoints/tensorboard/j-1/{local.name}"
    body = mock_s3.get_object(Bucket="ckpt", Key=key)["Body"].read()
    assert body == local.read_bytes()


def test_a_run_that_starts_over_replaces_the_curves_of_one_that_crashed_first(
    tmp_path: Path,
) -> None:
    """A generation crashed before its first checkpoint: the next starts from step 0, and its
    steps replace the earlier ones (purge from step 1)."""
    spec = write_spec(tmp_path, interval=100, batch_size=4)
    run(spec, tmp_path / "run", 2)
    shutil.rmtree(tmp_path / "checkpoints")  # nothing durable: the next run starts over
    second = run(spec, tmp_path / "run", 3)
    assert second.summary["start_step"] == 0
    acc = events(tmp_path / "run")
    assert steps(acc, "train/loss") == [1, 2, 3]
    logged = [e.value for e in acc.Scalars("train/loss")]
    assert logged == pytest.approx([r["loss"] for r in second.metrics.records])


SETTINGS_KEYS = "layer_decay = 0.75\naccuracy_targets = [0.01, 1.0]\n"
SETTINGS_TABLES = "[job.ema]\ndecay = 0.9\n[job.eval]\nevery_steps = 2\n"
VAL = ("top1", "top5", "val_loss", "ema_top1", "ema_top5", "ema_val_loss", "usd")


def test_validation_ema_layer_decay_and_targets_have_their_curves(tmp_path: Path) -> None:
    """A run with a validation set every 2 steps, EMA weights, layer decay and two accuracy
    targets: each validation figure at 2 and 4, as the records have it; the targets reached by
    then; each param group's rate at every step (layer decay: the rate times its scale)."""
    spec = write_spec(tmp_path, steps=4, batch_size=4, job_keys=SETTINGS_KEYS,
                      tables=SETTINGS_TABLES)  # fmt: skip
    text = spec.read_text().replace("num_samples = 512", "num_samples = 160\nval_fraction = 0.1")
    spec.write_text(text)
    # The local loader (synthetic input has no validation set), with the spec's dataset.
    config = TrainerConfig.from_spec(load_spec(spec), run_dir=tmp_path / "run", steps=4)
    trainer = train_to_end(config)
    acc = events(tmp_path / "run")
    evals = trainer.metrics.evals
    assert [r["step"] for r in evals] == [2, 4]
    for name in VAL:
        logged = acc.Scalars(f"val/{name}")
        assert [(e.step, e.value) for e in logged] == [
            (r["step"], pytest.approx(r[name])) for r in evals
        ], name
    targets = trainer.summary["accuracy"]["targets"]
    assert [t["reached"] for t in targets] == [True, False]  # 1 %, not 100 %
    reached = [sum(t["reached"] and t["step"] <= r["step"] for t in targets) for r in evals]
    assert [(e.step, e.value) for e in acc.Scalars("val/targets_reached")] == [
        (2, reached[0]),
        (4, reached[1]),
    ]
    # Layer decay: group i runs at the rate times its scale, every step, also at the cosine's
    # end (step 4), where every group's rate is 0.
    scales = [g["lr_scale"] for g in trainer.optimizer.param_groups]
    assert len(set(scales)) > 1
    rates = acc.Scalars("train/lr")
    assert [e.step for e in rates] == [1, 2, 3, 4] and rates[-1].value == 0.0
    for i, scale in enumerate(scales):
        logged = [(e.step, e.value) for e in acc.Scalars(f"lr/group_{i}")]
        assert logged == [(e.step, pytest.approx(e.value * scale)) for e in rates], i
    val = {t for t in acc.Tags()["scalars"] if t.startswith("val/")}
    assert val == {f"val/{name}" for name in (*VAL, "targets_reached")}


def test_the_data_tier_mfu_and_gradient_norms_go_under_train(tmp_path: Path) -> None:
    """An interval record as a GPU run with an elastic data tier has it: each number under
    ``train/`` at its step; what is None (no checkpoint yet) or not a number is left out."""
    tb = TensorBoardLog(tmp_path)
    tb.start(0)
    record = {
        "step": 10, "loss": 1.25, "lr": 0.001, "grad_norm": 2.5, "grad_norm_max": 4.0,
        "mfu": 0.375, "gpu_util_pct": 97.0, "data_servers": 3, "data_servers_target": 5,
        "checkpoint_age_s": None, "unreadable_first": ["a.jpg"], "epoch": 1,
    }  # fmt: skip
    tb.train(record)
    tb.train({**record, "step": 20, "data_servers": 5, "mfu": 0.5})
    tb.close()
    acc = events(tmp_path)
    written = {"loss", "lr", "grad_norm", "grad_norm_max", "mfu", "gpu_util_pct",
               "data_servers", "data_servers_target"}  # fmt: skip
    assert set(acc.Tags()["scalars"]) == {f"train/{name}" for name in written}
    assert [(e.step, e.value) for e in acc.Scalars("train/data_servers")] == [(10, 3), (20, 5)]
    assert [(e.step, e.value) for e in acc.Scalars("train/data_servers_target")] == [
        (10, 5),
        (20, 5),
    ]
    assert [e.value for e in acc.Scalars("train/mfu")] == [0.375, 0.5]
    assert [e.value for e in acc.Scalars("train/grad_norm")] == [2.5, 2.5]
    assert [e.value for e in acc.Scalars("train/grad_norm_max")] == [4.0, 4.0]


# -- the upload: at most every every_s, never in a step's way ---------------------------------

URI = "s3://ckpt/checkpoints/tensorboard/j-1/"


def put_keys(s3: Any) -> list[str]:
    """The keys of the PutObject calls ``s3`` makes from now on, as it makes them."""
    keys: list[str] = []
    s3.meta.events.register(
        "provide-client-params.s3.PutObject", lambda params, **_: keys.append(params["Key"])
    )
    return keys


def wait_until(done: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert done()


def s3_copy(s3: Any, folder: Path) -> EventAccumulator:
    """TensorBoard's reader on what the job's folder in S3 holds."""
    folder.mkdir()
    for o in s3.list_objects_v2(Bucket="ckpt", Prefix="checkpoints/tensorboard/j-1/")["Contents"]:
        body = s3.get_object(Bucket="ckpt", Key=o["Key"])["Body"].read()
        (folder / Path(o["Key"]).name).write_bytes(body)
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def test_checkpoints_within_the_upload_interval_are_uploaded_once(
    tmp_path: Path, mock_s3: Any
) -> None:
    """The first durable checkpoint is uploaded at once; two more within ``every_s`` are not
    (the cost stays bounded however often the run checkpoints); close uploads the rest."""
    mock_s3.create_bucket(Bucket="ckpt")
    keys = put_keys(mock_s3)
    tb = TensorBoardLog(tmp_path, upload_uri=URI, s3_client=lambda: mock_s3, every_s=3600)
    tb.start(0)
    tb.train({"step": 1, "loss": 2.0})
    tb.checkpointed(1)
    wait_until(lambda: len(keys) == 1)
    for step in (2, 3):
        tb.train({"step": step, "loss": 1.0})
        tb.checkpointed(step)
    time.sleep(1.0)  # time enough for an upload the interval should have held back
    assert len(keys) == 1
    tb.close()
    assert len(keys) == 2 and len(set(keys)) == 1  # one event file, sent twice


def test_close_uploads_the_last_events_however_recent_the_last_upload(
    tmp_path: Path, mock_s3: Any
) -> None:
    mock_s3.create_bucket(Bucket="ckpt")
    tb = TensorBoardLog(tmp_path, upload_uri=URI, s3_client=lambda: mock_s3, every_s=3600)
    tb.start(0)
    tb.train({"step": 1, "loss": 2.0})
    tb.checkpointed(1)
    wait_until(lambda: "Contents" in mock_s3.list_objects_v2(Bucket="ckpt"))
    for step in (2, 3):
        tb.train({"step": step, "loss": 1.0})
    tb.close()
    assert steps(s3_copy(mock_s3, tmp_path / "s3"), "train/loss") == [1, 2, 3]


def test_a_host_lost_without_notice_leaves_out_of_s3_what_it_logged_after_its_last_upload(
    tmp_path: Path, mock_s3: Any
) -> None:
    """What docs/trainer.md says: uploaded at the checkpoint of step 2; the checkpoint of step 4
    came within ``every_s`` of it, so steps 3 and 4 were not uploaded when the host was lost at
    step 5. The next generation (another host) resumes from step 4 and logs 5 and 6 again; 3
    and 4 stay missing from S3's copy."""
    mock_s3.create_bucket(Bucket="ckpt")
    lost = False

    def s3_of_the_first_host() -> Any:
        if lost:
            raise ConnectionError("the host is gone")
        return mock_s3

    first = TensorBoardLog(tmp_path / "a", upload_uri=URI, s3_client=s3_of_the_first_host,
                           every_s=3600)  # fmt: skip
    first.start(0)
    for step in range(1, 6):
        first.train({"step": step, "loss": 1.0})
        if step in (2, 4):
            first.checkpointed(step)
        if step == 2:
            wait_until(lambda: "Contents" in mock_s3.list_objects_v2(Bucket="ckpt"))
    time.sleep(1.0)  # time enough for an upload the interval should have held back
    lost = True
    first.close()  # its thread ends; the upload at close fails, as on a lost host
    second = TensorBoardLog(tmp_path / "b", upload_uri=URI, s3_client=lambda: mock_s3)
    second.start(4)
    for step in (5, 6):
        second.train({"step": step, "loss": 0.5})
    second.close()
    acc = s3_copy(mock_s3, tmp_path / "s3")
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (1, 1.0),
        (2, 1.0),
        (5, 0.5),
        (6, 0.5),
    ]


class _StuckS3:
    """An S3 client whose PutObject fails, or hangs until released (10 s at most)."""

    def __init__(self, fails: bool) -> None:
        self.fails = fails
        self.called = threading.Event()
        self.release = threading.Event()

    def put_object(self, **_: Any) -> None:
        self.called.set()
        if self.fails:
            raise ConnectionError("S3 unreachable")
        self.release.wait(10)


@pytest.mark.parametrize("fails", [True, False], ids=["failing", "hanging"])
def test_a_failing_or_hanging_s3_never_raises_into_nor_holds_up_the_steps(
    tmp_path: Path, fails: bool, caplog: pytest.LogCaptureFixture
) -> None:
    s3 = _StuckS3(fails)
    tb = TensorBoardLog(tmp_path, upload_uri=URI, s3_client=lambda: s3, every_s=0.01)
    tb.start(0)
    tb.train({"step": 1, "loss": 2.0})
    tb.checkpointed(1)
    assert s3.called.wait(5)  # the thread is in PutObject (or has just failed it)
    began = time.monotonic()
    for step in range(2, 50):
        tb.train({"step": step, "loss": 1.0})
        tb.checkpointed(step)
    assert time.monotonic() - began < 2.0
    s3.release.set()
    tb.close()  # nor does close raise: a failed upload is logged
    assert ("TensorBoard events not uploaded" in caplog.text) == fails
    assert steps(events(tmp_path), "train/loss") == list(range(1, 50))
