"""The job pointer in the cluster stack: the SSM parameter's exact name and value, the one
statement that lets the instances read it, and its output."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import aws_cdk as cdk
import pytest
from aws_cdk.assertions import Template
from infra_support import SPOT_SPEC, BuiltApp, build, cdk_context, statements_by_role

from infra.job import JobParameter
from training.common.jobparam import parse_job_pointer


@pytest.fixture(scope="module")
def spot(tmp_path_factory: pytest.TempPathFactory) -> BuiltApp:
    return build(tmp_path_factory.mktemp("job"), SPOT_SPEC)


def _job_id(spec_text: str) -> str:
    return "d-" + hashlib.sha256(spec_text.encode()).hexdigest()[:12]


def _parameter(template: Template) -> tuple[str, dict[str, Any]]:
    (found,) = template.find_resources("AWS::SSM::Parameter").items()
    return found[0], dict(found[1]["Properties"])


def test_the_parameter_names_the_deployed_job_and_its_own_checkpoint_folder(
    spot: BuiltApp,
) -> None:
    _, props = _parameter(spot.cluster)
    bucket = spot.stacks.cluster.get_logical_id(
        spot.stacks.cluster.checkpoints.bucket.node.default_child  # type: ignore[arg-type]
    )
    job_id = _job_id(SPOT_SPEC)
    assert props["Name"] == "/hetero/vit-spot/job"
    assert (props["Type"], props["Tier"]) == ("String", "Standard")
    assert props["Value"] == {
        "Fn::Join": [
            "",
            [
                f'{{"job_id": "{job_id}", "checkpoint_uri": "s3://',
                {"Ref": bucket},
                f'/checkpoints/{job_id}/", "started": null, "resumed_from": null}}',
            ],
        ]
    }
    # With the bucket's name filled in, the value is a pointer the launcher accepts.
    pieces = props["Value"]["Fn::Join"][1]
    pointer = parse_job_pointer(pieces[0] + "ckpt-bucket" + pieces[2])
    assert (pointer.job_id, pointer.checkpoint_uri) == (
        job_id,
        f"s3://ckpt-bucket/checkpoints/{job_id}/",
    )
    assert (pointer.started, pointer.resumed_from) == (None, None)


def test_only_the_instance_role_may_read_it_and_only_it(spot: BuiltApp) -> None:
    param_lid, _ = _parameter(spot.cluster)
    stack = spot.stacks.cluster
    instance_role = stack.get_logical_id(stack.instance_role.role.node.default_child)  # type: ignore[arg-type]

    def reads_parameters(statement: dict[str, Any]) -> bool:
        # The SSM agent's ssm:UpdateInstanceInformation reads none.
        actions = statement["Action"]
        return any(
            a.startswith("ssm:GetParameter")
            for a in ([actions] if isinstance(actions, str) else actions)
        )

    ssm_statements = statements_by_role(spot.cluster, reads_parameters)
    assert ssm_statements == {
        instance_role: [
            {
                "Sid": "ReadJobPointer",
                "Action": "ssm:GetParameter",
                "Effect": "Allow",
                # Ref of an AWS::SSM::Parameter is its name, "/hetero/vit-spot/job".
                "Resource": {
                    "Fn::Join": [
                        "",
                        [
                            "arn:",
                            {"Ref": "AWS::Partition"},
                            ":ssm:",
                            {"Ref": "AWS::Region"},
                            ":",
                            {"Ref": "AWS::AccountId"},
                            ":parameter",
                            {"Ref": param_lid},
                        ],
                    ]
                },
            }
        ]
    }


def test_the_stack_outputs_the_parameter_name(spot: BuiltApp) -> None:
    output = spot.cluster.to_json()["Outputs"]["JobParameterName"]
    assert output["Value"] == "/hetero/vit-spot/job"
    assert spot.stacks.cluster.job.parameter_name == "/hetero/vit-spot/job"


def _value(spec_text: str) -> Any:
    """The parameter's value for ``spec_text`` in a bare stack (no cluster: fast)."""
    os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
    app = cdk.App(context=cdk_context())
    stack = cdk.Stack(app, "JobOnly")
    JobParameter(
        stack,
        "Job",
        cluster_name="vit-spot",
        spec_text=spec_text,
        checkpoint_base_uri="s3://fixed-bucket/checkpoints/",
    )
    _, props = _parameter(Template.from_stack(stack))
    return props["Value"]


def test_same_spec_same_value_changed_spec_a_fresh_job_in_a_new_folder() -> None:
    # CloudFormation updates a resource only when its properties change: the same spec gives
    # the identical value (no update, the current job stays), a changed one a new job.
    changed = SPOT_SPEC.replace("steps = 100", "steps = 200")
    assert changed != SPOT_SPEC
    first, again, other = _value(SPOT_SPEC), _value(SPOT_SPEC), _value(changed)
    assert first == again
    old, new = json.loads(first), json.loads(other)
    assert old == {
        "job_id": _job_id(SPOT_SPEC),
        "checkpoint_uri": f"s3://fixed-bucket/checkpoints/{_job_id(SPOT_SPEC)}/",
        "started": None,
        "resumed_from": None,
    }
    assert new["job_id"] == _job_id(changed) != old["job_id"]
    assert new["checkpoint_uri"] == f"s3://fixed-bucket/checkpoints/{_job_id(changed)}/"
