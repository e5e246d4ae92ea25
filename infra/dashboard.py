"""A CloudWatch dashboard of one cluster's training: validation top-1 (raw and EMA weights),
throughput, data wait, samples per dollar, GPU utilisation, checkpoint age, the data servers
serving and the data-tier controller's target (empty unless a dataprep group is elastic), and
optionally the trainer groups' in-service instances.

The trainer metrics are not sent by any API call: rank 0 of the trainer prints one CloudWatch
Embedded Metric Format line per logged interval and one per evaluation on stdout
(``training.trainer.emf``), Docker's
``awslogs`` driver ships stdout to the cluster's log group, and CloudWatch Logs extracts the
metrics (namespace ``hetero``, dimension ``Cluster`` = the spec's name). EMF specification:
https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/CloudWatch_Embedded_Metric_Format_Specification.html

The in-service graph reads ``AWS/AutoScaling`` ``GroupInServiceInstances``, which Amazon EC2
Auto Scaling publishes only for groups with group metrics collection enabled
(https://docs.aws.amazon.com/autoscaling/ec2/userguide/ec2-auto-scaling-metrics.html); without
it that graph stays empty.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cw
from constructs import Construct

from training.common.names import METRICS_NAMESPACE
from training.trainer.emf import DIMENSION_CLUSTER, EMF_METRICS, EVAL_EMF_METRICS

logger = logging.getLogger(__name__)

PERIOD: Final = Duration.seconds(60)
"""Every graph aggregates over one minute (the trainer logs an interval every few seconds)."""

STATISTICS: Final[dict[str, str]] = {
    "SamplesPerSecond": cw.Stats.AVERAGE,
    "DataWaitShare": cw.Stats.AVERAGE,
    "SamplesPerDollar": cw.Stats.AVERAGE,
    "GPUUtilization": cw.Stats.AVERAGE,
    # The age saw-tooths between saves: the minute's worst is what a Spot loss would cost.
    "CheckpointAge": cw.Stats.MAXIMUM,
    "ValidationTop1": cw.Stats.AVERAGE,
    "EmaValidationTop1": cw.Stats.AVERAGE,
    "DataServers": cw.Stats.AVERAGE,
    "DataServersTarget": cw.Stats.AVERAGE,
    # A count that only grows within a run: the minute's highest is the newest.
    "UnreadableSamples": cw.Stats.MAXIMUM,
}
"""Rates, shares and counts are averaged over the minute; the checkpoint age and the unreadable
samples take their maximum."""

VALIDATION_GRAPHED: Final[tuple[str, ...]] = ("ValidationTop1", "EmaValidationTop1")
"""The validation metrics graphed (one widget); the EMA's exists only when the job keeps EMA
weights. ``ValidationTop5`` and ``ValidationLoss`` are sent but not graphed."""

TITLES: Final[dict[str, str]] = {
    "SamplesPerSecond": "Throughput (samples/s, global)",
    "DataWaitShare": "Data-wait share (% of step time)",
    "SamplesPerDollar": "Samples per dollar (whole cluster's price)",
    "GPUUtilization": "GPU utilisation (%, rank 0's GPU)",
    "CheckpointAge": "Checkpoint age (s since the newest durable checkpoint)",
    "UnreadableSamples": "Unreadable training samples (left out; named in summary.json)",
}

VALIDATION_TITLE: Final = "Validation top-1 (%, raw and EMA weights)"

DATA_SERVERS_GRAPHED: Final[tuple[str, ...]] = ("DataServers", "DataServersTarget")
"""One widget: the data servers serving and the data-tier controller's target count (sent only
while a dataprep group is elastic)."""
DATA_SERVERS_TITLE: Final = "Data servers: serving and target"

_PERCENT_AXIS = cw.YAxisProps(min=0, max=100, show_units=False)


def dashboard_name(cluster_name: str) -> str:
    """The dashboard's name: ``<cluster>-training`` (spec names fit CloudWatch's rule of
    letters, digits, ``-`` and ``_``)."""
    return f"{cluster_name}-training"


def trainer_metric(cluster_name: str, metric_name: str) -> cw.Metric:
    """One of the trainer's EMF metrics of cluster ``cluster_name``, as the dashboard graphs
    it (one-minute period, the statistic from ``STATISTICS``)."""
    return cw.Metric(
        namespace=METRICS_NAMESPACE,
        metric_name=metric_name,
        dimensions_map={DIMENSION_CLUSTER: cluster_name},
        period=PERIOD,
        statistic=STATISTICS[metric_name],
        label=metric_name,
    )


class ClusterDashboard(Construct):
    """The ``<cluster>-training`` dashboard (see the module doc).

    Attributes: ``dashboard``, ``metrics`` (the trainer metrics by name).
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        cluster_name: str,
        trainer_asg_names: Sequence[str] = (),
    ) -> None:
        super().__init__(scope, construct_id)
        sent = {m.name for m in EVAL_EMF_METRICS}
        unknown = set(VALIDATION_GRAPHED) - sent
        if unknown:  # The trainer renamed or dropped a validation metric.
            raise ValueError(f"the trainer sends no validation metric {sorted(unknown)}")
        names = [m.name for m in EMF_METRICS] + list(VALIDATION_GRAPHED)
        self.metrics = {name: trainer_metric(cluster_name, name) for name in names}
        missing = set(self.metrics) ^ set(STATISTICS)
        if missing:  # A metric added to the trainer needs a statistic and a title here.
            raise ValueError(f"dashboard and trainer disagree on metrics: {sorted(missing)}")

        def graph(name: str) -> cw.GraphWidget:
            percent = name in ("DataWaitShare", "GPUUtilization")
            return cw.GraphWidget(
                title=TITLES[name],
                left=[self.metrics[name]],
                # Also the widget's default statistic, so the body names it even for Average
                # (which CDK leaves out of each metric's options).
                statistic=STATISTICS[name],
                left_y_axis=_PERCENT_AXIS if percent else cw.YAxisProps(min=0),
                width=12,
                height=6,
            )

        unknown = set(DATA_SERVERS_GRAPHED) - set(self.metrics)
        if unknown:  # The trainer renamed or dropped a data-tier metric.
            raise ValueError(f"the trainer sends no data-tier metric {sorted(unknown)}")

        rows: list[list[cw.IWidget]] = [
            [cw.TextWidget(markdown=_about(cluster_name, trainer_asg_names), width=24, height=4)],
            [
                cw.GraphWidget(
                    title=VALIDATION_TITLE,
                    left=[self.metrics[name] for name in VALIDATION_GRAPHED],
                    statistic=cw.Stats.AVERAGE,
                    left_y_axis=_PERCENT_AXIS,
                    width=24,
                    height=6,
                )
            ],
            [graph("SamplesPerSecond"), graph("SamplesPerDollar")],
            [graph("DataWaitShare"), graph("GPUUtilization")],
        ]
        last: list[cw.IWidget] = [graph("CheckpointAge")]
        if trainer_asg_names:
            last.append(
                cw.GraphWidget(
                    title="Trainer instances in service",
                    left=[
                        cw.Metric(
                            namespace="AWS/AutoScaling",
                            metric_name="GroupInServiceInstances",
                            dimensions_map={"AutoScalingGroupName": name},
                            period=PERIOD,
                            statistic=cw.Stats.AVERAGE,
                            label=name,
                        )
                        for name in trainer_asg_names
                    ],
                    statistic=cw.Stats.AVERAGE,
                    left_y_axis=cw.YAxisProps(min=0),
                    width=12,
                    height=6,
                )
            )
        rows.append(last)
        rows.append(
            [
                cw.GraphWidget(
                    title=DATA_SERVERS_TITLE,
                    left=[self.metrics[name] for name in DATA_SERVERS_GRAPHED],
                    statistic=cw.Stats.AVERAGE,
                    left_y_axis=cw.YAxisProps(min=0),
                    width=12,
                    height=6,
                ),
                graph("UnreadableSamples"),
            ]
        )
        self.dashboard = cw.Dashboard(
            self, "Dashboard", dashboard_name=dashboard_name(cluster_name), widgets=rows
        )


def _about(cluster_name: str, trainer_asg_names: Sequence[str]) -> str:
    """The text widget: where the numbers come from, so a blank graph can be explained."""
    lines = [
        f"## Training of cluster `{cluster_name}`",
        "Rank 0 of the trainer prints one CloudWatch Embedded Metric Format line per logged "
        "interval and one per evaluation on stdout; Docker's awslogs driver sends them to the "
        "cluster's log group and "
        f"CloudWatch Logs extracts the metrics (namespace `{METRICS_NAMESPACE}`, dimension "
        f"`{DIMENSION_CLUSTER}={cluster_name}`, one-minute graphs). A metric that could not be "
        "measured in an interval (no GPU or NVML, no price, no checkpoint yet) is left out, "
        "not drawn as 0. Validation top-1 has a point per evaluation (every "
        "`job.eval.every_steps` and at the end); the EMA's only when `[job.ema]` is on. "
        "Data servers (serving, and the data-tier controller's target) are sent only when a "
        "dataprep group is elastic (`min_count`/`max_count`).",
    ]
    if trainer_asg_names:
        lines.append(
            "Instances in service: `AWS/AutoScaling` `GroupInServiceInstances`, published only "
            "when group metrics collection is enabled on the Auto Scaling groups."
        )
    return "\n\n".join(lines)
