"""CloudWatch Embedded Metric Format (EMF): the trainer's interval metrics as one JSON log line.

On EC2 the container's stdout goes to CloudWatch Logs (Docker's ``awslogs`` driver, set up by the
stack's user data); CloudWatch Logs turns a log event that follows the EMF specification into
metric data points, so the trainer needs no CloudWatch client, credentials or API calls of its
own. Specification:
https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/CloudWatch_Embedded_Metric_Format_Specification.html

What this module relies on from that specification:

- the log event is exactly one JSON object, nothing before or after it (so one line, printed
  on its own, flushed);
- ``_aws.Timestamp`` is milliseconds since the Unix epoch; ``_aws.CloudWatchMetrics`` is a list
  of directives, each with ``Namespace``, ``Dimensions`` (a list of dimension sets, each a list
  of root-member names whose values are strings) and ``Metrics`` (``Name`` and ``Unit``, at most
  100 per directive);
- every metric and dimension a directive names is a member of the root object; a metric value
  is a number.

Here: namespace ``hetero`` (``training.common.names.METRICS_NAMESPACE``, the one the instance role
may write), one dimension set ``[Cluster]`` (the spec's name), so the stack's dashboard can
graph each metric of a cluster as one series. A metric that could not be measured in an
interval (no GPU or no NVML, no price, no durable checkpoint yet) is left out of the document,
never sent as a made-up 0; JSON has no NaN, so a non-finite value is left out too.

Validation results (``MetricsLogger.log_eval``) go out as a line of their own, in the same
namespace and dimension set: ``ValidationTop1``, ``ValidationTop5`` (percent), ``ValidationLoss``
and, with EMA weights, ``EmaValidationTop1`` (``eval_emf_document``).

``emf_document`` is pure (record in, dict out); ``MetricsLogger`` prints it on rank 0.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TextIO

from training.common.names import METRICS_NAMESPACE

DIMENSION_CLUSTER: Final = "Cluster"
"""The one dimension of every metric: the cluster spec's ``name``."""


@dataclass(frozen=True)
class EmfMetric:
    """One CloudWatch metric and the interval-record field it is read from."""

    name: str
    unit: str
    """A CloudWatch unit (``MetricDatum.Unit``)."""
    field: str
    """The key in ``MetricsLogger``'s interval record."""
    scale: float = 1.0
    """Multiplies the record's value (a share in 0..1 becomes a percentage)."""


EMF_METRICS: Final[tuple[EmfMetric, ...]] = (
    EmfMetric("SamplesPerSecond", "Count/Second", "samples_per_s"),
    EmfMetric("DataWaitShare", "Percent", "data_wait_share", scale=100.0),
    EmfMetric("SamplesPerDollar", "Count", "samples_per_usd"),
    EmfMetric("GPUUtilization", "Percent", "gpu_util_pct"),
    EmfMetric("CheckpointAge", "Seconds", "checkpoint_age_s"),
    EmfMetric("DataServers", "Count", "data_servers"),
    EmfMetric("DataServersTarget", "Count", "data_servers_target"),
    EmfMetric("UnreadableSamples", "Count", "unreadable_samples"),
)
"""The metrics every interval line may carry, in this order (the dashboard graphs these).
``DataServers`` (servers serving now) and ``DataServersTarget`` (the data-tier controller's
count, ``training.dataplane.autoscale``) are in the record only when a dataprep group is
elastic; without them the line leaves them out."""

CONTEXT_FIELDS: Final[tuple[str, ...]] = ("step", "epoch", "loss", "step_time_s", "mfu")
"""Record fields copied into the line as plain members: searchable in CloudWatch Logs
Insights beside the metrics, but not metrics themselves (no custom-metric cost)."""

EVAL_EMF_METRICS: Final[tuple[EmfMetric, ...]] = (
    EmfMetric("ValidationTop1", "Percent", "top1", scale=100.0),
    EmfMetric("ValidationTop5", "Percent", "top5", scale=100.0),
    EmfMetric("ValidationLoss", "None", "val_loss"),
    EmfMetric("EmaValidationTop1", "Percent", "ema_top1", scale=100.0),
)
"""The metrics of a validation line (``MetricsLogger.log_eval``'s record), in this order; the
EMA's only when the job keeps EMA weights. Same namespace and dimensions as the interval's."""

EVAL_CONTEXT_FIELDS: Final[tuple[str, ...]] = (
    "step", "samples", "wall_s", "usd", "val_samples", "eval_s", "ema_top5", "ema_val_loss",
)  # fmt: skip
"""The validation record's fields copied into its line as plain members."""

_INTEGER_FIELDS: Final = frozenset({"step", "epoch", "samples", "val_samples"})


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None (missing, not a number, NaN or infinite)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def emf_document(
    record: Mapping[str, Any],
    *,
    cluster: str,
    namespace: str = METRICS_NAMESPACE,
    metrics: Sequence[EmfMetric] = EMF_METRICS,
    context: Sequence[str] = CONTEXT_FIELDS,
) -> dict[str, Any] | None:
    """The EMF document for one interval ``record`` of cluster ``cluster``, or None when the
    record has none of ``metrics``. ``record["time"]`` (Unix seconds) is the timestamp. A
    validation record takes ``metrics=EVAL_EMF_METRICS, context=EVAL_CONTEXT_FIELDS``
    (``eval_emf_document``)."""
    if not cluster.strip():
        raise ValueError(f"cluster must name the cluster (the Cluster dimension), got {cluster!r}")
    values: dict[str, float] = {}
    definitions: list[dict[str, str]] = []
    for metric in metrics:
        value = _number(record.get(metric.field))
        if value is None:
            continue
        values[metric.name] = value * metric.scale
        definitions.append({"Name": metric.name, "Unit": metric.unit})
    if not definitions:
        return None
    document: dict[str, Any] = {
        "_aws": {
            "Timestamp": round(float(record["time"]) * 1000),
            "CloudWatchMetrics": [
                {
                    "Namespace": namespace,
                    "Dimensions": [[DIMENSION_CLUSTER]],
                    "Metrics": definitions,
                }
            ],
        },
        DIMENSION_CLUSTER: cluster,
    }
    document.update(values)
    for key in context:
        member = _number(record.get(key))
        if member is not None:
            document[key] = int(member) if key in _INTEGER_FIELDS else member
    return document


def eval_emf_document(
    record: Mapping[str, Any], *, cluster: str, namespace: str = METRICS_NAMESPACE
) -> dict[str, Any] | None:
    """The EMF document for one validation ``record`` (``EVAL_EMF_METRICS``)."""
    return emf_document(
        record, cluster=cluster, namespace=namespace, metrics=EVAL_EMF_METRICS,
        context=EVAL_CONTEXT_FIELDS,
    )  # fmt: skip


def emf_line(document: Mapping[str, Any]) -> str:
    """``document`` as one compact JSON line (strict JSON: NaN or infinity raise)."""
    return json.dumps(document, separators=(",", ":"), allow_nan=False)


def write_emf(document: Mapping[str, Any], stream: TextIO | None = None) -> None:
    """Print ``document`` as one line on ``stream`` (default: this process's stdout, looked up
    now) and flush, so the line reaches the log driver whole and without delay."""
    out = sys.stdout if stream is None else stream
    out.write(emf_line(document) + "\n")
    out.flush()
