"""``hetero job start`` with ``job.model.init = "timm:NAME.TAG"`` against moto (SSM, S3, Auto
Scaling), the Hugging Face cache written by the test and offline (``tests/hub_cache.py``): the
files are uploaded once to ``<checkpoint prefix>/init/<sha256>/`` (a second start uploads
nothing), the pointer names that folder beside the spec's value, and the EC2 launcher hands it
to the trainer only when the pointer's init is its spec's."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aws_calls
import pytest
from hub_cache import INIT, HubCache, offline_hub, write_hub_cache

from training.cli import main
from training.common.jobparam import JobPointer, parse_job_pointer, read_job_pointer
from training.common.names import ENV_CHECKPOINT_URI, ENV_INIT_URI
from training.launcher.backends import PLACES, Backend
from training.launcher.ec2_start import staged_init
from training.launcher.group import GroupIdentity, GroupSource
from training.launcher.peers import local_peers
from training.launcher.plan import make_plan
from training.spec import load_spec
from training.workstation.jobstart import JobStartError

from .conftest import CLUSTER_TOML
from .test_launcher_jobstart import NAME, REGION, aws, keys, start  # noqa: F401 (aws: a fixture)

FILES = ("config.json", "model.safetensors")
SPEC = CLUSTER_TOML + f'\n[job.model]\nname = "vit-cpu-tiny"\ninit = "{INIT}"\n'


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HubCache:
    """vit_tiny_patch16_224 at its own size: 22.9 MB of weights, so boto3 uploads them in parts
    (its multipart threshold is 8 MB), as it does real weights."""
    cache = write_hub_cache(tmp_path / "hf", img_size=224)
    offline_hub(monkeypatch, cache.root)
    return cache


def digest_of(snapshot: Path) -> str:
    """sha256 of the files' names, sizes and bytes, in name order."""
    digest = hashlib.sha256()
    for name in FILES:
        data = (snapshot / name).read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()


def test_a_timm_init_is_staged_once_at_its_content_address_and_the_pointer_names_it(
    aws: dict[str, Any],  # noqa: F811
    hub: HubCache,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    record_aws_calls: Callable[..., Path],
) -> None:
    record_aws_calls(aws_calls.Names(cluster="vit-test", checkpoint_bucket="ckpt"))
    path = tmp_path / "cluster.toml"
    path.write_text(SPEC)
    args = ["job", "start", "--spec", str(path), "--fresh", "--region", REGION]
    assert main([*args, "--offline-prices"]) == 0
    pointer = read_job_pointer(aws["ssm"], NAME)
    folder = f"checkpoints/init/{digest_of(hub.snapshot)}/"
    assert (pointer.init, pointer.init_uri) == (INIT, f"s3://ckpt/{folder}")
    staged = {k: v for k, v in keys(aws["s3"]).items() if k.startswith("checkpoints/init/")}
    assert staged == {folder + n: (hub.snapshot / n).read_bytes() for n in FILES}
    size = sum(len(v) for v in staged.values())
    out = capsys.readouterr().out.splitlines()
    assert out[2] == (
        f"job.model.init: {INIT} -> s3://ckpt/{folder} (uploaded now ({size / 1e6:.1f} MB))"
    )

    # The next start (the groups run now: --force) finds the files there and uploads nothing.
    operations: list[str] = []
    aws["s3"].meta.events.register(
        "before-call.s3.*", lambda model, **_: operations.append(model.name)
    )
    again = start(aws, load_spec(path), force=True)
    assert again.init is not None and again.init.uploaded == ()
    assert again.pointer.init_uri == pointer.init_uri
    assert operations.count("HeadObject") == 2  # each file found, with its size
    assert {"PutObject", "CreateMultipartUpload", "UploadPart"}.isdisjoint(operations)
    assert read_job_pointer(aws["ssm"], NAME).init_uri == pointer.init_uri


def test_an_init_the_cache_lacks_is_refused_before_anything_changes(
    aws: dict[str, Any],  # noqa: F811
    hub: HubCache,
    tmp_path: Path,
) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(SPEC.replace(INIT, "timm:vit_tiny_patch16_224.augreg_in21k"))
    before = read_job_pointer(aws["ssm"], NAME)
    with pytest.raises(
        JobStartError,
        match=r"^job\.model\.init = 'timm:vit_tiny_patch16_224\."
        r"augreg_in21k': config\.json of .* is not in the Hugging Face cache",
    ):
        start(aws, load_spec(path))
    assert read_job_pointer(aws["ssm"], NAME) == before
    assert not [k for k in keys(aws["s3"]) if "/init/" in k]


def test_the_launcher_hands_the_staged_copy_to_the_trainer_only_for_its_own_init(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(SPEC)
    spec = load_spec(path)
    uri = "s3://ckpt/checkpoints/init/" + "ab" * 32 + "/"
    pointer = JobPointer("j-1", "s3://ckpt/checkpoints/j-1/", init=INIT, init_uri=uri)
    assert parse_job_pointer(pointer.to_json()) == pointer
    assert staged_init(pointer, spec) == uri
    other = JobPointer("j-1", pointer.checkpoint_uri, init="timm:vit_small.x", init_uri=uri)
    with caplog.at_level(logging.WARNING, logger="training.launcher.ec2_start"):
        assert staged_init(other, spec) is None
    assert "staged job.model.init 'timm:vit_small.x'" in caplog.text
    assert staged_init(JobPointer("j-1", pointer.checkpoint_uri), spec) is None
    identity = GroupIdentity("trainer", GroupSource.EC2, host="10.0.0.5", cluster="vit-test")
    plan = make_plan(
        spec, spec_path=str(path), identity=identity, place=PLACES[Backend.EC2],
        found_peers=local_peers(spec), run_dir=str(tmp_path / "run"),
        environ={ENV_CHECKPOINT_URI: pointer.checkpoint_uri, ENV_INIT_URI: uri},
    )  # fmt: skip
    ((_, trainer),) = plan.commands
    assert trainer.env[ENV_INIT_URI] == uri


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"init": INIT}, "init and init_uri go together"),
        ({"init": INIT, "init_uri": "/local/folder/"}, "init_uri must be an s3:// URI"),
    ],
)
def test_a_pointer_with_half_an_init_is_refused(value: dict[str, str], problem: str) -> None:
    text = JobPointer("j-1", "s3://ckpt/checkpoints/j-1/").to_json()[:-1]
    extra = ", ".join(f'"{k}": "{v}"' for k, v in value.items())
    with pytest.raises(ValueError, match=problem):
        parse_job_pointer(text + ", " + extra + "}")
