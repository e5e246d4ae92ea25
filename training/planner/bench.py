"""``hetero bench``: measure this machine for the planner, and store the figures it prefers.

Two measurements, one after the other, each with the spec's model, batch, precision, recipe and
image size:

1. **Trainer samples/s** on this machine's device: the real ``Trainer`` in this process on
   synthetic in-memory batches (no input pipeline), ``--warmup`` steps left out. On a GPU machine
   it measures GPU 0; here, the CPU cores ``--trainer-cores`` with one torch thread per core.
2. **Data server images/s per vCPU** for the recipe: a real ``hetero serve`` process
   (``--server-cores``, one augmentation worker per core) streams ``--batches`` batches to a
   real ``DataPlaneClient`` in this process over loopback gRPC. The server's CPU-seconds
   (psutil, the process and its workers) give images/s per vCPU including its gRPC and
   serialisation work; this process's CPU-seconds give the trainer side's receive cost.
   With a prepared dataset (``source = "shards"``) the server reads its shards, and for one in
   S3 a third figure follows: **S3 read MB/s**, up to 8 whole shards downloaded into an empty
   cache by as many threads as the server has workers (``measure_shard_reads``), which
   ``hetero plan`` uses for that instance type instead of its bandwidth.

Results are keyed by instance type (``--instance-type``; ``imds`` asks the instance metadata
service at ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` or its default address) or else by the device
model (GPU name, or the CPU's model name and the core count), with the date and the versions,
and merged into the results store (``training.planner.results``): an entry with the same key is
replaced, others are kept. ``hetero plan`` then prefers them to its priors.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.common.files import write_atomically
from training.common.s3 import is_s3_uri
from training.data.shard_source import ShardImages
from training.data.transforms import encode_recipe
from training.dataplane.client import DataPlaneClient
from training.dataplane.processes import start_server_process
from training.launcher.imds import ImdsClient, ImdsError, endpoint_from_env
from training.planner import priors
from training.planner.errors import PlanError
from training.planner.results import (
    RESULTS_DIR,
    THROUGHPUT_FILE,
    THROUGHPUT_FORMAT,
    read_throughput,
)
from training.planner.workload import workload_from_spec
from training.spec import ClusterSpec, DatasetSource, load_spec
from training.trainer.config import TrainerConfig
from training.trainer.train import Trainer

log = logging.getLogger(__name__)

SOURCE = "hetero bench"


@dataclass(frozen=True)
class TrainerFigure:
    samples_per_s: float
    step_time_s: float
    measured_steps: int
    device: str
    threads: int


@dataclass(frozen=True)
class DataprepFigure:
    images_per_s_per_vcpu: float
    """Server process CPU: decode, augment, serialise, send."""
    receive_images_per_s_per_vcpu: float
    """Client process CPU: receive and unpack (the trainer host's share)."""
    images_per_s_per_server: float
    """Delivered (wall clock) to one otherwise idle client: the server's pipeline limit."""
    images: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", default="cluster.toml", help="cluster spec (TOML)")
    parser.add_argument(
        "--out",
        default=str(RESULTS_DIR / THROUGHPUT_FILE),
        help="results store to merge into (default: %(default)s, where hetero plan reads)",
    )
    parser.add_argument(
        "--trainer-cores", help="CPU cores for the trainer, e.g. '0' or '0-3' (default: all)"
    )
    parser.add_argument(
        "--server-cores", help="CPU cores for the data server, one worker each (default: all)"
    )
    parser.add_argument("--steps", type=int, default=30, help="timed trainer steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed trainer steps first")
    parser.add_argument("--batches", type=int, default=60, help="timed data-server batches")
    parser.add_argument(
        "--instance-type",
        help="key the results by this instance type ('imds': ask the instance metadata "
        "service); default: by the device model",
    )
    parser.add_argument(
        "--only", choices=["trainer", "dataprep"], help="measure one of the two (default: both)"
    )


def parse_cores(text: str | None, flag: str) -> list[int]:
    """``"0,2-3"`` -> [0, 2, 3]; None -> every core this process may use. Cores outside this
    process's affinity are an error that lists the usable ones."""
    usable = sorted(os.sched_getaffinity(0))
    if text is None:
        return usable
    cores: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise PlanError(f"{flag} {text!r}: expected core numbers like '0' or '0-3'") from None
    bad = sorted(cores - set(usable))
    if not cores or bad:
        raise PlanError(f"{flag} {text!r}: cores {bad or '(none)'} are not usable; use {usable}")
    return sorted(cores)


@contextlib.contextmanager
def pinned(cores: Sequence[int]) -> Iterator[None]:
    """This process (and children started meanwhile, which inherit it) on ``cores``."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextlib.contextmanager
def thread_environ(threads: int) -> Iterator[None]:
    """``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` for children started meanwhile."""
    keys = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
    before = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: str(threads) for k in keys})
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_model(name: str) -> str:
    """torch's device name as the planner's GPU table names it (``NVIDIA A10G`` -> ``A10G``,
    ``NVIDIA H100 80GB HBM3`` -> ``H100``), so a result keys the same GPU on other types."""
    for model in sorted(priors.GPU_PEAKS, key=len, reverse=True):
        if model.lower() in name.lower():
            return model
    return name


def versions() -> dict[str, str]:
    import grpc
    import timm
    import torch

    out = {
        "torch": torch.__version__,
        "timm": timm.__version__,
        "grpc": grpc.__version__,
        "python": platform.python_version(),
    }
    cuda = getattr(torch.version, "cuda", None)
    if cuda and torch.cuda.is_available():
        out["cuda"] = cuda
    return out


def bench_spec(spec: ClusterSpec, warmup: int, steps: int) -> ClusterSpec:
    """The spec's job for ``warmup + steps`` steps, the warm-up as the first metrics interval
    (the trainer's summary leaves it out), no periodic checkpoint."""
    job = spec.job
    return dataclasses.replace(
        spec,
        job=dataclasses.replace(
            job,
            steps=warmup + steps,
            epochs=None,
            log_every_steps=warmup,
            checkpoint=dataclasses.replace(job.checkpoint, interval_steps=1 << 30),
        ),
    )


def measure_trainer(
    spec: ClusterSpec, cores: Sequence[int], warmup: int, steps: int
) -> TrainerFigure:
    """The real Trainer on synthetic batches, in this process, pinned to ``cores``."""
    import torch

    cuda = torch.cuda.is_available()
    threads = torch.get_num_threads()
    torch.set_num_threads(len(cores))
    try:
        with tempfile.TemporaryDirectory(prefix="hetero-bench-") as tmp, pinned(cores):
            config = TrainerConfig.from_spec(
                bench_spec(spec, warmup, steps),
                run_dir=Path(tmp) / "run",
                checkpoint_dir=Path(tmp) / "checkpoints",
                synthetic=True,
                emf=False,
            )
            trainer = Trainer(config)
            try:
                trainer.train()
            finally:
                trainer.close()
            summary = dict(trainer.summary)
    finally:
        torch.set_num_threads(threads)
    if not summary.get("measured_steps"):
        raise PlanError(f"the trainer measured no steady-state steps; raise --steps ({summary})")
    device = gpu_model(torch.cuda.get_device_name(0)) if cuda else f"{cpu_model()} x{len(cores)}"
    return TrainerFigure(
        samples_per_s=float(summary["samples_per_s"]),
        step_time_s=float(summary["step_time_s"]),
        measured_steps=int(summary["measured_steps"]),
        device=device,
        threads=len(cores),
    )


def _tree_cpu_s(pid: int) -> float:
    """User + system CPU-seconds of process ``pid`` and its live descendants."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def measure_dataprep(
    spec_path: Path,
    spec: ClusterSpec,
    cores: Sequence[int],
    batches: int,
    client_cores: Sequence[int] | None = None,
) -> DataprepFigure:
    """One data server on ``cores`` streaming to a client here (on ``client_cores``: where the
    trainer would run), with the spec's reorder window, range size and streams; CPU per image
    on each side, after a warm-up that fills the window."""
    job = spec.job
    dp = job.dataplane
    warmup = dp.prefetch_batches + 4
    with pinned(cores), thread_environ(1):
        server = start_server_process(spec_path, workers=len(cores), timeout_s=120.0)
    try:
        with (
            pinned(client_cores or sorted(os.sched_getaffinity(0))),
            DataPlaneClient(
                [server.address],
                batch_size=job.batch_size,
                prefetch_batches=dp.prefetch_batches,
                chunk_batches=dp.chunk_batches,
                streams_per_server=dp.streams_per_server,
                recipe=encode_recipe(job.augmentation),
                image_size=job.dataset.image_size,
            ) as client,
        ):
            client.wait_for_servers(timeout_s=60.0, settle_s=0.0)
            if client.num_samples < job.batch_size:
                raise PlanError(
                    f"the dataset has {client.num_samples} samples, fewer than one batch"
                )
            seen = 0
            start: tuple[float, float, float] | None = None
            epoch = 0
            while seen < warmup + batches:
                for batch in client.iter_epoch(epoch):
                    seen += 1
                    if seen == warmup:
                        start = (
                            time.perf_counter(),
                            time.process_time(),
                            _tree_cpu_s(server.process.pid),
                        )
                    if seen >= warmup + batches:
                        break
                    del batch
                epoch += 1
            end = (time.perf_counter(), time.process_time(), _tree_cpu_s(server.process.pid))
            client.shutdown_servers()
    except BaseException:
        server.process.kill()  # Nothing left behind when the measurement fails.
        raise
    finally:
        server.stop(timeout_s=10.0)
    assert start is not None
    images = batches * job.batch_size
    wall, client_cpu, server_cpu = (e - s for e, s in zip(end, start, strict=True))
    if server_cpu <= 0 or client_cpu <= 0:
        raise PlanError("no CPU time was measured; raise --batches")
    return DataprepFigure(
        images_per_s_per_vcpu=images / server_cpu,
        receive_images_per_s_per_vcpu=images / client_cpu,
        images_per_s_per_server=images / wall,
        images=images,
    )


SHARD_READ_SAMPLE = 8
"""Shards ``measure_shard_reads`` downloads at most."""


@dataclass(frozen=True)
class ShardReadFigure:
    bytes_per_s: float
    bytes: int
    shards: int
    seconds: float


def measure_shard_reads(
    spec: ClusterSpec, threads: int, *, max_shards: int = SHARD_READ_SAMPLE, client: Any = None
) -> ShardReadFigure | None:
    """A prepared dataset in S3 read as a data server's ``threads`` workers read it in an epoch
    that is not cached: up to ``max_shards`` whole shards of the training split, ``threads`` at a
    time, into an empty cache (the server's own download and checksum); None when the spec's
    dataset is not prepared shards in S3."""
    from concurrent.futures import ThreadPoolExecutor

    dataset = spec.job.dataset
    if dataset.source is not DatasetSource.SHARDS or not is_s3_uri(dataset.path or ""):
        return None
    assert dataset.path is not None
    with tempfile.TemporaryDirectory(prefix="hetero-bench-shards-") as cache:
        source = ShardImages(
            dataset.path, "train", expected_sha256=dataset.manifest_sha256, cache_dir=cache,
            client=client,
        )  # fmt: skip
        shards = source.index.shards[:max_shards]
        started = time.perf_counter()
        with ThreadPoolExecutor(max(1, threads)) as pool:
            list(pool.map(lambda s: source.cache.get(s, source._download), shards))
        seconds = time.perf_counter() - started
    total = sum(s.bytes for s in shards)
    return ShardReadFigure(total / seconds, total, len(shards), seconds)


def planned_params(spec: ClusterSpec) -> int | None:
    """The parameter count the planner computes for the spec's model (what it matches results
    on), or None for a model it cannot size."""
    try:
        return workload_from_spec(spec).params
    except PlanError:
        return None


def instance_type_from(arg: str | None) -> str | None:
    """``--instance-type``: the type given, the one IMDS reports for ``imds``, or None."""
    if arg != "imds":
        return arg

    try:
        found = ImdsClient(endpoint_from_env(os.environ)).get("/latest/meta-data/instance-type")
    except ImdsError as e:
        raise PlanError(f"--instance-type imds: the instance metadata service failed ({e})") from e
    if not found:
        raise PlanError("--instance-type imds: no instance type in the metadata; give it")
    return found


def common_fields(spec: ClusterSpec, instance_type: str | None, source: str) -> dict[str, Any]:
    """What every entry of one bench run shares: its key's instance type, the image size, the
    date, the versions and the command that measured it."""
    return {
        "instance_type": instance_type,
        "image_size": spec.job.dataset.image_size,
        "date": datetime.date.today().isoformat(),
        "versions": versions(),
        "source": source,
    }


def trainer_record(spec: ClusterSpec, t: TrainerFigure, common: dict[str, Any]) -> dict[str, Any]:
    """The results store's trainer entry for ``t`` measured with ``spec``'s job."""
    job = spec.job
    return {
        **common,
        "device": t.device,
        "model": job.model.name,
        "overrides": dict(job.model.overrides),
        "params": planned_params(spec),
        "batch_size": job.batch_size,
        "precision": job.precision.value,
        "threads": t.threads,
        "samples_per_s_per_device": t.samples_per_s,
        "measured_steps": t.measured_steps,
    }


def dataprep_record(
    spec: ClusterSpec,
    d: DataprepFigure,
    cores: Sequence[int],
    common: dict[str, Any],
    reads: ShardReadFigure | None = None,
) -> dict[str, Any]:
    """The results store's data-server entry for ``d``, measured on ``cores`` (one worker
    each) with ``spec``'s recipe and dataset."""
    job = spec.job
    return {
        **common,
        "device": f"{cpu_model()} x{len(cores)}",
        "recipe": job.augmentation.describe(),
        "dataset": job.dataset.source.value,
        "images_per_s_per_vcpu": d.images_per_s_per_vcpu,
        "receive_images_per_s_per_vcpu": d.receive_images_per_s_per_vcpu,
        "images_per_s_per_server": d.images_per_s_per_server,
        "server_workers": len(cores),
        "images": d.images,
        **({"shard_read_mb_per_s": reads.bytes_per_s / 1e6} if reads is not None else {}),
    }


def merge(store: Path, trainer: list[dict[str, Any]], dataprep: list[dict[str, Any]]) -> None:
    """Write the entries into ``store``, replacing any with the same key; atomically."""
    data: dict[str, Any] = {"format": THROUGHPUT_FORMAT, "results": [], "dataprep": []}
    if store.exists():
        try:
            data = json.loads(store.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PlanError(f"{store}: not readable JSON ({e}); fix or move it") from e
        if not isinstance(data, dict) or data.get("format") != THROUGHPUT_FORMAT:
            raise PlanError(f'{store}: not a results store ("format": "{THROUGHPUT_FORMAT}")')

    def key(e: dict[str, Any], fields: Sequence[str]) -> tuple[Any, ...]:
        return tuple(e.get(f) for f in fields)

    for name, new, fields in (
        ("results", trainer, ("instance_type", "device", "model", "image_size", "precision")),
        ("dataprep", dataprep, ("instance_type", "device", "recipe", "image_size")),
    ):
        replaced = {key(e, fields) for e in new}
        kept = [e for e in data.get(name, []) if key(e, fields) not in replaced]
        data[name] = kept + new
    write_atomically(store, json.dumps(data, indent=2) + "\n")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except PlanError as e:
        print(f"hetero bench: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    for flag, value in (
        ("--steps", args.steps),
        ("--warmup", args.warmup),
        ("--batches", args.batches),
    ):
        if value < 1:
            raise PlanError(f"{flag} must be at least 1, got {value}")
    spec_path = Path(args.spec)
    spec = load_spec(spec_path)
    job = spec.job
    trainer_cores = parse_cores(args.trainer_cores, "--trainer-cores")
    server_cores = parse_cores(args.server_cores, "--server-cores")
    instance_type = instance_type_from(args.instance_type)
    common = common_fields(spec, instance_type, f"{SOURCE} --spec {spec_path.name}")
    trainer_entries: list[dict[str, Any]] = []
    dataprep_entries: list[dict[str, Any]] = []
    if args.only in (None, "trainer"):
        print(
            f"trainer: {job.model.name} batch {job.batch_size} {job.precision.value} on cores "
            f"{trainer_cores}, {args.warmup} + {args.steps} steps ...",
            flush=True,
        )
        t = measure_trainer(spec, trainer_cores, args.warmup, args.steps)
        print(
            f"  {t.samples_per_s:.1f} samples/s ({t.step_time_s * 1e3:.1f} ms per step) "
            f"on {t.device}",
            flush=True,
        )
        trainer_entries.append(trainer_record(spec, t, common))
    if args.only in (None, "dataprep"):
        print(
            f"data server: {job.augmentation.describe()} at {job.dataset.image_size} px on cores "
            f"{server_cores}, {args.batches} batches ...",
            flush=True,
        )
        d = measure_dataprep(spec_path, spec, server_cores, args.batches, trainer_cores)
        print(
            f"  {d.images_per_s_per_vcpu:.1f} images/s per vCPU (server), receive "
            f"{d.receive_images_per_s_per_vcpu:.0f} images/s per vCPU (client), delivered "
            f"{d.images_per_s_per_server:.1f} images/s",
            flush=True,
        )
        reads = measure_shard_reads(spec, len(server_cores))
        if reads is not None:
            print(
                f"  read {reads.shards} shards ({reads.bytes / 1e6:.0f} MB) from S3 in "
                f"{reads.seconds:.1f} s: {reads.bytes_per_s / 1e6:.0f} MB/s",
                flush=True,
            )
        dataprep_entries.append(dataprep_record(spec, d, server_cores, common, reads))
    store = Path(args.out)
    merge(store, trainer_entries, dataprep_entries)
    read_throughput(store)  # What was written reads back (a malformed store is an error).
    print(f"-> {store}")
    return 0
