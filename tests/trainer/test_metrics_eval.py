"""Validation results as ``training.trainer.metrics`` reports them: the exact ``metrics.jsonl``
record of ``MetricsLogger.log_eval`` (``"kind": "eval"``), its console and EMF lines,
``last_eval.json``, the ``accuracy`` section of ``summary.json`` (each target reached at the
first evaluation at or over it, with its step, samples, wall time and USD; the better of raw
and EMA weights per evaluation), training figures unchanged by validation records, the summary
table's rows and the panels of ``metrics.png``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import matplotlib.image
import matplotlib.pyplot as plt
import pytest
import torch
from rich.console import Console

from training.trainer.metrics import (
    EvalResult,
    EvalScores,
    Interval,
    MetricsLogger,
    RunFacts,
    accuracy_rows,
    accuracy_summary,
    eval_line,
    figure,
    plot,
    progress_line,
    summarise,
    summary_table,
)

CPU = torch.device("cpu")
TARGETS = (0.5, 0.8, 0.95)
PRICE = 18.0
"""USD per hour: 60 s of training cost exactly 0.3 USD."""


def _facts(targets: tuple[float, ...] = TARGETS, price: float = PRICE) -> RunFacts:
    return RunFacts(
        global_batch=64,
        world_size=1,
        cluster_usd_per_hour=price,
        flops_per_sample=None,
        peak_flops_per_rank=None,
        total_steps=240,
        accuracy_targets=targets,
    )


def _logger(tmp_path: Path, **kwargs: Any) -> MetricsLogger:
    facts = kwargs.pop("facts", _facts())
    return MetricsLogger(tmp_path, facts, rank=kwargs.pop("rank", 0), device=CPU, **kwargs)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _without_time(record: dict[str, Any]) -> dict[str, Any]:
    assert abs(record["time"] - time.time()) < 60
    return {k: v for k, v in record.items() if k != "time"}


# -- the record --------------------------------------------------------------------------------


def test_log_eval_writes_the_exact_record_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = _logger(tmp_path)
    result = EvalResult(top1=0.8125, top5=0.96875, loss=0.625, samples=360, eval_s=1.375)
    logger.log_eval(120, result, samples_seen=7680, train_wall_s=60.0)
    [record] = _lines(tmp_path / "metrics.jsonl")
    assert list(record) == [
        "kind", "time", "step", "top1", "top5", "val_loss", "val_samples", "eval_s", "samples",
        "wall_s", "usd",
    ]  # fmt: skip
    assert _without_time(record) == {
        "kind": "eval",
        "step": 120,
        "top1": 0.8125,
        "top5": 0.96875,
        "val_loss": 0.625,
        "val_samples": 360,
        "eval_s": 1.375,
        "samples": 7680,
        "wall_s": 60.0,
        "usd": 0.3,  # 18 USD/h x 60 s
    }
    assert logger.evals == [record]
    assert logger.records == []  # not an interval
    err = capsys.readouterr().err
    assert (
        "eval step 120: top-1 81.2 %, top-5 96.9 %, loss 0.6250 over 360 images in 1.4 s\n" in err
    )
    # The heartbeat's file: the record and the targets reached so far.
    last = json.loads((tmp_path / "last_eval.json").read_text())
    assert last == {**record, "targets_reached": [0.5, 0.8]}
    logger.finish({})


def test_the_ema_figures_join_the_record_and_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = _logger(tmp_path)
    ema = EvalScores(top1=0.8203125, top5=0.9765625, loss=0.5)
    result = EvalResult(top1=0.8125, top5=0.96875, loss=0.625, samples=360, eval_s=1.375, ema=ema)
    logger.log_eval(120, result, samples_seen=7680, train_wall_s=60.0)
    [record] = _lines(tmp_path / "metrics.jsonl")
    assert list(record)[-3:] == ["ema_top1", "ema_top5", "ema_val_loss"]
    assert (record["ema_top1"], record["ema_top5"], record["ema_val_loss"]) == (
        0.8203125,
        0.9765625,
        0.5,
    )
    assert "loss 0.6250 (EMA top-1 82.0 %) over 360 images" in capsys.readouterr().err
    logger.finish({})


def test_without_a_price_the_usd_is_none(tmp_path: Path) -> None:
    logger = _logger(tmp_path, facts=_facts(price=0.0))
    logger.log_eval(
        1, EvalResult(0.5, 0.9, 1.0, 10, 0.1), samples_seen=64, train_wall_s=2.0
    )  # fmt: skip
    assert logger.evals[0]["usd"] is None
    logger.finish({})


def test_other_ranks_keep_the_record_but_write_and_print_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = _logger(tmp_path / "rank1", rank=1, emf_cluster="vit-prod")
    logger.log_eval(5, EvalResult(0.5, 0.9, 1.0, 10, 0.1), samples_seen=320, train_wall_s=4.0)
    assert not (tmp_path / "rank1").exists()
    assert capsys.readouterr() == ("", "")
    assert [r["step"] for r in logger.evals] == [5]
    summary = logger.finish({})  # every rank returns the same summary
    assert summary["accuracy"]["final"]["step"] == 5
    assert not (tmp_path / "rank1").exists()


def test_the_emf_line_of_an_evaluation_is_exact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = _logger(tmp_path, emf_cluster="vit-prod")
    ema = EvalScores(top1=0.875, top5=1.0, loss=0.25)
    result = EvalResult(top1=0.8125, top5=0.96875, loss=0.625, samples=360, eval_s=1.375, ema=ema)
    logger.log_eval(120, result, samples_seen=7680, train_wall_s=60.0)
    [line] = [json.loads(x) for x in capsys.readouterr().out.splitlines() if '"_aws"' in x]
    record = logger.evals[0]
    assert line == {
        "_aws": {
            "Timestamp": round(record["time"] * 1000),
            "CloudWatchMetrics": [
                {
                    "Namespace": "hetero",  # the training metrics' namespace and dimensions
                    "Dimensions": [["Cluster"]],
                    "Metrics": [
                        {"Name": "ValidationTop1", "Unit": "Percent"},
                        {"Name": "ValidationTop5", "Unit": "Percent"},
                        {"Name": "ValidationLoss", "Unit": "None"},
                        {"Name": "EmaValidationTop1", "Unit": "Percent"},
                    ],
                }
            ],
        },
        "Cluster": "vit-prod",
        "ValidationTop1": 81.25,
        "ValidationTop5": 96.875,
        "ValidationLoss": 0.625,
        "EmaValidationTop1": 87.5,
        "step": 120,
        "samples": 7680,
        "wall_s": 60.0,
        "usd": 0.3,
        "val_samples": 360,
        "eval_s": 1.375,
        "ema_top5": 1.0,
        "ema_val_loss": 0.25,
    }
    # Without EMA weights the EMA metric is absent, not 0.
    logger.log_eval(
        240, EvalResult(0.9, 1.0, 0.5, 360, 1.0), samples_seen=15360, train_wall_s=120.0
    )  # fmt: skip
    [line] = [json.loads(x) for x in capsys.readouterr().out.splitlines() if '"_aws"' in x]
    names = [m["Name"] for m in line["_aws"]["CloudWatchMetrics"][0]["Metrics"]]
    assert names == ["ValidationTop1", "ValidationTop5", "ValidationLoss"]
    assert "EmaValidationTop1" not in line and "ema_top5" not in line
    logger.finish({})


# -- the accuracy section ----------------------------------------------------------------------


def _eval(step: int, top1: float, *, ema: float | None = None) -> dict[str, Any]:
    """A validation record at ``step`` (64 samples a step, 0.5 s a step, 18 USD/h)."""
    r: dict[str, Any] = {
        "kind": "eval", "time": 0.0, "step": step, "top1": top1, "top5": min(1.0, top1 + 0.1),
        "val_loss": 1.0 - top1, "val_samples": 360, "eval_s": 1.0, "samples": step * 64,
        "wall_s": step * 0.5, "usd": step * 0.5 * PRICE / 3600,
    }  # fmt: skip
    if ema is not None:
        r.update(ema_top1=ema, ema_top5=min(1.0, ema + 0.05), ema_val_loss=0.5 - ema / 2)
    return r


def test_targets_are_reached_at_the_first_evaluation_at_or_over_them() -> None:
    evals = [_eval(60, 0.5), _eval(120, 0.75), _eval(180, 0.8), _eval(200, 0.91), _eval(240, 0.9)]
    assert accuracy_summary(evals, TARGETS) == {
        "metric": "top1",
        "targets": [
            {
                "target": 0.5,
                "reached": True,
                "step": 60,
                "samples": 3840,
                "wall_s": 30.0,
                "usd": 0.15,
                "weights": "raw",
            },
            {
                "target": 0.8,
                "reached": True,
                "step": 180,
                "samples": 11520,
                "wall_s": 90.0,
                "usd": 0.45,
                "weights": "raw",
            },
            {"target": 0.95, "reached": False},
        ],
        "best": {
            "top1": 0.91,
            "top5": 1.0,
            "val_loss": 1.0 - 0.91,
            "weights": "raw",
            "step": 200,
            "samples": 12800,
            "wall_s": 100.0,
            "usd": 0.5,
        },
        "final": {
            "top1": 0.9,
            "top5": 1.0,
            "val_loss": 1.0 - 0.9,
            "weights": "raw",
            "step": 240,
            "samples": 15360,
            "wall_s": 120.0,
            "usd": 0.6,
        },
    }


def test_each_evaluation_counts_with_its_better_weights_and_says_which() -> None:
    evals = [_eval(60, 0.5, ema=0.4), _eval(120, 0.7, ema=0.85), _eval(180, 0.9, ema=0.88)]
    acc = accuracy_summary(evals, (0.5, 0.8, 0.95))
    assert acc is not None
    assert [(t["target"], t.get("step"), t.get("weights")) for t in acc["targets"]] == [
        (0.5, 60, "raw"),
        (0.8, 120, "ema"),  # raw 0.7, EMA 0.85: the EMA's reached it
        (0.95, None, None),
    ]
    assert acc["targets"][1] == {
        "target": 0.8, "reached": True, "step": 120, "samples": 7680, "wall_s": 60.0,
        "usd": 0.3, "weights": "ema",
    }  # fmt: skip
    assert (acc["best"]["top1"], acc["best"]["step"], acc["best"]["weights"]) == (0.9, 180, "raw")
    # final: the raw weights; ema_best / ema_final: the EMA's alone, with their own figures.
    assert acc["final"] == {
        "top1": 0.9, "top5": 1.0, "val_loss": 1.0 - 0.9, "weights": "raw", "step": 180,
        "samples": 11520, "wall_s": 90.0, "usd": 0.45,
    }  # fmt: skip
    assert acc["ema_best"] == {
        "top1": 0.88, "top5": 0.88 + 0.05, "val_loss": 0.5 - 0.44, "weights": "ema", "step": 180,
        "samples": 11520, "wall_s": 90.0, "usd": 0.45,
    }  # fmt: skip
    assert acc["ema_final"] == acc["ema_best"]
    # An EMA best in the middle: best is the EMA's at 120 when it tops every raw figure.
    acc2 = accuracy_summary([_eval(60, 0.5, ema=0.6), _eval(120, 0.7, ema=0.95)], ())
    assert acc2 is not None and acc2["targets"] == []
    assert (acc2["best"]["top1"], acc2["best"]["weights"], acc2["best"]["step"]) == (
        0.95,
        "ema",
        120,
    )
    assert acc2["best"]["val_loss"] == 0.5 - 0.95 / 2  # the EMA's loss, not the raw one's


def test_the_first_of_equal_bests_is_the_best() -> None:
    acc = accuracy_summary([_eval(60, 0.9), _eval(120, 0.9)], ())
    assert acc is not None and acc["best"]["step"] == 60


def test_no_evaluation_means_no_accuracy_section(tmp_path: Path) -> None:
    assert accuracy_summary([], TARGETS) is None
    logger = _logger(tmp_path)
    interval = Interval(started=time.perf_counter() - 1.0, steps=4)
    logger.log(4, interval, loss=1.0, lr=0.1, data_wait_share=0.1, epoch=0)
    summary = logger.finish({"wall_s": 1.0})
    assert "accuracy" not in summary
    assert "accuracy" not in json.loads((tmp_path / "summary.json").read_text())


def test_finish_writes_the_accuracy_section_and_leaves_the_training_figures_alone(
    tmp_path: Path,
) -> None:
    logger = _logger(tmp_path)
    top1 = {10: 0.25, 20: 0.5, 30: 0.8125}
    for step in (10, 20, 30):
        interval = Interval(started=time.perf_counter() - 0.5, steps=10, data_wait_s=0.05)
        logger.log(step, interval, loss=3.0 - step / 10, lr=0.1, data_wait_share=0.1, epoch=0)
        logger.log_eval(
            step,
            EvalResult(top1=top1[step], top5=1.0, loss=1.0, samples=360, eval_s=0.25),
            samples_seen=step * 64,
            train_wall_s=step * 0.5,
        )
    summary = logger.finish({"stopped_by": "steps"})
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written == summary
    jsonl = _lines(tmp_path / "metrics.jsonl")
    assert [r.get("kind") for r in jsonl] == [None, "eval"] * 3
    # The training figures are those of the interval records alone, read back mixed or not.
    training = summarise(logger.records)
    assert summarise(jsonl) == training
    assert {k: summary[k] for k in training} == training
    assert summary["steps"] == 30 and summary["final_loss"] == 0.0
    assert summary["measured_steps"] == 20  # the first interval left out; no eval counted
    assert summary["accuracy"] == accuracy_summary(jsonl, TARGETS)
    assert [t["reached"] for t in summary["accuracy"]["targets"]] == [True, True, False]
    assert summary["accuracy"]["targets"][0]["step"] == 20  # top-1 0.5 at step 20
    assert summary["accuracy"]["targets"][1]["samples"] == 30 * 64  # 0.8125 at step 30
    assert summary["accuracy"]["targets"][1]["usd"] == 15.0 * PRICE / 3600
    assert (tmp_path / "metrics.png").is_file()


def test_summarise_ignores_validation_records() -> None:
    def interval(step: int) -> dict[str, Any]:
        return {
            "step": step, "loss": 1.0 / step, "steps": 10, "step_time_s": 0.1 * step,
            "samples_per_s": 100.0 * step, "data_wait_share": 0.01 * step,
            "samples_per_usd": 1000.0 * step, "host_cpu_pct": 50.0, "mfu": None,
            "gpu_util_pct": None,
        }  # fmt: skip

    training = [interval(10), interval(20), interval(30)]
    mixed = [training[0], _eval(10, 0.5), training[1], training[2], _eval(30, 0.6)]
    assert summarise(mixed) == summarise(training)
    assert summarise(training)["steps"] == 30
    assert summarise([_eval(10, 0.5)])["steps"] == 0  # validation alone: no training figures


# -- console, table, plot ----------------------------------------------------------------------


def test_the_console_lines() -> None:
    r = _eval(120, 0.8125, ema=0.8203125)
    r.update(val_samples=1360, eval_s=1.375, val_loss=0.625)
    assert eval_line(r) == (
        "eval step 120: top-1 81.2 %, top-5 91.2 %, loss 0.6250 (EMA top-1 82.0 %) "
        "over 1,360 images in 1.4 s"
    )
    interval = {
        "step": 130, "loss": 1.25, "samples_per_s": 100.0, "step_time_s": 0.64,
        "data_wait_share": 0.05, "samples_per_usd": 20000.0, "host_cpu_pct": 40.0,
    }  # fmt: skip
    line = progress_line(interval, 240, last_top1=0.8125)
    assert line.startswith("step 130/240 | loss 1.2500 |")
    assert line.endswith(" | cpu 40% | val top-1 81.2%")
    assert "top-1" not in progress_line(interval, 240)


def test_the_summary_table_rows(tmp_path: Path) -> None:
    evals = [_eval(60, 0.5, ema=0.45), _eval(120, 0.75, ema=0.81), _eval(200, 0.91, ema=0.9)]
    accuracy = accuracy_summary(evals, TARGETS)
    assert accuracy is not None
    assert accuracy_rows(accuracy) == [
        ("final top-1 / top-5", "91.0 % / 100.0 % (step 200)"),
        ("final val loss", "0.0900"),
        ("EMA final top-1 / top-5", "90.0 % / 95.0 % (step 200)"),
        ("EMA final val loss", "0.0500"),
        ("best top-1", "91.0 % at step 200"),
        ("top-1 >= 50 %", "step 60, 30 s, 3,840 samples, 0.150 USD"),
        ("top-1 >= 80 %", "step 120, 60 s, 7,680 samples, 0.300 USD (EMA)"),
        ("top-1 >= 95 %", "not reached"),
    ]
    long = {**evals[1], "step": 9000, "samples": 576000, "wall_s": 9000.0, "usd": 45.0}
    acc = accuracy_summary([long], (0.7,))
    assert acc is not None
    assert accuracy_rows(acc)[-1] == (
        "top-1 >= 70 %",
        "step 9000, 2.50 h, 576,000 samples, 45.000 USD (EMA)",
    )
    assert accuracy_rows(acc)[-2] == ("best top-1", "81.0 % at step 9000 (EMA)")
    # The rich table holds them below the training rows; without a price, no USD.
    unpriced = accuracy_summary([{**evals[0], "usd": None}], (0.5,))
    assert unpriced is not None
    console = Console(record=True, width=200)
    console.print(summary_table({"steps": 200, "accuracy": unpriced}))
    text = console.export_text()
    assert "top-1 >= 50 %" in text and "step 60, 30 s, 3,840 samples" in text
    assert "USD (EMA)" not in text and "3,840 samples, " not in text
    assert text.index("stopped by") < text.index("final top-1 / top-5")
    console = Console(record=True, width=200)
    console.print(summary_table({"steps": 200}))
    assert "top-1" not in console.export_text()


def _intervals() -> list[dict[str, Any]]:
    return [{"step": s, "samples_per_s": 100.0 + s, "data_wait_share": 0.1} for s in (10, 20, 30)]


def test_the_plot_adds_validation_panels_against_steps_and_usd(tmp_path: Path) -> None:
    evals = [_eval(10, 0.4, ema=0.45), _eval(20, 0.6, ema=0.7), _eval(30, 0.85, ema=0.8)]
    fig = figure([*_intervals(), *evals], targets=(0.5, 0.8))
    try:
        axes = fig.axes
        assert [a.get_ylabel() for a in axes] == [
            "samples/s (global)",
            "data-wait share (%)",
            "validation top-1 (%)",
            "validation top-1 (%)",
        ]
        assert [a.get_xlabel() for a in axes] == [
            "", "", "step", "USD (cluster price x training wall time)",
        ]  # fmt: skip
        by_step, by_usd = axes[2], axes[3]
        for ax, xs in ((by_step, [10, 20, 30]), (by_usd, [r["usd"] for r in evals])):
            solid = [ln for ln in ax.lines if ln.get_linestyle() == "-"]
            dashed = [ln for ln in ax.lines if ln.get_linestyle() == "--"]
            dotted = [ln for ln in ax.lines if ln.get_linestyle() == ":"]
            [raw] = solid
            [ema] = dashed
            assert list(raw.get_xdata()) == xs
            assert list(raw.get_ydata()) == pytest.approx([40.0, 60.0, 85.0])
            assert list(ema.get_ydata()) == pytest.approx([45.0, 70.0, 80.0])
            assert sorted(ln.get_ydata()[0] for ln in dotted) == pytest.approx([50.0, 80.0])
        # The training panels plot the interval records only.
        assert list(axes[0].lines[0].get_xdata()) == [10, 20, 30]
    finally:
        plt.close(fig)
    plot([*_intervals(), *evals], tmp_path / "metrics.png", targets=(0.5, 0.8))
    height, width, _ = matplotlib.image.imread(tmp_path / "metrics.png").shape
    assert (width, height) == (800, 1200)


def test_without_validation_the_plot_keeps_its_two_panels(tmp_path: Path) -> None:
    fig = figure(_intervals(), targets=(0.5,))
    try:
        assert [a.get_ylabel() for a in fig.axes] == ["samples/s (global)", "data-wait share (%)"]
        assert fig.axes[1].get_xlabel() == "step"
    finally:
        plt.close(fig)
    plot(_intervals(), tmp_path / "metrics.png")
    height, width, _ = matplotlib.image.imread(tmp_path / "metrics.png").shape
    assert (width, height) == (800, 600)


def test_without_a_price_the_usd_panel_says_so() -> None:
    fig = figure([{**_eval(10, 0.5), "usd": None}])
    try:
        by_usd = fig.axes[3]
        assert by_usd.lines == [] or all(len(ln.get_xdata()) == 0 for ln in by_usd.lines)
        assert [t.get_text() for t in by_usd.texts] == ["no price: USD unknown"]
    finally:
        plt.close(fig)
