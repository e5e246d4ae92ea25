"""The account's set-up: AWS credentials, the AMI parameters and the CDK bootstrap stack."""

from __future__ import annotations

from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from botocore.parsers import ResponseParserError

from training.common.names import DATAPREP_AMI_PARAMETER, TRAINER_AMI_PARAMETER
from training.preflight.core import AWS_ERRORS, Check, Status, _code, failure
from training.spec import ClusterSpec, Role

CDK_BOOTSTRAP_STACK = "CDKToolkit"
# The default bootstrap qualifier (cdk.json sets no "@aws-cdk/core:bootstrapQualifier"). Every
# synthesized template carries a CheckBootstrapVersion rule that reads this parameter and refuses
# versions 1-5 ("CDK bootstrap stack version 6 required"), as `npx cdk synth` of this app shows.
CDK_BOOTSTRAP_VERSION_PARAMETER = "/cdk-bootstrap/hnb659fds/version"
CDK_MIN_BOOTSTRAP_VERSION = 6


def check_ami_parameters(spec: ClusterSpec, ssm: Any, region: str) -> list[Check]:
    """The public AMI parameters the spec's roles use resolve in the region (one row each)."""
    wanted = {Role.TRAINER: TRAINER_AMI_PARAMETER, Role.DATAPREP: DATAPREP_AMI_PARAMETER}
    roles = [r for r in (Role.TRAINER, Role.DATAPREP) if any(g.role is r for g in spec.groups)]
    names = [wanted[r] for r in roles]
    try:
        reply = ssm.get_parameters(Names=names)
    except AWS_ERRORS as e:
        return [failure("AMI parameters", e)]
    values = {p["Name"]: p.get("Value", "") for p in reply.get("Parameters", [])}
    invalid = set(reply.get("InvalidParameters", []))
    rows = []
    for role, param in zip(roles, names, strict=True):
        name = f"AMI parameter ({role.value})"
        if param in values and param not in invalid:
            rows.append(Check(name, Status.PASS, f"{param} = {values[param]}"))
        else:
            rows.append(
                Check(
                    name,
                    Status.FAIL,
                    f"{param} does not resolve in {region}",
                    f"choose a region where the public parameter exists (aws ssm get-parameters "
                    f"--names {param} --region REGION), or change the parameter in "
                    "training/common/names.py (used by infra)",
                )
            )
    return rows


def check_cdk_bootstrap(cloudformation: Any, ssm: Any, account: str, region: str) -> list[Check]:
    """The CDKToolkit stack exists in a usable state, and its version is one the templates
    accept."""
    bootstrap = f"npx cdk bootstrap aws://{account}/{region}"
    rows: list[Check] = []
    try:
        stacks = cloudformation.describe_stacks(StackName=CDK_BOOTSTRAP_STACK).get("Stacks", [])
        status = stacks[0]["StackStatus"] if stacks else "NONE"
    except ClientError as e:
        if _code(e) == "ValidationError" and "does not exist" in str(e):
            status = "NONE"
        else:
            return [failure("CDK bootstrap stack", e)]
    except (BotoCoreError, ResponseParserError) as e:
        return [failure("CDK bootstrap stack", e)]
    if status == "NONE":
        return [
            Check(
                "CDK bootstrap stack",
                Status.FAIL,
                f"no {CDK_BOOTSTRAP_STACK} stack in {account}/{region}",
                f"run `{bootstrap}` (once per account and region)",
            )
        ]
    if status in ("DELETE_COMPLETE", "ROLLBACK_COMPLETE"):
        rows.append(
            Check(
                "CDK bootstrap stack",
                Status.FAIL,
                f"{CDK_BOOTSTRAP_STACK} is {status} (unusable)",
                f"aws cloudformation delete-stack --stack-name {CDK_BOOTSTRAP_STACK} "
                f"--region {region}, then `{bootstrap}`",
            )
        )
    elif not status.endswith("_COMPLETE"):
        rows.append(
            Check(
                "CDK bootstrap stack",
                Status.FAIL,
                f"{CDK_BOOTSTRAP_STACK} is {status}",
                "wait for the stack operation to finish"
                if status.endswith("_IN_PROGRESS")
                else f"see its events in the CloudFormation console, then `{bootstrap}`",
            )
        )
    else:
        rows.append(Check("CDK bootstrap stack", Status.PASS, f"{CDK_BOOTSTRAP_STACK} {status}"))

    name = "CDK bootstrap version"
    try:
        raw = ssm.get_parameter(Name=CDK_BOOTSTRAP_VERSION_PARAMETER)["Parameter"]["Value"]
    except ClientError as e:
        if _code(e) == "ParameterNotFound":
            rows.append(
                Check(
                    name,
                    Status.FAIL,
                    f"{CDK_BOOTSTRAP_VERSION_PARAMETER} does not exist",
                    f"run `{bootstrap}` (the stack was bootstrapped with a custom qualifier or "
                    "is incomplete)",
                )
            )
        else:
            rows.append(failure(name, e))
        return rows
    except (BotoCoreError, ResponseParserError) as e:
        rows.append(failure(name, e))
        return rows
    version = int(raw) if str(raw).isdigit() else -1
    detail = f"{CDK_BOOTSTRAP_VERSION_PARAMETER} = {raw} (templates need >= "
    detail += f"{CDK_MIN_BOOTSTRAP_VERSION})"
    if version >= CDK_MIN_BOOTSTRAP_VERSION:
        rows.append(Check(name, Status.PASS, detail))
    else:
        rows.append(
            Check(name, Status.FAIL, detail, f"run `{bootstrap}` with this repo's pinned CLI")
        )
    return rows


def check_credentials(sts: Any) -> tuple[Check, str | None]:
    """Who the checks run as; without working credentials no other check can run."""
    try:
        me = sts.get_caller_identity()
    except AWS_ERRORS as e:
        return failure("AWS credentials", e), None
    account = str(me["Account"])
    return Check("AWS credentials", Status.PASS, f"{me['Arn']} (account {account})"), account
