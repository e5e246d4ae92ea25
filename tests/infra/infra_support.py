"""Helpers for the infrastructure tests: specs written by the tests and a builder of both
stacks (test modules build each app once, module-scoped: a CDK app costs seconds on 2 cores).

A plain module rather than conftest.py: tests/infra has no __init__.py (a package named
``infra`` would shadow the real one) and a second top-level ``conftest`` would clash."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aws_cdk as cdk
from aws_cdk.assertions import Template

from infra.assembly import ClusterApp, create_stacks
from training.spec import load_spec

REPO_ROOT = Path(__file__).resolve().parents[2]

# Two trainer types (Spot, no EFA: g5/g6 xlarge) and one dataprep type.
SPOT_SPEC = """
name = "vit-spot"
availability_zone_index = 1

[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge", "g6.xlarge"]
count = 2
market = "spot"

[[groups]]
name = "dataprep"
role = "dataprep"
instance_types = ["c6i.4xlarge"]
count = 1
market = "spot"
efa = "off"

[job]
steps = 100
"""

# EFA everywhere: p4d has 4 EFA network cards, c5n.18xlarge one; trainers On-Demand.
EFA_SPEC = """
name = "vit-efa"

[[groups]]
name = "gpu"
role = "trainer"
instance_types = ["p4d.24xlarge"]
count = 2
market = "on-demand"
efa = "on"

[[groups]]
name = "cpu"
role = "dataprep"
instance_types = ["c5n.18xlarge"]
count = 2
market = "spot"
efa = "auto"

[job]
steps = 100
"""

# EFA required on a type that has none: must stop synth with the spec's message.
BAD_EFA_SPEC = """
name = "vit-bad"

[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge"]
count = 1
efa = "on"
"""


def cdk_context() -> dict[str, object]:
    """The context ``npx cdk`` would pass (feature flags from cdk.json)."""
    data = json.loads((REPO_ROOT / "cdk.json").read_text())
    return dict(data["context"])


@dataclass
class BuiltApp:
    app: cdk.App
    stacks: ClusterApp
    network: Template
    cluster: Template


def build(tmp: Path, spec_text: str, *, destroy_checkpoints: bool = False) -> BuiltApp:
    """Write ``spec_text``, load it and build both stacks in a fresh app."""
    os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
    path = tmp / "cluster.toml"
    path.write_text(spec_text)
    spec = load_spec(path)
    app = cdk.App(outdir=str(tmp / "cdk.out"), context=cdk_context())
    stacks = create_stacks(
        app, spec=spec, spec_text=spec_text, destroy_checkpoints=destroy_checkpoints
    )
    return BuiltApp(
        app=app,
        stacks=stacks,
        network=Template.from_stack(stacks.network),
        cluster=Template.from_stack(stacks.cluster),
    )


def imported(built: BuiltApp, value: object) -> object:
    """What an ``Fn::ImportValue`` in the cluster template resolves to: the value of the network
    stack's output exported under that name (so tests can name the exact resource imported)."""
    assert isinstance(value, dict) and set(value) == {"Fn::ImportValue"}, value
    name = value["Fn::ImportValue"]
    for output in built.network.to_json().get("Outputs", {}).values():
        if output.get("Export", {}).get("Name") == name:
            return output["Value"]
    raise AssertionError(f"the network stack exports nothing named {name!r}")


def statements_by_role(
    template: Template, keep: Callable[[dict[str, Any]], bool]
) -> dict[str, list[dict[str, Any]]]:
    """The IAM policy statements of ``template`` that ``keep`` accepts, under the logical id of
    each role their policy is attached to."""
    found: dict[str, list[dict[str, Any]]] = {}
    for res in template.find_resources("AWS::IAM::Policy").values():
        for statement in res["Properties"]["PolicyDocument"]["Statement"]:
            if keep(statement):
                for role in res["Properties"]["Roles"]:
                    found.setdefault(role["Ref"], []).append(statement)
    return found


def network_ref(built: BuiltApp, construct: object, attribute: str | None = None) -> object:
    """The template expression of a network-stack resource: ``Ref`` or ``Fn::GetAtt``."""
    child = construct.node.default_child  # type: ignore[attr-defined]
    assert isinstance(child, cdk.CfnResource)
    lid = built.stacks.network.get_logical_id(child)
    return {"Fn::GetAtt": [lid, attribute]} if attribute else {"Ref": lid}


# The largest EFA layouts side by side in one group: p4d (4 network cards) and p5 (32). One
# launch template cannot describe both; the stack must still be valid CloudFormation.
MIXED_EFA_SPEC = """
name = "vit-p5"

[[groups]]
name = "dnn_group"
role = "trainer"
instance_types = ["p5.48xlarge", "p4d.24xlarge"]
count = 2
market = "on-demand"
efa = "on"

[[groups]]
name = "data_group"
role = "dataprep"
instance_types = ["c5n.18xlarge"]
count = 1
market = "spot"
efa = "auto"

[job]
steps = 100
"""

# SPOT_SPEC with an elastic dataprep group: the data-tier controller sizes it between 1 and 4,
# starting at 2 (everything else as SPOT_SPEC, so the two templates compare).
ELASTIC_SPEC = SPOT_SPEC.replace(
    'instance_types = ["c6i.4xlarge"]\ncount = 1\n',
    'instance_types = ["c6i.4xlarge"]\ncount = 2\nmin_count = 1\nmax_count = 4\n',
)
assert ELASTIC_SPEC != SPOT_SPEC

DATASET_URI = "s3://vit-datasets/imagenet/train/"

# SageMaker-style group names (underscores) and an S3 dataset: both roles also read the dataset.
SAGEMAKER_SPEC = f"""
name = "vit-sm"

[[groups]]
name = "dnn_group"
role = "trainer"
instance_types = ["g5.xlarge"]
count = 2
market = "spot"

[[groups]]
name = "data_group"
role = "dataprep"
instance_types = ["c6i.4xlarge"]
count = 1
market = "spot"
efa = "off"

[job]
steps = 100

[job.dataset]
source = "s3"
path = "{DATASET_URI}"
"""
