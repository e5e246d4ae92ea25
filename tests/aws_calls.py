"""The record of every AWS call the project makes: ``tests/aws_calls.json``, checked in.

Tests that run the project's processes against moto (the rehearsals, the user-side commands,
the SageMaker path, a local run with an S3 dataset) switch the recorder on
(``training.common.call_log``) through the ``record_aws_calls`` fixture (tests/conftest.py).
When such a test ends, the calls its processes made are normalized and compared with the file:
a call that is not in it fails the test with the command that adds it
(``HETERO_UPDATE_AWS_CALLS=1``; ``make aws-calls`` rebuilds the whole file). ``tests/infra``
evaluates every call in the file against the roles of the synthesized stacks
(``tests/infra/iam_check.py``).

Normalized: the names a test chose become placeholders, so one call is one line whatever the
run: ``{cluster}`` (the spec's name), ``{checkpoints}`` (the checkpoint bucket), ``{dataset}``
(the dataset's bucket) and ``{dataset_root}`` (its key prefix), ``{init}`` (the bucket of an
``s3://`` ``job.model.init`` copied into the checkpoint bucket, training/common/s3_init.py),
``{instance}`` (an instance id), ``{n}`` (a number in a key, a prefix or a job name: steps,
ranks, shards), a key's job folder under ``checkpoints/`` becomes ``{job}``, a sha256 in a
key (a staged init's folder, ``checkpoints/init/<sha256>/``) ``{digest}``, and a TensorBoard
event file's name after ``events.out.tfevents.`` (its time and host) ``{host}``. Parameters that
decide neither resource nor condition (sizes, checksums, tokens) go.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import tempfile
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.common.call_log import ENV_CALL_LOG

RECORD = Path(__file__).resolve().parent / "aws_calls.json"
ENV_UPDATE = "HETERO_UPDATE_AWS_CALLS"
UPDATE_COMMAND = "make aws-calls  (or HETERO_UPDATE_AWS_CALLS=1 pytest <the test>)"

# Parameters that name a resource or set a condition key; every other parameter is dropped.
KEPT_PARAMS = frozenset(
    {
        "Bucket", "Key", "Prefix", "Delimiter", "VersionId", "CopySource",
        "AutoScalingGroupName", "AutoScalingGroupNames", "InstanceId", "InstanceIds",
        "LifecycleHookName", "ShouldDecrementDesiredCapacity", "HealthStatus",
        "ScheduledActionName",
        "DesiredCapacity", "MinSize", "MaxSize",
        "Filters", "Name", "Names", "Overwrite", "Type", "Path",
        "Namespace", "StackName", "TrainingJobName", "RoleArn", "logGroupName",
        "InstanceTypes", "ProductDescriptions", "ServiceCode", "QuotaCode", "LocationType",
        # CreateTrainingJob's condition keys (sagemaker:InstanceTypes, MaxRuntimeInSeconds,
        # VpcSubnets, NetworkIsolation, EnableRemoteDebug, aws:RequestTag...).
        "ResourceConfig", "StoppingCondition", "VpcConfig", "EnableNetworkIsolation",
        "EnableInterContainerTrafficEncryption", "RemoteDebugConfig", "Tags",
    }
)  # fmt: skip
# Parameters whose numbers are counters (steps, ranks, shards, a job name's time), not names.
NUMBERED = frozenset({"Key", "Prefix", "TrainingJobName"})
_INSTANCE = re.compile(r"\bi-[0-9a-f]{8,17}\b")
_NUMBER = re.compile(r"\d+")
# The job ids of training.common.jobparam: a deploy's and a `hetero job start`'s.
_JOB_ID = re.compile(r"\b(?:d-[0-9a-f]{12}|j-\d{8}T\d{6}-[0-9a-z]+)\b")
_PLACEHOLDER = re.compile(r"(\{[a-z_]+\})")
# A job's folder under checkpoints/ (not init/: staged timm: inits, training/common/timm_hub.py;
# nor tensorboard/, the jobs' event files: training/trainer/tensorboard_log.py).
_JOB_FOLDER = re.compile(
    r"^(checkpoints/(?:sagemaker/)?)(?!init/|tensorboard/|sagemaker/)[^/{]+(/|$)"
)
# A TensorBoard event file's name: its time, the host's name, a pid and a counter.
_EVENTS = re.compile(r"(?<=/)events\.out\.tfevents\.[^/]+$")
_SHA256 = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")


@dataclass(frozen=True)
class Names:
    """The names a test chose, which the record holds as placeholders."""

    cluster: str
    checkpoint_bucket: str | None = None
    dataset: str | None = None
    """``s3://bucket/root/`` of an S3 dataset the processes read, if any."""
    init_bucket: str | None = None
    """The bucket of an ``s3://`` ``job.model.init`` the user's commands copy from, if any."""

    def bucket(self, name: str) -> str:
        dataset_bucket = (
            self.dataset.removeprefix("s3://").partition("/")[0] if self.dataset else None
        )
        placeholders = {
            self.init_bucket: "{init}",
            dataset_bucket: "{dataset}",
            self.checkpoint_bucket: "{checkpoints}",
        }
        return placeholders.get(name, name)

    def key(self, key: str) -> str:
        """A key or prefix: the dataset's root and a job folder under ``checkpoints/``."""
        root = self.dataset.removeprefix("s3://").partition("/")[2] if self.dataset else ""
        if root and key.startswith(root):
            return "{dataset_root}/" + key[len(root) :]
        key = _EVENTS.sub("events.out.tfevents.{host}", _SHA256.sub("{digest}", key))
        return _JOB_ID.sub("{job}", _JOB_FOLDER.sub(r"\1{job}\2", key))


def _text(value: str, names: Names, numbered: bool) -> str:
    value = re.sub(
        rf"(?<![A-Za-z0-9]){re.escape(names.cluster)}(?![A-Za-z0-9])", "{cluster}", value
    )
    value = _INSTANCE.sub("{instance}", value)
    if not numbered:
        return value
    parts = _PLACEHOLDER.split(value)  # numbers outside the placeholders put in
    return "".join(p if _PLACEHOLDER.fullmatch(p) else _NUMBER.sub("{n}", p) for p in parts)


def _normalize(value: Any, names: Names, numbered: bool = False) -> Any:
    if isinstance(value, str):
        return _text(value, names, numbered)
    if isinstance(value, list):  # distinct values, in a stable order
        items = {json.dumps(_normalize(v, names, numbered), sort_keys=True) for v in value}
        return [json.loads(item) for item in sorted(items)]
    if isinstance(value, dict):
        return {k: _normalize(v, names, numbered or k in NUMBERED) for k, v in value.items()}
    return value


def normalize(line: Mapping[str, Any], names: Names) -> dict[str, Any]:
    """One recorded call as the record holds it."""
    params = dict(line["params"])
    if line["operation"] == "DeleteObjects":  # the keys are the resources
        params["Key"] = [o["Key"] for o in params.pop("Delete", {}).get("Objects", [])]
    kept = {k: v for k, v in params.items() if k in KEPT_PARAMS}
    source = kept.get("CopySource")
    if isinstance(source, str):  # "bucket/key", as CopyObject also takes it
        bucket, _, source_key = source.partition("/")
        source = kept["CopySource"] = {"Bucket": bucket, "Key": source_key}
    for where in (kept, source or {}):
        if "Bucket" in where:
            where["Bucket"] = names.bucket(where["Bucket"])
        if isinstance(where.get("Key"), str):
            where["Key"] = names.key(where["Key"])
    if isinstance(kept.get("Prefix"), str):
        kept["Prefix"] = names.key(kept["Prefix"])
    if isinstance(kept.get("Key"), list):
        kept["Key"] = [names.key(k) for k in kept["Key"]]
    return {
        "principal": line["principal"],
        "service": line["service"],
        "operation": line["operation"],
        "params": _normalize(kept, names),
    }


def key(call: Mapping[str, Any]) -> str:
    return json.dumps(call, sort_keys=True)


def read_log(folder: Path) -> Iterator[dict[str, Any]]:
    """Every call recorded under ``folder`` (``<pid>.jsonl`` files of the recorder)."""
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        for line in path.read_text().splitlines():
            if line.strip():
                yield json.loads(line)


def load() -> list[dict[str, Any]]:
    return json.loads(RECORD.read_text()) if RECORD.exists() else []


def save(calls: Iterable[Mapping[str, Any]]) -> None:
    unique = {key(c): dict(c) for c in calls}
    text = json.dumps([unique[k] for k in sorted(unique)], indent=1, sort_keys=True) + "\n"
    tmp = RECORD.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(RECORD)


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    with open(Path(tempfile.gettempdir()) / "hetero-aws-calls.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def check(folder: Path, names: Names) -> list[dict[str, Any]]:
    """The normalized calls recorded under ``folder``; raise ``AssertionError`` naming each one
    the checked-in record lacks (or, with ``HETERO_UPDATE_AWS_CALLS=1``, add them to it)."""
    calls = {key(c): c for c in (normalize(line, names) for line in read_log(folder))}
    if not calls:
        raise AssertionError(
            f"no AWS call was recorded under {folder}: does {ENV_CALL_LOG} reach the processes?"
        )
    if os.environ.get(ENV_UPDATE) == "1":
        with _locked():
            save([*load(), *calls.values()])
        return list(calls.values())
    known = {key(c) for c in load()}
    new = [k for k in sorted(calls) if k not in known]
    if new:
        raise AssertionError(
            f"{len(new)} AWS call(s) not in {RECORD.name}; each must be proven allowed "
            f"(tests/infra/test_iam_calls.py). Add them with: {UPDATE_COMMAND}\n" + "\n".join(new)
        )
    return list(calls.values())


def rehearsal_names(spec_path: Path) -> Names:
    """The names ``hetero rehearse`` gives a spec's emulated cluster (training/rehearsal/aws.py:
    the checkpoint bucket is ``<name>-checkpoints``)."""
    cluster = tomllib.loads(spec_path.read_text())["name"]
    return Names(cluster=cluster, checkpoint_bucket=f"{cluster}-checkpoints")


def recording_env(folder: Path) -> dict[str, str]:
    """The environment that switches the recorder on in a process and the processes it starts."""
    return {ENV_CALL_LOG: str(folder)}
