"""``hetero plan`` end to end: the three files, offline with no credentials (no AWS call made),
and errors that say what to fix."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import botocore.endpoint
import pytest

from training import cli
from training.spec import Market, load_spec

REPO = Path(__file__).resolve().parents[2]
SEED = ["4 x g5.xlarge spot", "1 x g5.12xlarge on-demand"]


@pytest.fixture
def no_aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No credentials anywhere, and any request botocore tries to send fails the test."""
    import os

    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "nowhere" / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "nowhere" / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("hetero plan sent an AWS request without credentials")

    monkeypatch.setattr(botocore.endpoint.Endpoint, "make_request", refuse)


def run_plan(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["plan", "--spec", str(REPO / "cluster.toml"), *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_is_registered_as_a_subcommand() -> None:
    assert cli.SUBCOMMANDS["plan"][0] == "training.planner.cli"


def test_without_credentials_it_plans_offline_and_writes_three_files(
    no_aws: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "plan"
    compare = [*SEED, "1 x p4d.24xlarge on-demand + 1 x c6i.4xlarge spot"]
    winner = tmp_path / "winner.toml"
    code, out, err = run_plan(
        ["--out", str(out_dir), "--compare", *compare, "--write-spec", str(winner)], capsys
    )
    assert code == 0, err
    written = load_spec(winner).trainer_group
    assert (written.instance_types, written.count, written.market) == (
        ("g5.12xlarge",),
        1,
        Market.ON_DEMAND,
    )
    assert f"wrote {winner} (check it: hetero spec check --spec {winner})" in out
    assert "note: no AWS credentials found: offline prices and no placement scores" in out
    assert "prices: offline: On-Demand us-east-1 list prices as of 2026-07-20" in out
    assert "placement scores: none (offline: not invented)" in out
    assert sorted(p.name for p in out_dir.iterdir()) == ["plan.csv", "plan.json", "plan.png"]

    plan = json.loads((out_dir / "plan.json").read_text())
    assert plan["live"] is False and plan["region"] == "us-east-1"
    assert [r["configuration"] for r in plan["ranked"]] == [
        "1 x g5.12xlarge on-demand",
        "4 x g5.xlarge spot",
    ]
    # p4d's 8 GPUs need ~47 dataprep vCPUs; the one c6i.4xlarge given has 15.
    assert plan["excluded"] == [
        {
            "configuration": "1 x p4d.24xlarge on-demand + 1 x c6i.4xlarge spot",
            "reason": plan["excluded"][0]["reason"],
        }
    ]
    assert plan["excluded"][0]["reason"].startswith("too few CPUs: 1 x c6i.4xlarge has 15 usable")
    assert any("2026-07-20" in s for s in plan["price_sources"])
    seed_spot = plan["ranked"][1]
    assert seed_spot["network_bound"] is True and seed_spot["placement_score"] is None

    with (out_dir / "plan.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["configuration"] for r in rows] == [
        *(r["configuration"] for r in plan["ranked"]),
        compare[2],
    ]
    assert rows[0]["samples_per_usd_expected"] == str(plan["ranked"][0]["samples_per_usd_expected"])
    assert rows[2]["excluded_reason"] == plan["excluded"][0]["reason"]
    assert all(r["plan_date"] == plan["created"][:16] + "Z" for r in rows)

    png = (out_dir / "plan.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_offline_flag_makes_no_session(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import boto3

    def no_session(*args: object, **kwargs: object) -> None:
        raise AssertionError("--offline must not open an AWS session")

    monkeypatch.setattr(boto3, "Session", no_session)
    monkeypatch.setattr("training.planner.cli.known_regions", lambda: {"us-east-1", "eu-west-1"})
    code, _out, err = run_plan(
        ["--out", str(tmp_path), "--offline", "--region", "eu-west-1"], capsys
    )
    assert code == 0, err
    # us-east-1 list prices, said to be so for another region.
    assert (
        "(not eu-west-1's)"
        in json.loads((tmp_path / "plan.json").read_text())["ranked"][0]["trainer_price_source"]
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--compare", "4 x g5.xlarg spot"], "unknown instance type 'g5.xlarg' (did you mean"),
        (["--region", "us-esat-1"], "unknown region 'us-esat-1' (did you mean "),
        (["--samples", "0"], "--samples must be at least 1"),
    ],
)
def test_errors_exit_2_and_say_what_to_fix(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _out, err = run_plan(["--out", str(tmp_path), "--offline", *args], capsys)
    assert code == 2
    assert err.startswith("hetero plan: ") and message in err
    if "region" in message:  # the valid regions come from botocore's endpoint data
        assert "us-east-1" in err.split("valid regions: ")[1].split(", ")
    assert not (tmp_path / "plan.json").exists()
