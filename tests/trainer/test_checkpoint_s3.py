"""Checkpoints in S3 (a real moto server on 127.0.0.1, reached by boto3 through
AWS_ENDPOINT_URL): every host uploads its own shards, the marker goes up last, marker-less steps
are never loaded, pruning keeps ``keep`` steps, a failed upload fails loudly and leaves the
previous checkpoint whole, and two torchrun "hosts" with separate local folders save to S3 and
resume from empty folders to the same weights as an uninterrupted run. An S3 outage (a loopback
proxy taken down and brought back) costs saves, never training, and never leaves a marker on
an incomplete step; background saves upload to S3 too."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aws_calls
import boto3
import pytest
import torch
from moto.server import ThreadedMotoServer
from torch import nn

from training.common.aws import CONNECT_TIMEOUT_S, MAX_ATTEMPTS
from training.common.outcome import EXIT_FAILED, EXIT_STOPPED, Outcome
from training.common.steps import MARKER
from training.spec import load_spec
from training.trainer.checkpoint import Checkpointer, CheckpointStorageError
from training.trainer.checkpoint_s3 import S3CheckpointStore
from training.trainer.config import ConfigError, TrainerConfig
from training.trainer.local_run import free_port, run_local
from training.trainer.train import Trainer

from .conftest import load_params, sigterm_after_metrics, write_spec

REPO = Path(__file__).resolve().parents[2]
GLOBAL_BATCH = 8
STEPS = 4


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    """A moto S3 server for this module; the environment that points boto3 at it."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    yield env
    server.stop()


@pytest.fixture
def bucket(s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket; this process's boto3 talks to the moto server."""
    for k, v in s3_env.items():
        monkeypatch.setenv(k, v)
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


def keys(bucket: str) -> list[str]:
    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def step_files(bucket: str, step: int, root: str = "ckpts") -> set[str]:
    prefix = f"{root}/step-{step}/"
    return {k[len(prefix) :] for k in keys(bucket) if k.startswith(prefix)}


def steps_in(bucket: str) -> list[int]:
    """The step-N folders (a finished run's model/ sits beside them)."""
    folders = {k.split("/")[1] for k in keys(bucket)}
    return sorted(int(f.removeprefix("step-")) for f in folders if f.startswith("step-"))


class RecordingClient:
    """An S3 client whose object writes are recorded in order; ``fail_on`` (a substring of a
    key) makes that upload raise, as a dropped connection would."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.client = boto3.client("s3")
        self.uploaded: list[str] = []
        self.fail_on = fail_on
        self.client.meta.events.register("before-parameter-build.s3.PutObject", self._before)
        self.client.meta.events.register(
            "before-parameter-build.s3.CreateMultipartUpload", self._before
        )

    def _before(self, params: dict[str, Any], **_: Any) -> None:
        key = params["Key"]
        if self.fail_on is not None and self.fail_on in key:
            raise ConnectionError(f"simulated network failure uploading {key}")
        self.uploaded.append(key)


def tiny_state() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


def test_marker_goes_up_last_and_pruning_keeps_keep_steps(bucket: str, tmp_path: Path) -> None:
    recorder = RecordingClient()
    store = S3CheckpointStore(f"s3://{bucket}/ckpts/", client=recorder.client)
    ckpt = Checkpointer(tmp_path / "local", keep=2, rank=0, world_size=1, store=store)
    model, opt = tiny_state()
    # Leftovers of cut-off saves: an older marker-less step (pruned once a newer step is
    # complete) and files of step 3 itself (cleared before step 3 is written again).
    boto3.client("s3").put_object(Bucket=bucket, Key="ckpts/step-1/__0_0.distcp", Body=b"x")
    boto3.client("s3").put_object(Bucket=bucket, Key="ckpts/step-3/__7_0.distcp", Body=b"x")
    for step in (2, 3, 4):
        recorder.uploaded.clear()
        assert ckpt.save(step, model, opt, {"epoch": 0, "batch": step}) is not None
        ours = [k for k in recorder.uploaded if f"/step-{step}/" in k]
        assert ours[-1] == f"ckpts/step-{step}/{MARKER}", ours
        assert {".metadata", "__0_0.distcp"} <= {k.rsplit("/", 1)[1] for k in ours}
    assert "__7_0.distcp" not in step_files(bucket, 3)
    assert steps_in(bucket) == [3, 4]  # keep = 2; the marker-less step-1 is gone too
    assert all(MARKER in step_files(bucket, s) for s in (3, 4))
    # Saving a step S3 already holds complete is a no-op (stopped right after resuming).
    assert ckpt.save(4, model, opt, {}) is None
    # Locally only staging: ``keep`` step folders, nothing half-renamed.
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == ["step-3", "step-4"]


def test_resume_ignores_a_step_without_marker_and_starts_from_an_empty_folder(
    bucket: str, tmp_path: Path
) -> None:
    store = S3CheckpointStore(f"s3://{bucket}/ckpts")
    model, opt = tiny_state()
    saver = Checkpointer(tmp_path / "first", keep=3, rank=0, world_size=1, store=store)
    saver.save(5, model, opt, {"epoch": 1, "batch": 5})
    # A newer save cut off before its marker: every shard is there, the marker is not.
    s3 = boto3.client("s3")
    for name in step_files(bucket, 5) - {MARKER}:
        s3.copy_object(
            Bucket=bucket,
            Key=f"ckpts/step-9/{name}",
            CopySource={"Bucket": bucket, "Key": f"ckpts/step-5/{name}"},
        )
    assert store.latest_complete() == 5

    fresh = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    empty = tmp_path / "replacement-host"
    loader = Checkpointer(empty, keep=3, rank=0, world_size=1, store=store)
    restored = loader.restore_latest(fresh, fresh_opt)
    assert restored is not None and restored.step == 5 and restored.path == empty / "step-5"
    assert restored.data_state == [{"epoch": 1, "batch": 5}]
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert not (empty / "step-9").exists()


def test_a_failed_upload_raises_and_leaves_the_previous_checkpoint_whole(
    bucket: str, tmp_path: Path
) -> None:
    model, opt = tiny_state()
    good = Checkpointer(
        tmp_path / "a",
        keep=1,
        rank=0,
        world_size=1,
        store=S3CheckpointStore(f"s3://{bucket}/ckpts"),
    )
    good.save(10, model, opt, {})
    before = step_files(bucket, 10)

    flaky = RecordingClient(fail_on="step-20/__0_0")
    store = S3CheckpointStore(f"s3://{bucket}/ckpts", client=flaky.client)
    bad = Checkpointer(tmp_path / "a", keep=1, rank=0, world_size=1, store=store)
    with pytest.raises(CheckpointStorageError, match=r"uploading checkpoint step 20.*simulated"):
        bad.save(20, model, opt, {})
    assert MARKER not in step_files(bucket, 20)  # never loadable
    assert step_files(bucket, 10) == before  # keep = 1, yet nothing was pruned
    assert store.latest_complete() == 10


@pytest.mark.parametrize("principal", ["instance", "sagemaker"])
def test_a_shard_past_the_multipart_threshold_goes_up_in_parts_and_a_failed_part_aborts(
    bucket: str, tmp_path: Path, record_aws_calls: Callable[..., Path], principal: str
) -> None:
    """A ViT's shard files pass boto3's 8 MiB multipart threshold: they go up in parts and come
    back whole, and a part that fails aborts the upload (s3:AbortMultipartUpload), so no
    half-uploaded parts stay behind in the bucket, billed and invisible to listings. The store
    is the same on EC2 instances and in SageMaker jobs: its calls are recorded as both roles'."""
    record_aws_calls(aws_calls.Names(cluster="vit", checkpoint_bucket=bucket), principal)
    folder = tmp_path / "step-1.partial"
    folder.mkdir()
    shard = os.urandom(9 * 1024 * 1024)
    (folder / "__0_0.distcp").write_bytes(shard)
    store = S3CheckpointStore(f"s3://{bucket}/checkpoints/d-1/")
    parts: list[int] = []
    store.client.meta.events.register(
        "before-parameter-build.s3.UploadPart",
        lambda params, **_: parts.append(params["PartNumber"]),
    )
    assert store.upload_files(folder, 1) == len(shard)
    assert sorted(parts) == [1, 2]
    (tmp_path / MARKER).write_text("")
    store.upload_marker(tmp_path / MARKER, 1)
    assert store.download(1, tmp_path / "back") == len(shard)
    assert (tmp_path / "back" / "__0_0.distcp").read_bytes() == shard

    def drop_second_part(params: dict[str, Any], **_: Any) -> None:
        if params["PartNumber"] == 2:
            raise ConnectionError("simulated network failure uploading part 2")

    store.client.meta.events.register("before-parameter-build.s3.UploadPart", drop_second_part)
    with pytest.raises(ConnectionError, match="part 2"):
        store.upload_files(folder, 2)
    assert boto3.client("s3").list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert step_files(bucket, 2, root="checkpoints/d-1") == set()


def test_config_accepts_an_s3_checkpoint_dir_and_names_bad_uris(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path))
    config = TrainerConfig.from_spec(
        spec, run_dir=tmp_path / "run", checkpoint_dir="s3://b/ckpts", synthetic=True
    )
    assert config.checkpoint.s3_uri == "s3://b/ckpts"
    assert config.checkpoint.dir == tmp_path / "run" / "checkpoint-staging"
    config = TrainerConfig.from_spec(
        spec, run_dir=tmp_path / "run", checkpoint_s3_uri="s3://b/x", synthetic=True
    )
    assert config.checkpoint.s3_uri == "s3://b/x"
    assert config.checkpoint.dir == tmp_path / "checkpoints"
    with pytest.raises(ConfigError, match=r"--checkpoint-s3-uri.*no bucket"):
        TrainerConfig.from_spec(spec, run_dir=tmp_path, checkpoint_s3_uri="s3:///x")
    with pytest.raises(ConfigError, match="name two buckets"):
        TrainerConfig.from_spec(
            spec, run_dir=tmp_path, checkpoint_dir="s3://a/x", checkpoint_s3_uri="s3://b/x"
        )


# --- real processes --------------------------------------------------------------------------


def two_hosts(spec: Path, tmp: Path, uri: str, env: dict[str, str], *extra: str) -> None:
    """Two torchrun agents (node rank 0 and 1, one FSDP rank each) with their own local
    checkpoint and run folders, rendezvous on 127.0.0.1, checkpoints in ``uri``."""
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
            str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
            str(port), "-m", "training.trainer", "--spec", str(spec), "--synthetic-data",
            "--run-dir", str(tmp / f"run-host{node}"),
            "--checkpoint-dir", str(tmp / f"local-host{node}"), "--checkpoint-s3-uri", uri,
            *extra,
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=REPO,
                env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]


@pytest.mark.timeout(600)
def test_two_hosts_save_all_shards_to_s3_and_resume_from_empty_folders(
    bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    # The uninterrupted run: 2 FSDP ranks sharing one local folder, no S3.
    whole = tmp_path / "whole"
    whole.mkdir()
    spec = write_spec(
        whole, strategy="fsdp", batch_size=GLOBAL_BATCH // 2, steps=STEPS, interval=2
    )  # fmt: skip
    argv = ["--spec", str(spec), "--run-dir", str(whole / "run"), "--synthetic-data"]
    assert run_local(argv, 2, env={"OMP_NUM_THREADS": "1"}, timeout=240) == [0, 0]

    uri = f"s3://{bucket}/ckpts"
    cut = tmp_path / "cut"
    two_hosts(spec, cut, uri, s3_env, "--steps", "2")
    files = step_files(bucket, 2)
    # Both ranks' shards (each written on its own host), DCP's metadata and the marker.
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", MARKER} <= files, files
    # Each host's local folder held only its own rank's shard: S3 is the only whole copy.
    assert not (cut / "local-host1" / "step-2" / "__0_0.distcp").exists()
    assert not (cut / "local-host0" / "step-2" / "__1_0.distcp").exists()
    s3 = boto3.client("s3")
    stamps = {
        n: s3.head_object(Bucket=bucket, Key=f"ckpts/step-2/{n}")["LastModified"] for n in files
    }
    assert stamps[MARKER] == max(stamps.values())

    # Replacement hosts: empty local folders; they download step-2 and continue to step 4.
    resumed = tmp_path / "resumed"
    two_hosts(spec, resumed, uri, s3_env)
    summary = json.loads((resumed / "run-host0" / "summary.json").read_text())
    assert summary["start_step"] == 2 and summary["resumed_from"].endswith("step-2")
    assert steps_in(bucket) == [2, 4]
    # The finished job's model, beside the checkpoints in S3.
    model = {k.split("/", 2)[2] for k in keys(bucket) if k.split("/")[1] == "model"}
    assert model == {"model.safetensors", "config.json"}

    s3_copy = tmp_path / "from-s3"
    S3CheckpointStore(uri).download(STEPS, s3_copy)
    a = load_params(whole / "checkpoints" / f"step-{STEPS}")
    b = load_params(s3_copy)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.timeout(180)
def test_sigterm_saves_to_s3_at_the_next_step_and_exits_stopped(
    bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    spec = write_spec(tmp_path, steps=100_000, interval=100_000)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "training.trainer", "--spec", str(spec), "--run-dir",
           str(run_dir), "--synthetic-data", "--checkpoint-s3-uri", f"s3://{bucket}/c"]  # fmt: skip
    ended = sigterm_after_metrics(
        cmd, env={**os.environ, **s3_env, "OMP_NUM_THREADS": "1"}, run_dir=run_dir, lines=2
    )
    assert ended.returncode == EXIT_STOPPED, ended.stdout[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM"
    assert S3CheckpointStore(f"s3://{bucket}/c").latest_complete() == summary["steps"]
    assert {"__0_0.distcp", ".metadata", MARKER} <= step_files(bucket, summary["steps"], "c")


def test_trainer_in_process_resumes_from_s3(bucket: str, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, interval=2, batch_size=4)
    uri = f"s3://{bucket}/ckpts"
    for run, steps in (("a", 3), ("b", 5)):
        config = TrainerConfig.from_spec(
            load_spec(spec), run_dir=tmp_path / run, steps=steps, synthetic=True,
            checkpoint_dir=tmp_path / f"local-{run}", checkpoint_s3_uri=uri,
        )  # fmt: skip
        trainer = Trainer(config)
        try:
            assert trainer.train() == 0
        finally:
            trainer.close()
    assert trainer.restored is not None and trainer.restored.step == 3
    assert trainer.stream.state_dict() == {"epoch": 0, "batch": 5}
    assert steps_in(bucket) == [3, 4, 5]  # keep = 3


# --- S3 outages -------------------------------------------------------------------------------


class TcpProxy:
    """A loopback TCP proxy to ``target`` that can be taken down (new connections refused, open
    ones cut) and brought back on the same port: an S3 outage as boto3 sees it."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = 0
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(64)
            listener.settimeout(0.1)
            self.port = listener.getsockname()[1]
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            cut, self._open = self._open, set()
        if listener is not None:
            listener.close()
        for sock in cut:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while self._listener is listener:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._open |= {client, upstream}
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def test_the_default_s3_client_fails_fast() -> None:
    client = S3CheckpointStore("s3://b/p").client
    assert client.meta.config.connect_timeout == CONNECT_TIMEOUT_S <= 5
    assert client.meta.config.retries == {"total_max_attempts": MAX_ATTEMPTS, "mode": "standard"}


@pytest.mark.timeout(180)
def test_an_s3_outage_costs_saves_not_training_and_never_leaves_a_marker(
    bucket: str, s3_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    host, port = s3_env["AWS_ENDPOINT_URL"].removeprefix("http://").split(":")
    proxy = TcpProxy((host, int(port)))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("HETERO_FINAL_SAVE_RETRY_S", "3")
    spec = write_spec(tmp_path, interval=2, batch_size=4)
    uri = f"s3://{bucket}/ckpts"

    def config(steps: int, run: str) -> TrainerConfig:
        return TrainerConfig.from_spec(
            load_spec(spec), run_dir=tmp_path / run, steps=steps, synthetic=True,
            checkpoint_dir=tmp_path / f"local-{run}", checkpoint_s3_uri=uri,
        )  # fmt: skip

    trainer = Trainer(config(5, "a"))
    store = trainer.checkpointer.store
    assert store is not None
    save, upload = trainer.checkpointer.save, store.upload_files

    def save_after_outage(step: int, *args: Any) -> Any:
        if step == 4:
            proxy.up()  # S3 is back for step 4's save
        return save(step, *args)

    def upload_into_outage(folder: Path, step: int) -> int:
        if step in (2, 5):
            proxy.down()  # S3 goes away as step 2's (and step 5's) shards go up
        return upload(folder, step)

    monkeypatch.setattr(trainer.checkpointer, "save", save_after_outage)
    monkeypatch.setattr(store, "upload_files", upload_into_outage)
    try:
        with caplog.at_level(logging.WARNING):
            code = trainer.train()
    finally:
        trainer.close()
        proxy.up()
    # Training went through the outage to its last step, but the last save failed (retried
    # for HETERO_FINAL_SAVE_RETRY_S): the run failed, naming step 4 as its newest checkpoint.
    assert code == EXIT_FAILED and trainer.step == 5
    outcome = trainer.outcome
    assert outcome is not None and outcome.outcome is Outcome.FAILED
    assert outcome.step == 5 and outcome.checkpoint_step == 4
    assert "checkpoint step 2 NOT saved" in caplog.text and "next attempt at step 4" in caplog.text
    saves = trainer.summary["checkpoint"]
    assert saves["saved_steps"] == [4]
    assert saves["failed_steps"][0] == 2 and set(saves["failed_steps"][1:]) == {5}
    assert len(saves["failed_steps"]) >= 2  # the last save was tried more than once
    assert MARKER in step_files(bucket, 4)
    assert MARKER not in step_files(bucket, 2) and MARKER not in step_files(bucket, 5)
    assert store.latest_complete() == 4

    # A replacement resumes from the newest complete step, 4, and finishes.
    resumed = Trainer(config(6, "b"))
    try:
        assert resumed.train() == 0
    finally:
        resumed.close()
    assert resumed.restored is not None and resumed.restored.step == 4
    assert resumed.outcome is not None and resumed.outcome.checkpoint_step == 6
    assert store.latest_complete() == 6


def test_background_saves_upload_to_s3_and_load_like_foreground_ones(
    bucket: str, tmp_path: Path
) -> None:
    weights = {}
    for mode in ("sync", "async"):
        (tmp_path / mode).mkdir()
        spec = write_spec(
            tmp_path / mode, interval=2, batch_size=4, async_save=mode == "async"
        )  # fmt: skip
        config = TrainerConfig.from_spec(
            load_spec(spec), run_dir=tmp_path / mode / "run", steps=4, synthetic=True,
            checkpoint_s3_uri=f"s3://{bucket}/{mode}",
        )  # fmt: skip
        trainer = Trainer(config)
        try:
            assert trainer.train() == 0
        finally:
            trainer.close()
        saves = trainer.summary["checkpoint"]["saves"]
        assert [(r["step"], r["mode"], r["saved"]) for r in saves] == [
            (2, mode, True),
            (4, mode, True),
        ]
        store = S3CheckpointStore(f"s3://{bucket}/{mode}")
        assert store.latest_complete() == 4
        store.download(2, tmp_path / mode / "step-2")
        weights[mode] = load_params(tmp_path / mode / "step-2")
    for name, tensor in weights["sync"].items():
        assert torch.equal(tensor, weights["async"][name]), name
