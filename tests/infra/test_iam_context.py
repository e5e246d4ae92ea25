"""Every recorded request is evaluated with the context AWS sends for it (``iam_context``): each
condition key the Service Authorization Reference documents for its action is in the request,
or sent by AWS only for a parameter the call does not set (``WHEN_SET``), or listed in
``NOT_SENT`` with the reason; and the simulator ignores none of the keys given (a key that does
not apply to the action is a mistake in the map, not context). The instance role's calls go
through the network stack's VPC endpoints, and the user policy grants AWS's public parameters by
the ARN AWS gives them."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aws_calls
import iam_context
import pytest
from iam_check import ACCOUNT, REGION, Request, Stack, requests, simulate, simulation
from iam_docs import build_stack, policies_of, user_policies

KEYS_SCRIPT = Path(__file__).resolve().parent / "iam_keys.mjs"

WHEN_SET: dict[str, str] = {
    "s3:prefix": "Prefix",
    "s3:delimiter": "Delimiter",
    "s3:max-keys": "MaxKeys",
    "autoscaling:MinSize": "MinSize",
    "autoscaling:MaxSize": "MaxSize",
    "ssm:Overwrite": "Overwrite",
    "sagemaker:VpcSubnets": "VpcConfig",
    "sagemaker:VpcSecurityGroupIds": "VpcConfig",
    "sagemaker:NetworkIsolation": "EnableNetworkIsolation",
    "sagemaker:InterContainerTrafficEncryption": "EnableInterContainerTrafficEncryption",
    "sagemaker:VolumeKmsKeyArn": "ResourceConfig.VolumeKmsKeyId",
    "sagemaker:KeepAlivePeriod": "ResourceConfig.KeepAlivePeriodInSeconds",
    "sagemaker:EnableRemoteDebug": "RemoteDebugConfig",
    "aws:RequestTag/": "Tags",
    "aws:TagKeys": "Tags",
}
"""A key AWS sends only when the request sets this parameter (dotted: nested); the record keeps
each of them (tests/aws_calls.py ``KEPT_PARAMS``), so a call that sets one is seen here."""

_HEADERS = (
    "a header of the same name, which none of the project's S3 calls sets (no ACLs, grants, "
    "object lock, storage class, SSE headers, website redirects, conditional writes, copy "
    "directives or object tags: the buckets' defaults apply)"
)
NOT_SENT: dict[str, str] = {
    # S3: keys of request headers the project never sends.
    **{
        f"s3:{k}": _HEADERS
        for k in (
            "x-amz-acl",
            "x-amz-grant-full-control",
            "x-amz-grant-read",
            "x-amz-grant-read-acp",
            "x-amz-grant-write",
            "x-amz-grant-write-acp",
            "x-amz-copy-source",
            "x-amz-metadata-directive",
            "x-amz-object-annotation-directive",
            "x-amz-server-side-encryption",
            "x-amz-server-side-encryption-aws-kms-key-id",
            "x-amz-server-side-encryption-customer-algorithm",
            "x-amz-storage-class",
            "x-amz-website-redirect-location",
            "object-lock-event-hold",
            "object-lock-event-hold-duration-days",
            "object-lock-legal-hold",
            "object-lock-mode",
            "object-lock-remaining-retention-days",
            "object-lock-retain-until-date",
            "if-match",
            "if-none-match",
            "RequestObjectTag/",
            "RequestObjectTagKeys",
        )
    },
    "s3:ExistingObjectTag/": "the project's objects carry no tags",
    "s3:AccessGrantsInstanceArn": "sent for requests through S3 Access Grants; none is used",
    "s3:ObjectCreationOperation": "not modelled: a guardrail on how objects are created would "
    "see PutObject, CopyObject and multipart uploads, all of which the record holds as "
    "s3:PutObject on the same keys",
    "s3:TlsVersion": "the TLS version botocore negotiates (1.2 or 1.3, the host's OpenSSL), "
    "not known here; a guardrail requiring at least 1.2 holds for both",
    "s3:signatureAge": "milliseconds since the request was signed: different for each request",
    "s3:x-amz-content-sha256": "the payload hash header botocore computes for each request",
    # Auto Scaling: the project's group updates set sizes only.
    **{
        f"autoscaling:{k}": "sent when UpdateAutoScalingGroup changes the group's launch "
        "template, instance types, capacity reservations or subnets; the project's updates set "
        "sizes only"
        for k in (
            "CapacityReservationIds",
            "CapacityReservationResourceGroupArns",
            "ImageId",
            "InstanceTypes",
            "LaunchConfigurationName",
            "LaunchTemplateVersionSpecified",
            "TargetCapacityTypes",
            "VPCZoneIdentifiers",
        )
    },
    "ssm:Policies": "parameter policies (expiration, notifications): the job pointer has none",
    # SageMaker: features the heterogeneous job does not use.
    **{
        f"sagemaker:{k}": "an input from EFS or FSx for Lustre: the job's inputs are S3"
        for k in (
            "FileSystemAccessMode",
            "FileSystemDirectoryPath",
            "FileSystemId",
            "FileSystemType",
        )
    },
    "sagemaker:DirectGatedModelAccess": "gated model access (JumpStart): not used",
    "sagemaker:OutputKmsKeyArn": "sent with OutputDataConfig.KmsKeyId, which `hetero sagemaker "
    "submit` never sets (the output is encrypted with SageMaker's default key); the record "
    "drops OutputDataConfig, whose path holds the job's name",
}
"""Keys the reference documents for an action that AWS does not send for these calls (or whose
value cannot be known here), each with the reason."""

FOREIGN_TAGS = "the parameter is not the stack's (the CDK bootstrap's, AWS's public ones)"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    return build_stack(tmp_path_factory.mktemp("iam-context"))


def documented_keys(actions: list[str]) -> dict[str, set[str]]:
    """Each action's condition keys, its own and its resource types' (``iam_keys.mjs``)."""
    proc = subprocess.run(
        ["node", str(KEYS_SCRIPT)], input=json.dumps(actions), capture_output=True, text=True,
        cwd=Path(__file__).resolve().parents[2], timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout)
    return {
        a: set(k["action"]) | {key for keys in k["resources"].values() for key in keys}
        for a, k in found.items()
    }


def _stem(key: str) -> str:
    """``aws:ResourceTag/${TagKey}`` -> ``aws:ResourceTag/`` (a key with a variable part)."""
    return re.split(r"\$\{|<", key, maxsplit=1)[0]


def _has_param(params: Mapping[str, Any], dotted: str) -> bool:
    node: Any = params
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def missing_keys(call: Mapping[str, Any], request: Request, documented: set[str]) -> list[str]:
    """The documented keys that ``request`` lacks without a reason."""
    missing = []
    for key in sorted(documented):
        stem = _stem(key)
        given = any(k == key or (stem != key and k.startswith(stem)) for k in request.context)
        if given or stem in NOT_SENT:
            continue
        if stem in WHEN_SET and not _has_param(call["params"], WHEN_SET[stem]):
            continue
        if stem == "aws:ResourceTag/" and request.resource.startswith(
            ("arn:aws:ssm:", "arn:aws:cloudformation:")
        ):
            continue  # FOREIGN_TAGS (a stack parameter of ours would carry its tags: checked)
        missing.append(key)
    return missing


def test_every_request_carries_the_keys_its_action_documents(stack: Stack) -> None:
    calls = aws_calls.load()
    pairs = [(c, r) for c in calls for r in requests(c, stack)]
    documented = documented_keys(sorted({r.action for _, r in pairs}))
    lacking = sorted(
        {
            f"{r.action} ({c['principal']} {c['operation']}): {key}"
            for c, r in pairs
            for key in missing_keys(c, r, documented[r.action])
        }
    )
    assert not lacking, (
        "documented condition keys the evaluated request lacks (add them in iam_context.py, or "
        "to NOT_SENT / WHEN_SET with the reason):\n" + "\n".join(lacking)
    )


def test_the_job_pointer_is_evaluated_with_its_tags(stack: Stack) -> None:
    """The stack's own parameter carries its tags in the request (``FOREIGN_TAGS`` only exempts
    the bootstrap's and AWS's)."""
    call = {
        "principal": "instance", "service": "ssm", "operation": "GetParameter",
        "params": {"Name": "/hetero/{cluster}/job"},
    }  # fmt: skip
    (request,) = requests(call, stack)
    assert request.context["aws:ResourceTag/hetero:cluster"] == stack.cluster


def test_the_simulator_ignores_no_key_it_is_given(stack: Stack) -> None:
    """A key that does not apply to the action is filtered out before the evaluation: a policy
    conditioned on it would behave differently in AWS than here."""
    calls = aws_calls.load()
    pairs = [(c, r) for c in calls for r in requests(c, stack)]
    sims = [simulation(c["principal"], r, policies_of(c["principal"], calls, stack), stack)
            for c, r in pairs]  # fmt: skip
    ignored = sorted(
        {f"{r.action}: {k}" for (_, r), res in zip(pairs, simulate(sims), strict=True)
         for k in res["ignored"]}
    )  # fmt: skip
    assert not ignored, "keys the simulator ignored:\n" + "\n".join(ignored)


def test_every_instance_and_sagemaker_call_goes_through_a_vpc_endpoint(stack: Stack) -> None:
    """The instances, and the SageMaker job's containers in the cluster's isolated subnet, have
    no route out but the endpoints: each of their requests carries its endpoint
    (``aws:SourceVpce``); without the endpoint, the request cannot be made."""
    inside = [c for c in aws_calls.load() if c["principal"] in ("instance", "sagemaker")]
    assert {c["principal"] for c in inside} == {"instance", "sagemaker"}
    services = {c["service"] for c in inside}
    assert services <= set(stack.endpoints), services - set(stack.endpoints)
    for call in inside:
        for request in requests(call, stack):
            assert request.context["aws:SourceVpce"] == stack.endpoints[call["service"]]
            assert request.context["aws:SourceVpc"] == iam_context.VPC
    gone = dataclasses.replace(
        stack, endpoints={k: v for k, v in stack.endpoints.items() if k != "autoscaling"}
    )
    call = next(c for c in inside if c["service"] == "autoscaling")
    with pytest.raises(iam_context.NoRoute, match="no VPC endpoint for it"):
        requests(call, gone)
    no_s3 = dataclasses.replace(
        stack, endpoints={k: v for k, v in stack.endpoints.items() if k != "s3"}
    )
    call = next(c for c in inside if c["principal"] == "sagemaker")
    with pytest.raises(iam_context.NoRoute, match="the sagemaker role calls s3"):
        requests(call, no_s3)


def test_price_list_calls_are_requested_in_the_price_list_region(stack: Stack) -> None:
    pricing = [c for c in aws_calls.load() if c["service"] == "pricing"]
    assert pricing
    regions = {r.context["aws:RequestedRegion"] for c in pricing for r in requests(c, stack)}
    assert regions == {"us-east-1"} != {REGION}


def _iam_match(pattern: str, value: str) -> bool:
    """IAM's ARN wildcards: ``*`` any run of characters (none included), ``?`` one."""
    regex = "".join(".*" if ch == "*" else "." if ch == "?" else re.escape(ch) for ch in pattern)
    return re.fullmatch(regex, value) is not None


def test_the_user_policy_grants_aws_public_parameters_by_aws_own_arn(stack: Stack) -> None:
    """AWS's public parameters have no account in their ARN, which the simulator cannot match
    (it evaluates them with one): the statement must match AWS's form too."""
    calls = aws_calls.load()
    names = [n for c in calls if c["operation"] == "GetParameters" for n in c["params"]["Names"]]
    assert names and all(n.startswith("/aws/service/") for n in names)
    (policy,) = user_policies(calls, stack)
    statements = [s for s in policy["policy"]["Statement"] if s["Action"] == "ssm:GetParameters"]
    (statement,) = statements
    for name in names:
        aws_arn = f"arn:aws:ssm:{REGION}::parameter{name}"
        assert _iam_match(statement["Resource"], aws_arn), (statement["Resource"], aws_arn)
        assert _iam_match(statement["Resource"], f"arn:aws:ssm:{REGION}:{ACCOUNT}:parameter{name}")
