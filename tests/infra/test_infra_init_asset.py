"""A ``timm:NAME.TAG`` init in the cluster stack (``infra/init_asset.py``), synthesized with the
Hugging Face cache written by the test and offline (``tests/hub_cache.py``): the asset holds
exactly the cache's ``config.json`` and ``model.safetensors``; the instance role, and no other,
may read that one object; the job pointer names it beside the spec's value; the trainer's read
of it is allowed by the IAM evaluator and a read of any other key is not; cdk-nag finds
nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cdk_nag import AwsSolutionsChecks
from hub_cache import INIT, HubCache, offline_hub, write_hub_cache
from iam_check import ACCOUNT, REGION, load_stack, requests, simulate, simulation
from infra_support import REPO_ROOT, SPOT_SPEC, BuiltApp, build, statements_by_role
from test_infra_synth import _env_without_aws

from training.common.jobparam import parse_job_pointer
from training.spec import SpecError

FILES = ("config.json", "model.safetensors")
SPEC = SPOT_SPEC.replace(
    "[job]\nsteps = 100\n", f'[job]\nsteps = 100\n\n[job.model]\ninit = "{INIT}"\n'
)
assert SPEC != SPOT_SPEC
ASSETS = "cdk-hnb659fds-assets-${AWS::AccountId}-${AWS::Region}"
"""The CDK bootstrap's file asset bucket (the default synthesizer's qualifier)."""


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubCache]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        cache = write_hub_cache(tmp_path_factory.mktemp("hf"))
        # Another file of the repository in the snapshot folder: not part of the asset.
        (cache.snapshot / "README.md").write_text("# a model card\n")
        offline_hub(monkeypatch, cache.root)
        yield cache


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, cached: HubCache) -> BuiltApp:
    built = build(tmp_path_factory.mktemp("init"), SPEC)
    built.app.synth()
    return built


def _asset(built: BuiltApp) -> tuple[str, dict[str, Any]]:
    """(hash, manifest entry) of the cluster stack's one zip file asset."""
    outdir = Path(built.app.outdir)
    manifest = json.loads((outdir / "vit-spot-cluster.assets.json").read_text())
    zips = [(h, a) for h, a in manifest["files"].items() if a["source"]["packaging"] == "zip"]
    assert len(zips) == 1, zips
    return zips[0]


def test_the_asset_is_the_caches_two_files(built: BuiltApp, cached: HubCache) -> None:
    digest, asset = _asset(built)
    staged = Path(built.app.outdir) / asset["source"]["path"]
    assert sorted(p.name for p in staged.iterdir()) == sorted(FILES)
    for name in FILES:  # the bytes, not the cache's links to its blobs
        assert not (staged / name).is_symlink()
        assert (staged / name).read_bytes() == (cached.snapshot / name).read_bytes()
    (destination,) = asset["destinations"].values()
    assert (destination["bucketName"], destination["objectKey"]) == (ASSETS, f"{digest}.zip")


def test_only_the_instance_role_may_read_it_and_only_it(built: BuiltApp) -> None:
    digest, _ = _asset(built)
    stack = built.stacks.cluster
    instance_role = stack.get_logical_id(stack.instance_role.role.node.default_child)  # type: ignore[arg-type]
    found = statements_by_role(built.cluster, lambda statement: ASSETS in json.dumps(statement))
    assert found == {
        instance_role: [
            {
                "Sid": "ReadInitWeights",
                "Action": "s3:GetObject",
                "Effect": "Allow",
                "Resource": {
                    "Fn::Join": [
                        "",
                        [
                            "arn:",
                            {"Ref": "AWS::Partition"},
                            ":s3:::",
                            {"Fn::Sub": ASSETS},
                            f"/{digest}.zip",
                        ],
                    ]
                },
            }
        ]
    }


def test_the_pointer_names_the_asset_beside_the_specs_value(built: BuiltApp) -> None:
    digest, _ = _asset(built)
    (parameter,) = built.cluster.find_resources("AWS::SSM::Parameter").values()
    pieces = parameter["Properties"]["Value"]["Fn::Join"][1]
    assert pieces[3] == {"Fn::Sub": f"s3://{ASSETS}/{digest}.zip"}
    assert pieces[2].endswith(f'"resumed_from": null, "init": "{INIT}", "init_uri": "')
    filled = f"{pieces[0]}ckpt{pieces[2]}s3://assets/{digest}.zip{pieces[4]}"
    pointer = parse_job_pointer(filled)
    assert (pointer.init, pointer.init_uri) == (INIT, f"s3://assets/{digest}.zip")
    assert built.stacks.cluster.init_weights is not None
    assert built.stacks.cluster.job.pointer.init == INIT


def test_the_trainers_read_is_allowed_and_no_other_key(built: BuiltApp) -> None:
    """What ``download_file`` of the pointer's ``init_uri`` sends (HeadObject, GetObject), by the
    instance role, through the IAM evaluator (``iam_check``)."""
    digest, _ = _asset(built)
    stack = load_stack(
        built.cluster.to_json(), cluster="vit-spot", dataset=None,
        network=built.network.to_json(),
    )  # fmt: skip
    bucket = f"cdk-hnb659fds-assets-{ACCOUNT}-{REGION}"
    reads = [
        (key, request)
        for key in (f"{digest}.zip", "another.zip")
        for op in ("HeadObject", "GetObject")
        for request in requests(
            {
                "principal": "instance",
                "service": "s3",
                "operation": op,
                "params": {"Bucket": bucket, "Key": key},
            },
            stack,
        )
    ]
    results = simulate(
        [simulation("instance", r, stack.roles["instance"], stack) for _, r in reads]
    )
    assert [(key, res["result"]) for (key, _), res in zip(reads, results, strict=True)] == [
        (f"{digest}.zip", "Allowed"),
        (f"{digest}.zip", "Allowed"),
        ("another.zip", "ImplicitlyDenied"),
        ("another.zip", "ImplicitlyDenied"),
    ]


def test_cdk_nag_finds_nothing_unacknowledged(built: BuiltApp) -> None:
    """The grant names one object: no wildcard for AwsSolutions-IAM5 to find."""
    report = AwsSolutionsChecks().validate_scope(built.app)
    assert [v.rule_name for v in report.violations] == []


def test_an_init_the_cache_lacks_stops_synth_with_the_fix(tmp_path: Path, cached: HubCache) -> None:
    missing = "timm:vit_tiny_patch16_224.augreg_in21k"
    (tmp_path / "built").mkdir()
    with pytest.raises(SpecError) as stopped:
        build(tmp_path / "built", SPEC.replace(INIT, missing))
    (problem,) = stopped.value.problems
    assert problem.startswith(
        f"job.model.init = {missing!r}: config.json of timm/vit_tiny_patch16_224.augreg_in21k "
        "is not in the Hugging Face cache"
    )
    # What `npx cdk synth -c spec=...` runs: app.py stops with the message, builds nothing.
    spec = tmp_path / "missing.toml"
    spec.write_text(SPEC.replace(INIT, missing))
    out = tmp_path / "cdk.out"
    env = {
        **_env_without_aws(tmp_path),
        "CDK_CONTEXT_JSON": json.dumps({"spec": str(spec)}),
        "CDK_OUTDIR": str(out),
    }
    result = subprocess.run(
        [sys.executable, "app.py"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"job.model.init = {missing!r}: config.json of" in result.stderr
    assert "(hf download timm/vit_tiny_patch16_224.augreg_in21k config.json" in result.stderr
    assert not list(out.glob("*.template.json"))
