"""Every AWS call the project makes is allowed by the role the stack gives its process, and every
action a role grants is needed by some call (or is listed with the program outside this project
that uses it).

The calls are ``tests/aws_calls.json``, recorded from the rehearsals, the user-side commands, the
SageMaker path and a local run with an S3 dataset (``tests/aws_calls.py``); the roles are those of
the synthesized cluster stack of ``SPEC``; the evaluator is ``@cloud-copilot/iam-simulate``
(``iam_check.py``). The mutation test takes each action out of each statement in turn and needs
a recorded call to be denied without it, so an unused grant fails here too.
"""

from __future__ import annotations

import copy
import json
from collections import defaultdict
from typing import Any

import aws_calls
import pytest
from iam_check import (
    Request,
    Stack,
    granted,
    principal_arn,
    requests,
    simulate,
    simulation,
    without_action,
)
from iam_docs import (
    BEGIN,
    DOC,
    END,
    ROLE_PRINCIPALS,
    USER_POLICY,
    allowed_by,
    build_stack,
    policies_of,
    replace_section,
    section,
    user_policies,
)

# Grants that no process of this project uses: another program on the instance, or SageMaker
# itself, acts with the role. Each needs its reason; the test fails when one is no longer granted.
_ECR_PULL = (
    "docker pulls the image at boot: the ECR credential helper (docker-credential-ecr-login) "
    "gets the registry token, the Docker daemon the layers (infra/instance_group.py)"
)
_ECR_ACTIONS = (
    "ecr:GetAuthorizationToken",
    "ecr:BatchCheckLayerAvailability",
    "ecr:BatchGetImage",
    "ecr:GetDownloadUrlForLayer",
)
OUTSIDE_CODE: dict[tuple[str, str], str] = {
    **{("instance", a): _ECR_PULL for a in _ECR_ACTIONS},
    **{
        ("instance", a): "Docker's awslogs log driver sends the container's output to the "
        "cluster's log group (infra/instance_group.py, docker run --log-driver awslogs)"
        for a in ("logs:CreateLogStream", "logs:PutLogEvents")
    },
    **{
        ("instance", a): "the SSM agent, for Session Manager: AWS's minimal Session Manager "
        "policy (https://docs.aws.amazon.com/systems-manager/latest/userguide/"
        "getting-started-create-iam-instance-profile.html)"
        for a in (
            "ssm:UpdateInstanceInformation",
            "ssmmessages:CreateControlChannel",
            "ssmmessages:CreateDataChannel",
            "ssmmessages:OpenControlChannel",
            "ssmmessages:OpenDataChannel",
        )
    },
    **{
        ("sagemaker", a): "SageMaker pulls the job's image with the execution role"
        for a in _ECR_ACTIONS
    },
}
# Statements of the execution role that SageMaker itself uses, whatever their actions
# (https://docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-roles.html): an action such as
# s3:GetObject is also the trainer's, on checkpoints/, in another statement.
SAGEMAKER_STATEMENTS = {
    "SageMakerJobOutput": "SageMaker uploads the job's output under sagemaker/<job>/output/",
    "SageMakerJobSpec": "SageMaker downloads the spec channel, sagemaker/<job>/spec/",
    "SageMakerJobListing": "SageMaker lists the spec channel",
    "TrainingJobLogs": "SageMaker writes the job's logs to /aws/sagemaker/TrainingJobs",
    "SageMakerJobMetrics": "SageMaker publishes the job's metrics",
    "VpcNetworkInterfaces": "SageMaker places the job's network interfaces in the subnet",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    return build_stack(tmp_path_factory.mktemp("iam"))


@pytest.fixture(scope="module")
def recorded() -> dict[str, list[dict[str, Any]]]:
    by_principal: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for call in aws_calls.load():
        by_principal[call["principal"]].append(call)
    return by_principal


def _why(principal: str, call: dict[str, Any], request: Request, policies: list[Any]) -> str:
    statements = [sid for _, _, sid, action in granted(policies) if action == request.action]
    where = "infra/cluster.py" if principal in ROLE_PRINCIPALS else str(USER_POLICY)
    change = (
        f"statement(s) {', '.join(sorted(set(statements)))} grant {request.action} but not on "
        "this resource or not under these conditions: widen the one meant for it"
        if statements
        else f"no statement grants {request.action}: add it to the {principal} policy ({where})"
    )
    return (
        f"{call['service']}:{call['operation']} {json.dumps(call['params'], sort_keys=True)} "
        f"by {principal_arn(principal)} needs {request.action} on {request.resource} "
        f"{dict(request.context)}: {change}"
    )


def test_every_recorded_call_is_allowed_for_its_principal(stack: Stack) -> None:
    """The instance role and the SageMaker execution role as the stack makes them, and the
    user's policy as a person applies it (``infra/policies/user-policy.json``); each call against
    its principal's policies and, on the checkpoint bucket, the bucket policy."""
    calls = aws_calls.load()
    assert {c["principal"] for c in calls} == {"instance", "sagemaker", "user"}
    denied = [
        f"{result['result']}: "
        + _why(call["principal"], call, request, policies_of(call["principal"], calls, stack))
        for call, request, result in allowed_by(calls, stack)
        if result["result"] != "Allowed"
    ]
    assert not denied, "\n".join(denied)


def test_every_action_a_role_or_the_user_policy_grants_is_needed_by_a_recorded_call(
    stack: Stack, recorded: dict[str, list[dict[str, Any]]]
) -> None:
    """Take each action out of each statement in turn (the roles', the user policy file's):
    some recorded call must then be denied, unless the grant is listed in ``OUTSIDE_CODE`` with
    the program that uses it. So dropping any statement of the user policy fails here too."""
    mutants: list[tuple[str, str, str, int]] = []  # principal, statement, action, first sim
    sims: list[dict[str, Any]] = []
    for principal in (*ROLE_PRINCIPALS, "user"):
        policies = policies_of(principal, aws_calls.load(), stack)
        pairs = [(c, r) for c in recorded[principal] for r in requests(c, stack)]
        for p, s, sid, action in granted(policies):
            if (principal, action) in OUTSIDE_CODE or (
                principal == "sagemaker" and sid in SAGEMAKER_STATEMENTS
            ):
                continue
            mutated = without_action(policies, p, s, action)
            affected = [r for _, r in pairs if r.action == action]
            mutants.append((principal, sid, action, len(sims)))
            sims += [simulation(principal, r, mutated, stack) for r in affected]
    results = simulate(sims)
    bounds = [m[3] for m in mutants[1:]] + [len(sims)]
    surviving = [
        f"{principal}: {action} in statement {sid}"
        for (principal, sid, action, start), end in zip(mutants, bounds, strict=True)
        if all(r["result"] == "Allowed" for r in results[start:end])
    ]
    assert not surviving, (
        "granted, but no recorded call is denied without it (remove the grant, or list it in "
        "OUTSIDE_CODE with the program that uses it):\n" + "\n".join(surviving)
    )


def test_every_resource_of_the_user_policy_is_needed_by_a_recorded_call(
    stack: Stack, recorded: dict[str, list[dict[str, Any]]]
) -> None:
    """A statement of several resources: take each resource out in turn; some recorded call of
    the user must then be denied (no resource is there for nothing)."""
    policies = user_policies(aws_calls.load(), stack)
    requests_of_user = [r for c in recorded["user"] for r in requests(c, stack)]
    mutants: list[tuple[str, str, int]] = []
    sims: list[dict[str, Any]] = []
    for s, statement in enumerate(policies[0]["policy"]["Statement"]):
        resources = statement["Resource"]
        for resource in resources if isinstance(resources, list) else []:
            mutated = copy.deepcopy(policies)
            mutated[0]["policy"]["Statement"][s]["Resource"] = [
                r for r in resources if r != resource
            ]
            mutants.append((statement["Sid"], resource, len(sims)))
            sims += [simulation("user", r, mutated, stack) for r in requests_of_user]
    assert mutants, "the user policy has no statement of several resources to check"
    results = simulate(sims)
    bounds = [m[2] for m in mutants[1:]] + [len(sims)]
    surviving = [
        f"{resource} in statement {sid}"
        for (sid, resource, start), end in zip(mutants, bounds, strict=True)
        if all(r["result"] == "Allowed" for r in results[start:end])
    ]
    assert not surviving, "in the user policy, but no recorded call needs it:\n" + "\n".join(
        surviving
    )


def test_grants_listed_as_used_outside_the_code_are_granted(stack: Stack) -> None:
    granted_now = {(p, a) for p in ROLE_PRINCIPALS for *_, a in granted(stack.roles[p])}
    stale = sorted(set(OUTSIDE_CODE) - granted_now)
    assert not stale, f"listed in OUTSIDE_CODE but no longer granted: {stale}"
    sids = {sid for p in ROLE_PRINCIPALS for _, _, sid, _ in granted(stack.roles[p])}
    assert sids >= set(SAGEMAKER_STATEMENTS)


def _has(calls: list[dict[str, Any]], operation: str, **params: Any) -> bool:
    return any(
        c["operation"] == operation and all(c["params"].get(k) == v for k, v in params.items())
        for c in calls
    )


def test_the_record_covers_every_path_that_calls_aws(
    recorded: dict[str, list[dict[str, Any]]],
) -> None:
    instance = recorded["instance"]
    job = "checkpoints/{job}/"
    wanted = {
        # The elastic data tier (the controller on the trainer's rank 0).
        "elastic: DescribeAutoScalingGroups": _has(instance, "DescribeAutoScalingGroups"),
        "elastic: SetDesiredCapacity": _has(
            instance, "SetDesiredCapacity", AutoScalingGroupName="{cluster}-dataprep"
        ),
        # Spot: a termination's lifecycle hook, the terminating instances, a replacement.
        "spot: CompleteLifecycleAction": _has(instance, "CompleteLifecycleAction"),
        "spot: DescribeAutoScalingInstances": _has(instance, "DescribeAutoScalingInstances"),
        # Job end and the budget stop: every group to zero.
        "job end: UpdateAutoScalingGroup to 0": _has(
            instance,
            "UpdateAutoScalingGroup",
            AutoScalingGroupName="{cluster}-trainer",
            DesiredCapacity=0,
        ),
        # The budget's backstop: every group to zero at the deadline, deleted at job end.
        "budget backstop: PutScheduledUpdateGroupAction": _has(
            instance,
            "PutScheduledUpdateGroupAction",
            AutoScalingGroupName="{cluster}-trainer",
            ScheduledActionName="hetero-budget-deadline-{cluster}-trainer",
            MaxSize=0,
        ),
        "budget backstop: DeleteScheduledAction": _has(
            instance, "DeleteScheduledAction", AutoScalingGroupName="{cluster}-dataprep"
        ),
        "job record": _has(instance, "PutObject", Key=job + "job/outcome.json"),
        # The boot watch: instances that shut themselves down.
        "boot watch": any(
            c["operation"] == "DescribeInstances"
            and {"Name": "state-reason-code", "Values": ["Client.InstanceInitiatedShutdown"]}
            in c["params"].get("Filters", [])
            for c in instance
        ),
        "early exit: SetInstanceHealth": _has(instance, "SetInstanceHealth"),
        "job pointer": _has(instance, "GetParameter", Name="/hetero/{cluster}/job"),
        # A deploy's job: its first host prices Spot (training/costs/deploy_prices.py).
        "deploy job's Spot prices": _has(instance, "DescribeSpotPriceHistory"),
        "dataset reads": _has(instance, "GetObject", Bucket="{dataset}"),
        "SageMaker: checkpoints": any(
            c["operation"] == "PutObject" and c["params"]["Key"].startswith("checkpoints/")
            for c in recorded["sagemaker"]
        ),
        "user: sagemaker submit": _has(recorded["user"], "CreateTrainingJob"),
        # Its job.max_usd at SageMaker's own prices; --resume reads the earlier job.
        "user: sagemaker submit's prices": _has(
            recorded["user"], "GetProducts", ServiceCode="AmazonSageMaker"
        ),
        "user: sagemaker submit --resume": _has(recorded["user"], "DescribeTrainingJob"),
        "user: job start": _has(recorded["user"], "PutParameter"),
        # The new job's prices: Spot in the groups' AZ, On-Demand from the Price List API.
        "user: job start's Spot prices": _has(recorded["user"], "DescribeSpotPriceHistory"),
        "user: job start's On-Demand prices": _has(
            recorded["user"], "GetProducts", ServiceCode="AmazonEC2"
        ),
    }
    missing = sorted(name for name, found in wanted.items() if not found)
    assert not missing, f"not in {aws_calls.RECORD.name}: {missing}"


def test_every_recorded_call_maps_to_iam_actions_the_reference_knows(stack: Stack) -> None:
    """Each call's actions, resources and condition keys pass the simulator's validation
    against the Service Authorization Reference (an unknown action or a resource of the wrong
    type is an error, not a denial)."""
    calls = aws_calls.load()
    sims = [simulation(c["principal"], r, [], stack) for c in calls for r in requests(c, stack)]
    errors = [
        (s["request"]["action"], s["request"]["resource"]["resource"], r["errors"])
        for s, r in zip(sims, simulate(sims), strict=True)
        if r["result"] == "Error"
    ]
    assert not errors, errors


def test_the_security_doc_holds_the_policy_and_tables_the_record_makes(stack: Stack) -> None:
    document = DOC.read_text()
    assert BEGIN in document and END in document
    assert replace_section(document, section(stack)) == document, (
        f"{DOC.name}'s generated section is out of date: .venv/bin/python tests/infra/iam_docs.py"
    )
