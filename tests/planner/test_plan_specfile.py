"""``--write-spec``: the winner written into a spec that ``load_spec`` and ``hetero spec check``
accept and that the CDK app synthesizes."""

from __future__ import annotations

import datetime
import importlib.util
import math
import sys
import tomllib
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from training import cli
from training.common.names import asg_name
from training.planner.cli import make_plan
from training.planner.errors import PlanError
from training.planner.evaluate import Plan
from training.planner.placement import Placement
from training.planner.specfile import dumps, write_spec
from training.spec import ClusterSpec, Market, Parallelism, load_spec

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
NOW = datetime.datetime(2026, 11, 22, 6, 0, tzinfo=datetime.UTC)
COMPARE = ["1 x g6.xlarge spot", "1 x g5.xlarge spot", "1 x g5.12xlarge on-demand"]


def offline_plan(spec_path: Path, compare: list[str] = COMPARE) -> Plan:
    return make_plan(
        load_spec(spec_path), compare, region="us-east-1", results_dir=RESULTS, now=NOW
    )


def test_winner_is_written_and_the_spec_check_accepts_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # cluster.toml with two trainers instead of its one, so the winner's one GPU takes more steps.
    text = (REPO / "cluster.toml").read_text()
    assert "\ncount = 1 " in text  # the trainer group's, the first group
    source = tmp_path / "two-trainers.toml"
    source.write_text(text.replace("\ncount = 1 ", "\ncount = 2 ", 1))
    original = load_spec(source)
    plan = offline_plan(source)
    winner = plan.rows[0]
    assert winner.label == "1 x g5.xlarge spot"  # A10G Spot: the most samples per dollar here
    dest = tmp_path / "winner.toml"
    written = write_spec(source, dest, original, plan)

    assert load_spec(dest) == replace(written, source=str(dest))
    trainer = written.trainer_group
    # The winner first, then the other 1-GPU Spot type ranked with it (scored together on AWS).
    assert trainer.instance_types == ("g5.xlarge", "g6.xlarge")
    assert (trainer.count, trainer.market, trainer.name) == (1, Market.SPOT, "trainer")
    (dataprep,) = written.dataprep_groups
    assert (dataprep.name, dataprep.instance_types, dataprep.count) == (
        "dataprep",
        (winner.dataprep.instance_type,),
        winner.dataprep.count,
    )
    # Same samples as the spec: 1000 steps x 64 x 2 ranks = 128,000 -> 2,000 steps on 1 GPU.
    assert original.job.total_steps == 1000 and original.world_size == 2
    assert written.job.steps == math.ceil(128_000 / 64) == 2_000
    assert written.job.checkpoint.interval_steps == min(winner.interval_steps, 2_000)
    # Prices the plan used, so `hetero spec check` shows the same cluster cost.
    prices = written.job.prices.usd_per_hour
    assert prices["g5.xlarge"] == round(winner.trainer_price.usd_per_hour, 6)
    assert prices[winner.dataprep.instance_type] == round(winner.dataprep.price.usd_per_hour, 6)
    assert written.usd_per_hour() == pytest.approx(winner.usd_per_hour, abs=1e-5)
    # Everything else is kept.
    assert (written.name, written.job.model, written.job.dataplane, written.job.augmentation) == (
        original.name,
        original.job.model,
        original.job.dataplane,
        original.job.augmentation,
    )
    assert written.availability_zone_index == original.availability_zone_index  # no score
    text = dest.read_text()
    assert text.startswith("# Written by `hetero plan` on 2026-11-22 06:00 UTC from ")
    assert "# prices: offline: On-Demand us-east-1 list prices as of 2026-07-20" in text

    assert cli.main(["spec", "check", "--spec", str(dest)]) == 0
    assert f"cluster {winner.usd_per_hour:.2f} USD/h" in capsys.readouterr().out


def test_a_scored_zone_is_written_as_the_az_index(tmp_path: Path) -> None:
    plan = offline_plan(REPO / "cluster.toml")
    plan.rows[0] = replace(
        plan.rows[0],
        placement=Placement(("g6.xlarge", "g5.xlarge"), 1, 8, "us-east-1c", 2),
    )
    written = write_spec(
        REPO / "cluster.toml", tmp_path / "w.toml", load_spec(REPO / "cluster.toml"), plan
    )
    assert written.availability_zone_index == 2


def test_hsdp_degrees_follow_the_new_cluster(tmp_path: Path) -> None:
    source = tmp_path / "hsdp.toml"
    source.write_text(
        "name = 'hsdp'\n[[groups]]\nname = 'gpu'\nrole = 'trainer'\n"
        "instance_types = ['g5.12xlarge']\ncount = 2\nmarket = 'on-demand'\n"
        "[job]\nsteps = 10\n[job.parallelism]\nstrategy = 'hsdp'\nshard_degree = 4\n"
        "replicate_degree = 2\n"
    )
    plan = offline_plan(source, ["1 x g5.12xlarge on-demand"])
    written = write_spec(source, tmp_path / "out.toml", load_spec(source), plan)
    assert written.job.parallelism.strategy is Parallelism.HSDP
    assert (written.job.parallelism.shard_degree, written.job.parallelism.replicate_degree) == (
        None,
        None,
    )
    # No dataprep group in the source: one is added with the planned type.
    assert [g.name for g in written.dataprep_groups] == ["dataprep"]


def test_nothing_ranked_means_nothing_written(tmp_path: Path) -> None:
    plan = offline_plan(REPO / "cluster.toml", ["1 x p4d.24xlarge on-demand + 1 x c6i.4xlarge"])
    assert plan.rows == []
    with pytest.raises(PlanError, match="every configuration was excluded"):
        write_spec(
            REPO / "cluster.toml", tmp_path / "x.toml", load_spec(REPO / "cluster.toml"), plan
        )
    assert not (tmp_path / "x.toml").exists()


def test_toml_writer_reads_back_exactly() -> None:
    doc = {
        "name": 'quote " and \\ back',
        "unicode": "naïve ✓",
        "n": 3,
        "x": 0.001,
        "flag": False,
        "list": ["a", "b"],
        "empty": {},
        "groups": [
            {"name": "a", "types": ["g5.xlarge"], "inline": {"k": 1}},
            {"name": "b", "sub": {"deep": {"v": 1.5}}},
        ],
        "job": {"model": {"name": "m", "overrides": {"depth": 2}}, "dotted.key": "v"},
    }
    assert tomllib.loads(dumps(doc)) == doc


def _infra_support() -> ModuleType:
    """tests/infra/infra_support.py (tests/infra is not a package: load it by path)."""
    name = "planner_infra_support"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, REPO / "tests" / "infra" / "infra_support.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory: pytest.TempPathFactory) -> tuple[Plan, ClusterSpec, Any]:
    """The winner of the offline plan, written and built into both stacks, once per module: the
    CDK app's jsii process lives as long as the session, like the infra tests' module fixtures."""
    pytest.importorskip("aws_cdk")
    tmp = tmp_path_factory.mktemp("synth")
    plan = offline_plan(REPO / "cluster.toml")
    dest = tmp / "winner.toml"
    written = write_spec(REPO / "cluster.toml", dest, load_spec(REPO / "cluster.toml"), plan)
    (tmp / "app").mkdir()
    return plan, written, _infra_support().build(tmp / "app", dest.read_text())


def test_the_written_spec_synthesizes(synthesized: tuple[Plan, ClusterSpec, Any]) -> None:
    plan, written, built = synthesized

    def asg(group: str) -> dict[str, Any]:
        name = asg_name(built.stacks.cluster.stack_name.removesuffix("-cluster"), group)
        (found,) = built.cluster.find_resources(
            "AWS::AutoScaling::AutoScalingGroup", {"Properties": {"AutoScalingGroupName": name}}
        ).values()
        return dict(found["Properties"])

    def types(props: dict[str, Any]) -> list[str]:
        overrides = props["MixedInstancesPolicy"]["LaunchTemplate"]["Overrides"]
        return [o["InstanceType"] for o in overrides]

    # The stacks build exactly the groups the plan chose.
    trainer, dataprep = asg("trainer"), asg("dataprep")
    assert types(trainer) == ["g5.xlarge", "g6.xlarge"]
    assert trainer["DesiredCapacity"] == "1"
    assert types(dataprep) == [plan.rows[0].dataprep.instance_type]
    assert dataprep["DesiredCapacity"] == str(written.dataprep_groups[0].count)
