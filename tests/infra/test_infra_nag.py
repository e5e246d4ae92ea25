"""cdk-nag: the AWS Solutions rules find nothing unacknowledged, every acknowledgment is needed
and carries a reason, and a finding really fails synthesis."""

from __future__ import annotations

from pathlib import Path

import aws_cdk as cdk
import pytest
from aws_cdk import aws_s3 as s3
from cdk_nag import AwsSolutionsChecks
from infra_support import EFA_SPEC, SPOT_SPEC, BuiltApp, build

import infra.nag
from infra.nag import add_nag_checks


@pytest.fixture(scope="module")
def spot(tmp_path_factory: pytest.TempPathFactory) -> BuiltApp:
    return build(tmp_path_factory.mktemp("spot"), SPOT_SPEC)


@pytest.fixture(scope="module")
def efa(tmp_path_factory: pytest.TempPathFactory) -> BuiltApp:
    return build(tmp_path_factory.mktemp("efa"), EFA_SPEC)


def _findings(scope: cdk.App) -> dict[str, list[str]]:
    """Rule id -> construct paths of every unacknowledged finding (errors and warnings)."""
    report = AwsSolutionsChecks().validate_scope(scope)
    return {
        v.rule_name: [r.construct_path or "" for r in v.violating_resources]
        for v in report.violations
    }


@pytest.mark.parametrize("which", ["spot", "efa"])
def test_no_unacknowledged_findings(which: str, request: pytest.FixtureRequest) -> None:
    built: BuiltApp = request.getfixturevalue(which)
    assert _findings(built.app) == {}


def test_every_acknowledgment_has_a_reason(spot: BuiltApp) -> None:
    assert spot.stacks.acknowledgments
    for ack in spot.stacks.acknowledgments:
        assert ack.rule.startswith("AwsSolutions-")
        assert len(ack.reason) >= 60, f"{ack.rule} on {ack.path}: give a real reason"


def test_each_acknowledgment_silences_a_real_finding(
    tmp_path: Path, spot: BuiltApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without the acknowledgments, exactly the acknowledged findings appear: so a finding
    # does fail the check, and no acknowledgment is left over from an old design.
    monkeypatch.setattr(infra.nag, "acknowledge_findings", lambda **_: [])
    bare = build(tmp_path, SPOT_SPEC)
    found = _findings(bare.app)
    acknowledged = {ack.rule for ack in spot.stacks.acknowledgments}
    assert set(found) == acknowledged


def test_a_finding_fails_synthesis(tmp_path: Path) -> None:
    app = cdk.App(outdir=str(tmp_path / "out"))
    add_nag_checks(app)
    stack = cdk.Stack(app, "Careless")
    s3.Bucket(stack, "Plain")  # no SSL enforcement, no access logs
    with pytest.raises(RuntimeError, match="AwsSolutions-S10"):
        app.synth()
