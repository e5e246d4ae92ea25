"""The request context AWS sends with each recorded call, beside the keys ``iam_check.requests``
sets for its resource: what a guardrail (a service control policy, a permission boundary, a
condition in a policy) sees in AWS and so must see here.

- Every request: ``aws:RequestedRegion`` (the region the call is sent to: the cluster's, but the
  Price List API's own for ``pricing``, ``training.prices.PRICING_REGION``) and
  ``aws:SecureTransport`` (botocore speaks HTTPS to every endpoint).
- The instance role's requests go through the network stack's VPC endpoints (the instances have
  no other route out): ``aws:SourceVpc`` and ``aws:SourceVpce`` of the endpoint for the call's
  service (``global-condition-keys``: present when the request comes through a VPC endpoint).
  A call to a service with no endpoint could never leave the instance: ``NoRoute``.
- Auto Scaling: the group's tags as ``autoscaling:ResourceTag/...`` too, and the sizes a request
  sets (``autoscaling:MinSize``, ``autoscaling:MaxSize``).
- S3: ``s3:ResourceAccount`` (the bucket's owner), ``s3:authType`` and ``s3:signatureversion``
  (botocore signs with SigV4 in the Authorization header).
- EC2 describes: ``ec2:Region``. SSM: the parameter's tags (``aws:ResourceTag/...``) and
  ``ssm:Overwrite``.
- SageMaker ``CreateTrainingJob``: its instance types, run time limit, network isolation,
  inter-container encryption and VPC; ``iam:PassRole``: the job it is passed for
  (``iam:AssociatedResourceArn``).

The keys come from the Service Authorization Reference (``iam_keys.mjs`` lists each action's);
``tests/infra/test_iam_context.py`` checks that every documented key is either here or in
``NOT_SENT`` with the reason AWS does not send it for these calls.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from training.prices import PRICING_REGION

VPC = "vpc-0123456789abcdef0"
ENDPOINT_SERVICES = {"ecr.api": "ecr", "ecr.dkr": "ecr"}
"""An endpoint's service name (after ``com.amazonaws.<region>.``) as botocore's service name,
where they differ."""


class NoRoute(AssertionError):
    """An instance call to a service the network has no VPC endpoint for."""


def endpoint_id(logical_id: str) -> str:
    """A stand-in ``vpce-`` id for the endpoint of ``logical_id`` (stable across runs)."""
    return "vpce-" + hashlib.sha256(logical_id.encode()).hexdigest()[:17]


def vpc_endpoints(network: Mapping[str, Any], region: str) -> dict[str, str]:
    """botocore service name -> the ``vpce-`` id of its endpoint in the network template."""
    out: dict[str, str] = {}
    for lid, res in network["Resources"].items():
        if res["Type"] != "AWS::EC2::VPCEndpoint":
            continue
        name = res["Properties"]["ServiceName"]
        if isinstance(name, dict):  # Fn::Join ["", ["com.amazonaws.", {Ref: AWS::Region}, ".x"]]
            sep, parts = name["Fn::Join"]
            name = sep.join(region if isinstance(p, dict) else str(p) for p in parts)
        service = str(name).removeprefix(f"com.amazonaws.{region}.")
        out[ENDPOINT_SERVICES.get(service, service)] = endpoint_id(lid)
    return out


IN_THE_VPC = ("instance", "sagemaker")


def common(
    service: str, principal: str, *, region: str, endpoints: Mapping[str, str]
) -> dict[str, str]:
    """The keys every request of ``service`` by ``principal`` carries."""
    requested = PRICING_REGION if service == "pricing" else region
    keys = {"aws:RequestedRegion": requested, "aws:SecureTransport": "true"}
    # The instances and the SageMaker job's containers (VpcConfig: the cluster's isolated
    # subnet) have no route out but the network's endpoints.
    if principal in IN_THE_VPC:
        if service not in endpoints:
            raise NoRoute(
                f"the {principal} role calls {service}, and the network has no VPC endpoint for "
                f"it (endpoints: {', '.join(sorted(endpoints))}): the call cannot leave the "
                "subnet; add one in infra/network.py"
            )
        keys |= {"aws:SourceVpc": VPC, "aws:SourceVpce": endpoints[service]}
    return keys


def autoscaling(params: Mapping[str, Any], tags: Mapping[str, str]) -> dict[str, str]:
    """A group request's keys: its tags under both prefixes, the sizes it sets."""
    keys = {f"aws:ResourceTag/{k}": v for k, v in tags.items()}
    keys |= {f"autoscaling:ResourceTag/{k}": v for k, v in tags.items()}
    for size in ("MinSize", "MaxSize"):
        if size in params:
            keys[f"autoscaling:{size}"] = str(params[size])
    return keys


def s3(account: str) -> dict[str, str]:
    return {
        "s3:ResourceAccount": account,
        "s3:authType": "REST-HEADER",
        "s3:signatureversion": "AWS4-HMAC-SHA256",
    }


def ssm(operation: str, params: Mapping[str, Any], tags: Mapping[str, str]) -> dict[str, str]:
    keys = {f"aws:ResourceTag/{k}": v for k, v in tags.items()}
    if operation == "PutParameter" and "Overwrite" in params:
        keys["ssm:Overwrite"] = str(bool(params["Overwrite"])).lower()
    return keys


def training_job(params: Mapping[str, Any]) -> dict[str, str | list[str]]:
    """``CreateTrainingJob``'s keys, from the parameters the record keeps."""
    resources = params.get("ResourceConfig", {})
    types = [g["InstanceType"] for g in resources.get("InstanceGroups", [])] or (
        [resources["InstanceType"]] if "InstanceType" in resources else []
    )
    keys: dict[str, str | list[str]] = {}
    if types:
        keys["sagemaker:InstanceTypes"] = sorted(set(types))
    stopping = params.get("StoppingCondition", {})
    if "MaxRuntimeInSeconds" in stopping:
        keys["sagemaker:MaxRuntimeInSeconds"] = str(stopping["MaxRuntimeInSeconds"])
    for param, key in (
        ("EnableNetworkIsolation", "sagemaker:NetworkIsolation"),
        ("EnableInterContainerTrafficEncryption", "sagemaker:InterContainerTrafficEncryption"),
    ):
        if param in params:
            keys[key] = str(bool(params[param])).lower()
    vpc = params.get("VpcConfig")
    if vpc:
        keys["sagemaker:VpcSubnets"] = list(vpc["Subnets"])
        keys["sagemaker:VpcSecurityGroupIds"] = list(vpc["SecurityGroupIds"])
    return keys
