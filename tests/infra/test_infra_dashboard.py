"""The cluster's CloudWatch dashboard (``infra/dashboard.py``): one dashboard named after the spec,
whose body graphs exactly the trainer's seven interval EMF metrics with ``Cluster=<spec name>``
(one minute, Average for rates, shares and counts, Maximum for the checkpoint age), one widget
with the data servers serving and their target, one validation widget with exactly
``ValidationTop1`` and ``EmaValidationTop1`` (the names the trainer's validation EMF line
carries), the trainer group's in-service instances, a text widget on where the numbers come
from, and a ``DashboardName`` output. The body is parsed as the JSON CloudWatch receives
(``Fn::Join`` with the region)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest
from aws_cdk.assertions import Template
from infra_support import SPOT_SPEC, BuiltApp, build

from infra.dashboard import ClusterDashboard
from training.trainer.emf import EMF_METRICS, EVAL_EMF_METRICS

TRAINER_METRICS = {
    "SamplesPerSecond": "Average",
    "DataWaitShare": "Average",
    "SamplesPerDollar": "Average",
    "GPUUtilization": "Average",
    "CheckpointAge": "Maximum",
    "ValidationTop1": "Average",
    "EmaValidationTop1": "Average",
    "DataServers": "Average",
    "DataServersTarget": "Average",
    "UnreadableSamples": "Maximum",
}
"""The trainer's EMF metric names (``training.trainer.emf``) and the statistic graphed."""
VALIDATION_METRICS = ["ValidationTop1", "EmaValidationTop1"]
REGION = "<region>"


@pytest.fixture(scope="module")
def spot(tmp_path_factory: pytest.TempPathFactory) -> BuiltApp:
    return build(tmp_path_factory.mktemp("dashboard"), SPOT_SPEC)


def _logical_id(stack: cdk.Stack, construct: Any) -> str:
    cfn = construct.node.default_child
    assert isinstance(cfn, cdk.CfnResource)
    return stack.get_logical_id(cfn)


def _body(template: Mapping[str, Any], logical_id: str) -> dict[str, Any]:
    """The dashboard body as CloudWatch gets it, with the stack's region as ``REGION``. Any
    other token in it fails the test (the body must not depend on anything else)."""
    raw = template["Resources"][logical_id]["Properties"]["DashboardBody"]
    if isinstance(raw, str):
        return dict(json.loads(raw))
    separator, parts = raw["Fn::Join"]
    assert separator == ""
    text = []
    for part in parts:
        if isinstance(part, str):
            text.append(part)
        else:
            assert part == {"Ref": "AWS::Region"}, part
            text.append(REGION)
    return dict(json.loads("".join(text)))


def _graphed(
    body: dict[str, Any], title: str | None = None
) -> list[tuple[str, str, dict[str, str], str, int]]:
    """Each graphed metric: (namespace, name, dimensions, statistic, period), of the widgets
    titled ``title`` (None: all). A metric's own ``stat``/``period`` wins over its widget's, as
    in the dashboard body format."""
    out = []
    for widget in body["widgets"]:
        if widget["type"] != "metric":
            continue
        props = widget["properties"]
        if title is not None and props.get("title") != title:
            continue
        assert props["region"] == REGION
        for entry in props["metrics"]:
            options = entry[-1] if isinstance(entry[-1], dict) else {}
            fields = entry[:-1] if options else entry
            namespace, name, *pairs = fields
            dims = dict(zip(pairs[::2], pairs[1::2], strict=True))
            stat = options.get("stat", props.get("stat"))
            period = options.get("period", props.get("period"))
            out.append((namespace, name, dims, stat, period))
    return out


def _spot_body(spot: BuiltApp) -> dict[str, Any]:
    stack = spot.stacks.cluster
    return _body(spot.cluster.to_json(), _logical_id(stack, stack.dashboard.dashboard))


def test_one_dashboard_named_after_the_spec(spot: BuiltApp) -> None:
    dashboards = spot.cluster.find_resources("AWS::CloudWatch::Dashboard")
    stack = spot.stacks.cluster
    assert list(dashboards) == [_logical_id(stack, stack.dashboard.dashboard)]
    [dashboard] = dashboards.values()
    assert dashboard["Properties"]["DashboardName"] == "vit-spot-training"


def test_the_body_graphs_exactly_the_trainer_metrics_of_this_cluster(spot: BuiltApp) -> None:
    trainer = [g for g in _graphed(_spot_body(spot)) if g[0] == "hetero"]
    assert sorted(trainer) == sorted(
        ("hetero", name, {"Cluster": "vit-spot"}, stat, 60)
        for name, stat in TRAINER_METRICS.items()
    )


def test_the_trainer_group_in_service_instances_are_graphed(spot: BuiltApp) -> None:
    stack = spot.stacks.cluster
    asg_id = _logical_id(stack, stack.fleets["trainer"].auto_scaling_group)
    asg_name = spot.cluster.to_json()["Resources"][asg_id]["Properties"]["AutoScalingGroupName"]
    groups = [g for g in _graphed(_spot_body(spot)) if g[0] == "AWS/AutoScaling"]
    assert groups == [
        (
            "AWS/AutoScaling",
            "GroupInServiceInstances",
            {"AutoScalingGroupName": asg_name},
            "Average",
            60,
        )
    ]
    assert asg_name == "vit-spot-trainer"  # the trainer group, not dataprep
    # Nothing else is graphed: the trainer metrics and this one.
    assert len(_graphed(_spot_body(spot))) == len(TRAINER_METRICS) + 1


def test_one_widget_graphs_validation_top1_of_the_raw_and_ema_weights(spot: BuiltApp) -> None:
    body = _spot_body(spot)
    [widget] = [
        w for w in body["widgets"] if "Validation" in w.get("properties", {}).get("title", "")
    ]
    props = widget["properties"]
    assert props["title"] == "Validation top-1 (%, raw and EMA weights)"
    assert props["yAxis"]["left"] == {"min": 0, "max": 100, "showUnits": False}
    assert _graphed(body, props["title"]) == [
        ("hetero", name, {"Cluster": "vit-spot"}, "Average", 60) for name in VALIDATION_METRICS
    ]
    # The names are those the trainer's validation EMF line carries (same namespace and
    # dimension set as the interval line's).
    sent = {m.name for m in EVAL_EMF_METRICS}
    assert set(VALIDATION_METRICS) <= sent


def test_one_widget_graphs_the_data_servers_serving_and_their_target(spot: BuiltApp) -> None:
    body = _spot_body(spot)
    title = "Data servers: serving and target"
    [widget] = [w for w in body["widgets"] if w.get("properties", {}).get("title") == title]
    assert widget["properties"]["yAxis"]["left"] == {"min": 0}
    assert _graphed(body, title) == [
        ("hetero", name, {"Cluster": "vit-spot"}, "Average", 60)
        for name in ("DataServers", "DataServersTarget")
    ]
    # The names and the record keys the trainer's interval line carries them under.
    sent = {m.name: m.field for m in EMF_METRICS}
    assert sent["DataServers"] == "data_servers"
    assert sent["DataServersTarget"] == "data_servers_target"


def test_a_text_widget_says_where_the_metrics_come_from(spot: BuiltApp) -> None:
    texts = [
        w["properties"]["markdown"] for w in _spot_body(spot)["widgets"] if w["type"] == "text"
    ]
    [markdown] = texts
    for phrase in (
        "Embedded Metric Format",
        "awslogs",
        "namespace `hetero`",
        "one per evaluation",
        "`Cluster=vit-spot`",
        "group metrics collection is enabled",
        "only when a dataprep group is elastic",
    ):
        assert phrase in markdown, phrase


def test_the_dashboard_name_is_an_output(spot: BuiltApp) -> None:
    stack = spot.stacks.cluster
    output = spot.cluster.to_json()["Outputs"]["DashboardName"]
    assert output["Value"] == {"Ref": _logical_id(stack, stack.dashboard.dashboard)}


def test_another_cluster_gets_its_own_series_and_no_group_graph_without_groups(
    tmp_path: Path,
) -> None:
    # A bare stack (no image asset to build): the construct alone, as another cluster uses it.
    app = cdk.App(outdir=str(tmp_path))
    stack = cdk.Stack(app, "Other")
    dashboard = ClusterDashboard(stack, "Dashboard", cluster_name="resnet-od")
    template = Template.from_stack(stack).to_json()
    lid = _logical_id(stack, dashboard.dashboard)
    assert template["Resources"][lid]["Properties"]["DashboardName"] == "resnet-od-training"
    graphed = _graphed(_body(template, lid))
    assert sorted(graphed) == sorted(
        ("hetero", name, {"Cluster": "resnet-od"}, stat, 60)
        for name, stat in TRAINER_METRICS.items()
    )
