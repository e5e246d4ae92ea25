"""Cost to accuracy: expected hours and USD to reach a target, by hand for the small table of
tests/planner/support.py, the ranking by that USD, the target read from a run's summary.json,
and ``hetero plan --samples-to-target`` / ``--from-run`` end to end offline.

The terms are the planner's own (``PlanRow.expected_hours``/``expected_usd``, the ones time and
cost to train use): ``hours = samples / expected samples/s / 3600`` with ``expected samples/s =
nominal x Daly efficiency`` (On-Demand: 1), and ``USD = hours x USD/h`` of both groups.
"""

from __future__ import annotations

import copy
import csv
import json
import math
from pathlib import Path
from typing import Any

import botocore.endpoint
import pytest

from training import cli
from training.planner.candidates import parse_config
from training.planner.errors import PlanError
from training.planner.evaluate import DataprepPolicy, PlanRow
from training.planner.evaluate import rank as rank_candidates
from training.planner.prices import PriceBook
from training.planner.target import from_run, from_samples
from training.spec import load_spec

from .support import CATALOG, MEASURED, PRICES, facts, workload

REPO = Path(__file__).resolve().parents[2]
SEED = ["4 x g5.xlarge spot", "1 x g5.12xlarge on-demand"]
CONFIGS = ["4 x g.one spot", "1 x g.four on-demand", "1 x g.one spot", "1 x g.alt spot"]
POLICY = DataprepPolicy(types=("c.cpu",))
N = 7680

# The trainer's summary.json accuracy section (the schema hetero plan reads).
SUMMARY: dict[str, Any] = {
    "steps": 200,
    "accuracy": {
        "metric": "top1",
        "targets": [
            {"target": 0.5, "reached": True, "step": 60, "samples": 3840, "wall_s": 27.0},
            {
                "target": 0.8,
                "reached": True,
                "step": 120,
                "samples": 7680,
                "wall_s": 55.2,
                "usd": 0.0123,
            },
            {"target": 0.95, "reached": False},
        ],
        "best": {"top1": 0.91, "step": 200, "samples": 12800, "wall_s": 90.1, "usd": 0.02},
    },
}


def ranked(samples_to_target: int | None) -> list[PlanRow]:
    rows, excluded = rank_candidates(
        [parse_config(c, CATALOG) for c in CONFIGS],
        workload(),
        facts(),
        MEASURED,
        PriceBook(PRICES, CATALOG),
        POLICY,
        samples_to_target=samples_to_target,
    )
    assert excluded == []
    return rows


def test_hours_and_usd_to_target_by_hand() -> None:
    rows = {r.label: r for r in ranked(N)}
    for r in rows.values():
        # Exactly the planner's expected samples/s, the figure its samples per dollar uses.
        assert r.samples_to_target == N
        assert r.hours_to_target == N / r.expected_samples_per_s / 3600
        assert r.usd_to_target == N / r.expected_samples_per_s / 3600 * r.usd_per_hour

    # By hand (test_plan_ranking.py derives each rate and efficiency):
    # 1 x g.alt spot: 1,000 samples/s x Daly efficiency (band "lo", M = 2e6 s, tau = 8485.28 s)
    # = 995.68 expected; 7,680 / 995.68 / 3600 = 0.0021426 h; x 0.91 USD/h = 0.0019498 USD.
    eff_alt = 1 - 18 / math.sqrt(7.2e7) - (math.sqrt(7.2e7) / 2 + 150) / 2e6
    alt = rows["1 x g.alt spot"]
    assert alt.hours_to_target == pytest.approx(N / (1000 * eff_alt) / 3600, rel=1e-12)
    assert alt.hours_to_target == pytest.approx(0.0021426, rel=1e-4)
    assert alt.usd_to_target == pytest.approx(N / (1000 * eff_alt) / 3600 * 0.91, rel=1e-12)
    assert alt.usd_to_target == pytest.approx(0.0019498, rel=1e-4)
    # 1 x g.one spot: band "hi" (M = 5e4 s, tau = 1341.64 s): 970.17 expected samples/s,
    # 0.90 USD/h -> 0.0021989 h, 0.0019790 USD.
    eff_one = 1 - 18 / math.sqrt(1.8e6) - (math.sqrt(1.8e6) / 2 + 150) / 5e4
    one = rows["1 x g.one spot"]
    assert one.hours_to_target == pytest.approx(N / (1000 * eff_one) / 3600, rel=1e-12)
    assert one.usd_to_target == pytest.approx(0.0019790, rel=1e-4)
    # 1 x g.four on-demand: 4,000 samples/s, efficiency 1, 4.40 + 3 x 0.50 = 5.90 USD/h:
    # 7,680 / 4,000 / 3600 = 0.00053333 h, x 5.90 = 0.0031467 USD.
    four = rows["1 x g.four on-demand"]
    assert four.hours_to_target == pytest.approx(N / 4000 / 3600, rel=1e-12)
    assert four.usd_to_target == pytest.approx(N / 4000 / 3600 * 5.90, rel=1e-12)
    assert four.usd_to_target == pytest.approx(0.0031467, rel=1e-4)
    # 4 x g.one spot, network-bound: 400 / 0.603 = 663.35 nominal x 0.934334 = 619.79
    # expected, 2.10 USD/h -> 0.0034420 h, 0.0072283 USD.
    eff_4 = 1 - 18 / math.sqrt(4.5e5) - (math.sqrt(4.5e5) / 2 + 150) / 12_500
    four_spot = rows["4 x g.one spot"]
    assert four_spot.hours_to_target == pytest.approx(N / (400 / 0.603 * eff_4) / 3600, rel=1e-12)
    assert four_spot.usd_to_target == pytest.approx(
        N / (400 / 0.603 * eff_4) / 3600 * 2.10, rel=1e-12
    )
    assert four_spot.usd_to_target == pytest.approx(0.0072283, rel=1e-4)


def test_rows_rank_by_expected_usd_to_target() -> None:
    rows = ranked(N)
    # Cheapest first: 0.0019498 < 0.0019790 < 0.0031467 < 0.0072283 USD. g.four is the
    # fastest (0.00053 h) but not the cheapest; g.one is cheaper per hour than g.alt yet costs
    # more to reach the target (its band interrupts it 40 x as often).
    assert [r.label for r in rows] == [
        "1 x g.alt spot",
        "1 x g.one spot",
        "1 x g.four on-demand",
        "4 x g.one spot",
    ]
    usd = [r.usd_to_target for r in rows]
    assert usd == sorted(u for u in usd if u is not None)
    assert min(rows, key=lambda r: r.hours_to_target or 0).label == "1 x g.four on-demand"
    # For one sample count, USD to target = samples / expected samples per dollar: the same
    # order as without a target, now with a price and a time on it.
    assert [r.label for r in ranked(None)] == [r.label for r in rows]
    for r in rows:
        assert r.usd_to_target == pytest.approx(N / r.expected_samples_per_usd, rel=1e-12)
    # Without a target there are no target figures.
    assert all(r.usd_to_target is None and r.hours_to_target is None for r in ranked(None))


# --------------------------------------------------------------------------------------------
# Reading the target from summary.json


def summary_file(tmp_path: Path, document: Any = SUMMARY) -> Path:
    path = tmp_path / "run" / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document))
    return path


def none_reached() -> dict[str, Any]:
    document = copy.deepcopy(SUMMARY)
    document["accuracy"]["targets"] = [
        {"target": 0.95, "reached": False},
        {"target": 0.99, "reached": False},
    ]
    return document


def test_the_target_chosen_with_target(tmp_path: Path) -> None:
    path = summary_file(tmp_path)
    t = from_run(path, 0.5)
    assert (t.samples, t.metric, t.value, t.step, t.best) == (3840, "top1", 0.5, 60, False)
    assert t.description == f"top1 >= 0.5 (from {path}, step 60)"
    assert (t.run_wall_s, t.run_usd, t.source) == (27.0, None, str(path))


def test_without_target_the_highest_reached(tmp_path: Path) -> None:
    path = summary_file(tmp_path)
    t = from_run(path)
    assert (t.samples, t.value, t.step, t.best) == (7680, 0.8, 120, False)
    assert (t.run_wall_s, t.run_usd) == (55.2, 0.0123)
    # A run folder means its summary.json.
    assert from_run(path.parent) == t


def test_none_reached_falls_back_to_the_best_accuracy_and_says_so(tmp_path: Path) -> None:
    path = summary_file(tmp_path, none_reached())
    t = from_run(path)
    assert (t.samples, t.value, t.step, t.best) == (12800, 0.91, 200, True)
    assert t.description == (
        "the best accuracy reached, top1 0.91, not a target: no target (0.95, 0.99) was reached "
        f"(from {path}, step 200)"
    )
    assert t.record()["best_reached_not_a_target"] is True


@pytest.mark.parametrize(
    ("document", "target", "message"),
    [
        (
            SUMMARY,
            0.95,
            "--target 0.95 was not reached in {path}; the run reached: 0.5, 0.8. Pass one of "
            "those, leave out --target for the highest reached",
        ),
        (
            SUMMARY,
            0.7,
            "--target 0.7 is not among the targets of {path} (0.5, 0.8, 0.95); the run reached: "
            "0.5, 0.8.",
        ),
        (none_reached(), 0.95, "--target 0.95 was not reached in {path}; the run reached: none."),
        (
            {"steps": 10, "final_loss": 1.0},
            None,
            "--from-run: {path} has no 'accuracy' section: the run was not evaluated against "
            "accuracy targets. Rerun training with validation and accuracy targets so that its "
            "summary.json records the samples to each target, or give --samples-to-target N",
        ),
        (
            {"accuracy": {"metric": "top1", "targets": [{"target": 0.9, "reached": False}]}},
            None,
            "--from-run: no target was reached in {path} (targets: 0.9) and it records no best "
            "accuracy; train longer or with lower targets, or give --samples-to-target N",
        ),
        (
            {"accuracy": {"metric": "top1", "targets": [{"target": 0.9, "reached": True}]}},
            None,
            "{path}: target 0.9 has no valid 'samples' (got None)",
        ),
    ],
)
def test_summary_errors_say_what_to_do(
    tmp_path: Path, document: Any, target: float | None, message: str
) -> None:
    path = summary_file(tmp_path, document)
    with pytest.raises(PlanError) as e:
        from_run(path, target)
    assert message.format(path=path) in str(e.value)


def test_missing_or_unreadable_summary(tmp_path: Path) -> None:
    missing = tmp_path / "runs" / "x" / "summary.json"
    with pytest.raises(PlanError) as e:
        from_run(missing)
    assert str(e.value) == (
        f"--from-run: no such file {missing}; pass the summary.json of a finished training run "
        "(e.g. runs/NAME/summary.json), or give --samples-to-target N"
    )
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(PlanError, match=r"cannot read .* as JSON"):
        from_run(broken)


def test_samples_to_target_must_be_positive() -> None:
    assert from_samples(5000).samples == 5000
    with pytest.raises(PlanError, match="--samples-to-target must be at least 1, got 0"):
        from_samples(0)


# --------------------------------------------------------------------------------------------
# The command, offline


@pytest.fixture
def no_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("hetero plan --offline sent an AWS request")

    monkeypatch.setattr(botocore.endpoint.Endpoint, "make_request", refuse)


def run_plan(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["plan", "--spec", str(REPO / "cluster.toml"), "--offline", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_from_run_end_to_end(
    no_requests: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = summary_file(tmp_path)
    out_dir = tmp_path / "plan"
    winner = tmp_path / "winner.toml"
    compare = [*SEED, "2 x g5.xlarge spot"]
    code, out, err = run_plan(
        [
            "--out",
            str(out_dir),
            "--compare",
            *compare,
            "--from-run",
            str(path),
            "--target",
            "0.8",
            "--write-spec",
            str(winner),
        ],
        capsys,
    )
    assert code == 0, err
    assert "ranked by expected USD to target" in out
    assert f"samples to target: 7,680, top1 >= 0.8 (from {path}, step 120)" in out
    assert "USD to target" in out and "h to target" in out

    plan = json.loads((out_dir / "plan.json").read_text())
    assert plan["ranked_by"] == "usd_to_target"
    assert plan["target"] == {
        "samples": 7680,
        "description": f"top1 >= 0.8 (from {path}, step 120)",
        "metric": "top1",
        "value": 0.8,
        "best_reached_not_a_target": False,
        "source": str(path),
        "step": 120,
        "run_wall_s": 55.2,
        "run_usd": 0.0123,
    }
    ranked_rows = plan["ranked"]
    assert len(ranked_rows) == 3
    usd = [r["usd_to_target"] for r in ranked_rows]
    assert usd == sorted(usd)
    for r in ranked_rows:
        assert r["samples_to_target"] == 7680
        # The JSON's rounded expected rate gives the same figures to its precision.
        hours = 7680 / r["samples_per_s_expected"] / 3600
        assert r["hours_to_target"] == pytest.approx(hours, rel=1e-3)
        assert r["usd_to_target"] == pytest.approx(hours * r["usd_per_hour"], rel=1e-3)
        # Samples per dollar stay beside it.
        assert r["samples_per_usd_expected"] > 0 and r["samples_per_usd_nominal"] > 0

    with (out_dir / "plan.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["configuration"] for r in rows] == [r["configuration"] for r in ranked_rows]
    for row, record in zip(rows, ranked_rows, strict=True):
        assert row["usd_to_target"] == str(record["usd_to_target"])
        assert row["hours_to_target"] == str(record["hours_to_target"])
        assert row["samples_to_target"] == "7680"
    png = (out_dir / "plan.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    # --write-spec writes the cheapest to reach the target.
    written = load_spec(winner).trainer_group
    top = ranked_rows[0]["configuration"]
    assert f"{written.count} x {written.instance_types[0]} {written.market.value}" == top
    assert "# Cheapest expected cost to reach the target: " in winner.read_text()


def test_samples_to_target_and_best_fallback_end_to_end(
    no_requests: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_plan(
        ["--out", str(tmp_path / "a"), "--compare", *SEED, "--samples-to-target", "1000000"],
        capsys,
    )
    assert code == 0, err
    assert "samples to target: 1,000,000, given with --samples-to-target" in out
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert plan["target"]["samples"] == 1_000_000 and plan["target"]["source"] is None
    assert [r["samples_to_target"] for r in plan["ranked"]] == [1_000_000, 1_000_000]

    path = summary_file(tmp_path, none_reached())
    code, out, err = run_plan(
        ["--out", str(tmp_path / "b"), "--compare", *SEED, "--from-run", str(path)], capsys
    )
    assert code == 0, err
    assert "samples to target: 12,800, the best accuracy reached, top1 0.91, not a target" in out
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    assert plan["target"]["best_reached_not_a_target"] is True

    # Without a target: the columns are there, empty, and the ranking is by samples per dollar.
    code, out, err = run_plan(["--out", str(tmp_path / "c"), "--compare", *SEED], capsys)
    assert code == 0, err
    assert "ranked by expected samples per dollar" in out and "USD to target" not in out
    plan = json.loads((tmp_path / "c" / "plan.json").read_text())
    assert plan["target"] is None and plan["ranked_by"] == "samples_per_usd_expected"
    with (tmp_path / "c" / "plan.csv").open() as f:
        assert {r["usd_to_target"] for r in csv.DictReader(f)} == {""}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", "0.8"], "--target needs --from-run RUN/summary.json"),
        (["--samples-to-target", "0"], "--samples-to-target must be at least 1, got 0"),
        (["--from-run", "{tmp}/nothing/summary.json"], "--from-run: no such file {tmp}/nothing"),
    ],
)
def test_cli_target_errors_exit_2(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [a.format(tmp=tmp_path) for a in args]
    code, _out, err = run_plan(["--out", str(tmp_path / "plan"), *args], capsys)
    assert code == 2
    assert err.startswith("hetero plan: ") and message.format(tmp=tmp_path) in err
    assert not (tmp_path / "plan").exists()


def test_samples_to_target_and_from_run_exclude_each_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        run_plan(["--samples-to-target", "10", "--from-run", str(tmp_path)], capsys)
    assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
