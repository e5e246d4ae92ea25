"""cfn-lint (errors) on every synthesized template: the repository's default spec, an EFA spec
(p4d) and a group mixing p5 and p4d. cfn-lint checks properties, types and values against the
CloudFormation resource specification, so a template CloudFormation would reject fails here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cfnlint.api import ManualArgs, lint
from infra_support import EFA_SPEC, MIXED_EFA_SPEC, REPO_ROOT, build

SPECS = {
    "default": (REPO_ROOT / "cluster.toml").read_text(),
    "efa-p4d": EFA_SPEC,
    "efa-p5-p4d": MIXED_EFA_SPEC,
}
REGIONS = ["us-east-1", "us-west-2", "eu-west-1"]


def _errors(template: dict[str, object]) -> list[str]:
    matches = lint(json.dumps(template), regions=REGIONS, config=ManualArgs(regions=REGIONS))
    return [f"{m.rule.id} {m.message} ({'/'.join(map(str, m.path))})"
            for m in matches if m.rule.id.startswith("E")]  # fmt: skip


@pytest.mark.parametrize("which", sorted(SPECS))
def test_every_synthesized_template_passes_cfn_lint(which: str, tmp_path: Path) -> None:
    built = build(tmp_path, SPECS[which])
    for name, template in (("network", built.network), ("cluster", built.cluster)):
        assert _errors(template.to_json()) == [], f"{which} {name}"


def test_cfn_lint_catches_an_invalid_template(tmp_path: Path) -> None:
    """The check can fail: a launch template whose interface has a bad type is an error."""
    built = build(tmp_path, EFA_SPEC)
    template = built.cluster.to_json()
    lt = next(r for r in template["Resources"].values() if r["Type"] == "AWS::EC2::LaunchTemplate")
    lt["Properties"]["LaunchTemplateData"]["NetworkInterfaces"][0]["DeviceIndex"] = "first"
    assert any(e.startswith("E3") for e in _errors(template))
