"""CloudWatch Embedded Metric Format lines (``training.trainer.emf``): the exact document for an
interval, what is left out when it cannot be measured, when the lines are printed (rank 0 only;
on where ``HETERO_CLUSTER`` is set or ``--emf`` asks; never in a plain local run), and, through
the trainer's real entry point, one line per logged interval whose values are the interval's
and whose ``CheckpointAge`` counts from the newest durable checkpoint, across a restart too."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from training.common.outcome import EXIT_FINISHED
from training.common.steps import MARKER
from training.spec import load_spec
from training.trainer.__main__ import main
from training.trainer.config import TrainerConfig
from training.trainer.emf import emf_document, emf_line
from training.trainer.metrics import Interval, MetricsLogger, RunFacts

from .conftest import write_spec

SPEC_NAME = "trainer-test"  # tests/trainer/conftest.py's spec

RECORD: dict[str, Any] = {
    "time": 1_700_000_000.1234,
    "step": 40,
    "epoch": 1,
    "loss": 2.5,
    "lr": 0.001,
    "samples_per_s": 812.5,
    "step_time_s": 0.315,
    "data_wait_share": 0.125,
    "samples_per_usd": 2_250_000.0,
    "host_cpu_pct": 37.0,
    "mfu": 0.41,
    "gpu_util_pct": 93.0,
    "steps": 10,
    "checkpoint_stall_s": 0.0,
    "checkpoint_age_s": 73.5,
}


def test_the_document_of_an_interval_is_exact() -> None:
    assert emf_document(RECORD, cluster="vit-prod") == {
        "_aws": {
            "Timestamp": 1_700_000_000_123,
            "CloudWatchMetrics": [
                {
                    "Namespace": "hetero",
                    "Dimensions": [["Cluster"]],
                    "Metrics": [
                        {"Name": "SamplesPerSecond", "Unit": "Count/Second"},
                        {"Name": "DataWaitShare", "Unit": "Percent"},
                        {"Name": "SamplesPerDollar", "Unit": "Count"},
                        {"Name": "GPUUtilization", "Unit": "Percent"},
                        {"Name": "CheckpointAge", "Unit": "Seconds"},
                    ],
                }
            ],
        },
        "Cluster": "vit-prod",
        "SamplesPerSecond": 812.5,
        "DataWaitShare": 12.5,
        "SamplesPerDollar": 2_250_000.0,
        "GPUUtilization": 93.0,
        "CheckpointAge": 73.5,
        "step": 40,
        "epoch": 1,
        "loss": 2.5,
        "step_time_s": 0.315,
        "mfu": 0.41,
    }


def test_what_was_not_measured_is_left_out_not_sent_as_zero() -> None:
    # No GPU (or no NVML), no price, no checkpoint yet, a NaN loss: none of them may appear.
    record = {
        **RECORD,
        "gpu_util_pct": None,
        "samples_per_usd": None,
        "checkpoint_age_s": None,
        "loss": math.nan,
        "mfu": None,
    }
    document = emf_document(record, cluster="vit-prod")
    assert document is not None
    [directive] = document["_aws"]["CloudWatchMetrics"]
    assert directive["Metrics"] == [
        {"Name": "SamplesPerSecond", "Unit": "Count/Second"},
        {"Name": "DataWaitShare", "Unit": "Percent"},
    ]
    assert set(document) == {
        "_aws", "Cluster", "SamplesPerSecond", "DataWaitShare", "step", "epoch", "step_time_s",
    }  # fmt: skip
    # Strict JSON: CloudWatch Logs would reject the event over a bare NaN.
    assert json.loads(emf_line(document)) == document


def test_the_data_tier_counts_go_out_only_when_the_record_has_them() -> None:
    # No elastic group: the record has neither key, and the line names neither metric.
    document = emf_document(RECORD, cluster="vit-prod")
    assert document is not None
    assert "DataServers" not in document and "DataServersTarget" not in document
    # An elastic group: serving now and the controller's count, as Count metrics after the
    # others; 0 serving is a measurement, sent as 0.
    elastic = emf_document(
        {**RECORD, "data_servers": 0, "data_servers_target": 3}, cluster="vit-prod"
    )
    assert elastic is not None
    [directive] = elastic["_aws"]["CloudWatchMetrics"]
    assert directive["Metrics"][-2:] == [
        {"Name": "DataServers", "Unit": "Count"},
        {"Name": "DataServersTarget", "Unit": "Count"},
    ]
    assert (elastic["DataServers"], elastic["DataServersTarget"]) == (0.0, 3.0)
    assert {k: v for k, v in elastic.items() if not k.startswith("DataServers")} | {
        "_aws": document["_aws"]
    } == document
    # Only the target known (no server has answered yet): the other is left out.
    target_only = emf_document({**RECORD, "data_servers_target": 2}, cluster="vit-prod")
    assert target_only is not None
    assert "DataServers" not in target_only and target_only["DataServersTarget"] == 2.0


def test_an_interval_with_no_measurable_metric_gives_no_document() -> None:
    record = {**RECORD, "samples_per_s": math.inf, "data_wait_share": math.nan}
    record.update(samples_per_usd=None, gpu_util_pct=None, checkpoint_age_s=None)
    assert emf_document(record, cluster="vit-prod") is None


def test_a_line_is_one_compact_strict_json_object() -> None:
    document = emf_document(RECORD, cluster="vit-prod")
    assert document is not None
    line = emf_line(document)
    assert "\n" not in line and line.startswith("{") and line.endswith("}")
    assert json.loads(line) == document
    with pytest.raises(ValueError):
        emf_line({"Loss": math.nan})
    with pytest.raises(ValueError, match="Cluster"):
        emf_document(RECORD, cluster=" ")


@pytest.mark.parametrize(
    ("environ", "flag", "expected"),
    [
        ({}, None, None),  # a local run: no lines
        ({"HETERO_CLUSTER": "vit-prod"}, None, "vit-prod"),  # the stack's instances
        ({"HETERO_CLUSTER": "  "}, None, None),  # blank is unset
        ({}, True, SPEC_NAME),  # --emf without the stack: the spec's name
        ({"HETERO_CLUSTER": "vit-prod"}, True, "vit-prod"),
        ({"HETERO_CLUSTER": "vit-prod"}, False, None),  # --no-emf wins
    ],
)
def test_emf_is_on_only_where_the_stack_or_a_flag_asks(
    tmp_path: Path, environ: dict[str, str], flag: bool | None, expected: str | None
) -> None:
    config = TrainerConfig.from_spec(
        load_spec(write_spec(tmp_path)), run_dir=tmp_path / "run", synthetic=True,
        emf=flag, environ=environ,
    )  # fmt: skip
    assert config.emf_cluster == expected


def _facts() -> RunFacts:
    return RunFacts(
        global_batch=8,
        world_size=2,
        cluster_usd_per_hour=3.6,
        flops_per_sample=None,
        peak_flops_per_rank=None,
        total_steps=None,
    )


def _emf_lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if '"_aws"' in line]


def test_only_rank_0_prints_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cpu = torch.device("cpu")
    for rank in (1, 0):
        logger = MetricsLogger(
            tmp_path / f"rank{rank}", _facts(), rank=rank, device=cpu, emf_cluster="vit-prod"
        )
        interval = Interval(started=time.perf_counter() - 2.0, steps=4, data_wait_s=0.5)
        logger.log(4, interval, loss=1.0, lr=0.1, data_wait_share=0.25, epoch=0)
        lines = _emf_lines(capsys.readouterr().out)
        if rank == 1:
            assert lines == []
            continue
        [line] = lines
        # 8 samples x 4 steps over ~2 s; 3.6 USD/hour is 0.001 USD/s.
        assert line["SamplesPerSecond"] == pytest.approx(16.0, rel=0.05)
        assert line["SamplesPerDollar"] == pytest.approx(16_000.0, rel=0.05)
        assert line["DataWaitShare"] == 25.0
        assert "GPUUtilization" not in line and "CheckpointAge" not in line  # CPU; no save


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_utilisation_comes_from_nvml_on_a_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("pynvml")
    logger = MetricsLogger(
        tmp_path, _facts(), rank=0, device=torch.device("cuda", 0), emf_cluster="vit-prod"
    )
    interval = Interval(started=time.perf_counter() - 1.0, steps=1)
    record = logger.log(1, interval, loss=1.0, lr=0.1, data_wait_share=0.0, epoch=0)
    [line] = _emf_lines(capsys.readouterr().out)
    assert isinstance(record["gpu_util_pct"], float) and 0.0 <= record["gpu_util_pct"] <= 100.0
    assert line["GPUUtilization"] == record["gpu_util_pct"]
    metrics = line["_aws"]["CloudWatchMetrics"][0]["Metrics"]
    assert {"Name": "GPUUtilization", "Unit": "Percent"} in metrics


def _run(tmp: Path, *extra: str, steps: int, interval: int) -> int:
    spec = write_spec(tmp, steps=steps, interval=interval, batch_size=4)
    return main(["--spec", str(spec), "--run-dir", str(tmp / "run"), "--synthetic-data", *extra])


def test_a_run_prints_one_line_per_logged_interval_with_its_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HETERO_CLUSTER", raising=False)
    # log_every_steps = 1: five intervals; checkpoints at steps 2 and 4 (and the final 5).
    assert _run(tmp_path, "--emf", steps=5, interval=2) == EXIT_FINISHED
    out = capsys.readouterr().out
    lines = _emf_lines(out)
    jsonl = (tmp_path / "run" / "metrics.jsonl").read_text()
    records = [json.loads(x) for x in jsonl.splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert len(lines) == len(records)
    # Each EMF line is a whole stdout line of its own: nothing before or after the object.
    assert [ln for ln in out.splitlines() if '"_aws"' in ln] == [emf_line(x) for x in lines]
    for line, record in zip(lines, records, strict=True):
        [directive] = line["_aws"]["CloudWatchMetrics"]
        assert directive["Namespace"] == "hetero" and directive["Dimensions"] == [["Cluster"]]
        assert line["Cluster"] == SPEC_NAME  # --emf without HETERO_CLUSTER: the spec's name
        assert line["_aws"]["Timestamp"] == round(record["time"] * 1000)
        assert line["step"] == record["step"]
        assert line["SamplesPerSecond"] == record["samples_per_s"] > 0
        assert line["DataWaitShare"] == record["data_wait_share"] * 100
        assert record["samples_per_usd"] is not None
        assert line["SamplesPerDollar"] == record["samples_per_usd"]
        assert "GPUUtilization" not in line  # a CPU run: not measurable, so not sent
        names = [m["Name"] for m in directive["Metrics"]]
        # Steps 1 and 2 are logged before any checkpoint is durable (step 2's save follows its
        # log line); from step 3 on the age counts from the newest one.
        # Every interval says how many training samples were unreadable (none here).
        assert names[-1] == "UnreadableSamples" and line["UnreadableSamples"] == 0
        if record["step"] <= 2:
            assert record["checkpoint_age_s"] is None and "CheckpointAge" not in line
            assert names == [
                "SamplesPerSecond", "DataWaitShare", "SamplesPerDollar", "UnreadableSamples"
            ]  # fmt: skip
        else:
            assert names[-2] == "CheckpointAge"
            assert line["CheckpointAge"] == record["checkpoint_age_s"]
            assert 0.0 <= line["CheckpointAge"] < 60.0


def test_a_resumed_run_reports_the_age_of_the_checkpoint_it_resumed_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HETERO_CLUSTER", raising=False)
    assert _run(tmp_path, steps=3, interval=100) == EXIT_FINISHED  # saves step 3 at the end
    assert _emf_lines(capsys.readouterr().out) == []  # a local run prints none by default
    # Make the step-3 checkpoint 1000 s old, as if the job had been down that long.
    marker = tmp_path / "checkpoints" / "step-3" / MARKER
    saved = json.loads(marker.read_text())
    assert saved["step"] == 3
    marker.write_text(json.dumps({**saved, "time": time.time() - 1000.0}))

    monkeypatch.setenv("HETERO_CLUSTER", "vit-prod")  # what the stack's user data sets
    assert _run(tmp_path, steps=4, interval=100) == EXIT_FINISHED
    [line] = _emf_lines(capsys.readouterr().out)
    assert (line["Cluster"], line["step"]) == ("vit-prod", 4)
    assert 1000.0 <= line["CheckpointAge"] < 1060.0
