"""Guardrails people attach to the accounts they deploy to, evaluated on every recorded call with
the context AWS sends (``iam_context``): which calls each would deny, so that docs/security.md
can say what limits the project needs. Each is a service control policy over the account
(beside ``FullAWSAccess``, as AWS Organizations attaches it by default)."""

from __future__ import annotations

from typing import Any

import aws_calls
import pytest
from iam_check import REGION, Stack, requests, simulate, simulation
from iam_docs import build_stack, policies_of

FULL_ACCESS = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
}
GLOBAL_SERVICES = ["cloudfront:*", "iam:*", "route53:*", "support:*"]
"""The ``NotAction`` of AWS's example "Denies access to AWS based on the requested Region"
(https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_policies_examples_aws_deny-requested-region.html)."""


def region_guardrail(regions: list[str], exempt: list[str]) -> dict[str, Any]:
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "DenyAllOutsideRequestedRegions",
                "Effect": "Deny",
                "NotAction": exempt,
                "Resource": "*",
                "Condition": {"StringNotEquals": {"aws:RequestedRegion": regions}},
            }
        ],
    }


def max_size_guardrail(limit: int) -> dict[str, Any]:
    """Deny setting an Auto Scaling group's size above ``limit`` instances (a cost guard)."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "DenyGroupsAboveTheLimit",
                "Effect": "Deny",
                "Action": [
                    "autoscaling:CreateAutoScalingGroup",
                    "autoscaling:UpdateAutoScalingGroup",
                    "autoscaling:PutScheduledUpdateGroupAction",
                ],
                "Resource": "*",
                "Condition": {"NumericGreaterThan": {"autoscaling:MaxSize": str(limit)}},
            }
        ],
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    return build_stack(tmp_path_factory.mktemp("iam-guardrails"))


def denied_by(guardrail: dict[str, Any], stack: Stack) -> set[tuple[str, str, str]]:
    """(principal, action, the call's parameters) of every recorded request the guardrail
    denies; every request is allowed without it (test_iam_calls)."""
    calls = aws_calls.load()
    pairs = [(c, r) for c in calls for r in requests(c, stack)]
    scps = [
        {
            "orgIdentifier": "r-root",
            "policies": [
                {"name": "FullAWSAccess", "policy": FULL_ACCESS},
                {"name": "Guardrail", "policy": guardrail},
            ],
        }
    ]
    sims = [
        {
            **simulation(c["principal"], r, policies_of(c["principal"], calls, stack), stack),
            "serviceControlPolicies": scps,
        }
        for c, r in pairs
    ]
    return {
        (c["principal"], r.action, c["operation"] + " " + str(sorted(c["params"].items())))
        for (c, r), result in zip(pairs, simulate(sims), strict=True)
        if result["result"] != "Allowed"
    }


def test_the_region_guardrail_denies_only_the_price_list_calls(stack: Stack) -> None:
    """With the cluster's region only, AWS's example denies the Price List API, whose one
    endpoint region (us-east-1) is not the cluster's: `hetero job start` and `sagemaker submit`
    price their jobs there. Exempting ``pricing:*`` as a global service is all it takes."""
    denied = denied_by(region_guardrail([REGION], GLOBAL_SERVICES), stack)
    assert {(p, a) for p, a, _ in denied} == {("user", "pricing:GetProducts")}, denied
    assert denied_by(region_guardrail([REGION], [*GLOBAL_SERVICES, "pricing:*"]), stack) == set()


def test_a_size_guardrail_denies_the_job_start_above_its_limit(stack: Stack) -> None:
    """`hetero job start` sets each group's MaxSize to what the job needs (2 in the evaluated
    spec: two trainers, an elastic dataprep group of at most two); the budget's backstop sets it
    to 0. A guardrail below that denies exactly the start's updates."""
    denied = denied_by(max_size_guardrail(1), stack)
    assert denied and {(p, a) for p, a, _ in denied} == {
        ("user", "autoscaling:UpdateAutoScalingGroup")
    }, denied
    assert all("('MaxSize', 2)" in params for *_, params in denied), denied
    assert denied_by(max_size_guardrail(2), stack) == set()
