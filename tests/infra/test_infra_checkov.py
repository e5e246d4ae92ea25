"""checkov on the synthesized templates of the default spec, an EFA spec and a SageMaker-enabled
spec: no failed check beyond ``SKIPS``, each accepted finding scoped to the resources it is
accepted on and given its reason, so a new finding (a new check id, or a known one on another
resource) fails here.

checkov runs as a command-line tool from its own virtualenv (``make install-dev`` builds
``.venv-tools/checkov`` at the Makefile's ``CHECKOV_VERSION``): every checkov 3 release pins
``boto3==1.35.49``, which the project's pinned boto3 excludes. One run reads every template (about
4 s on 2 cores, plus the synthesis), with no check skipped on its command line: ``--skip-check``
would skip a check on every resource (hiding the same finding on a new one) and would no longer
report a skip that has gone stale. The test does the filtering instead, from checkov's JSON."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from infra_support import EFA_SPEC, REPO_ROOT, SAGEMAKER_SPEC, build

CHECKOV = REPO_ROOT / ".venv-tools" / "checkov" / "bin" / "checkov"
_PIN = re.search(r"^CHECKOV_VERSION := (\S+)$", (REPO_ROOT / "Makefile").read_text(), re.M)
assert _PIN, "the Makefile no longer pins CHECKOV_VERSION"
PINNED_VERSION = _PIN.group(1)

SPECS = {
    "default": (REPO_ROOT / "cluster.toml").read_text(),
    "efa": EFA_SPEC,
    "sagemaker": SAGEMAKER_SPEC,
}
# A copy of the default cluster template with the checkpoint bucket's public access block removed:
# checkov must report it, so this test can fail.
CANARY = "canary-cluster"

SAR_EC2 = "https://docs.aws.amazon.com/service-authorization/latest/reference/list_amazonec2.html"
SAGEMAKER_ROLES = "https://docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-roles.html"
SAGEMAKER_ENI = (
    "the SageMaker role's statement of ec2:CreateNetworkInterface, "
    "ec2:CreateNetworkInterfacePermission, ec2:DeleteNetworkInterface and "
    "ec2:DeleteNetworkInterfacePermission on Resource '*'. SageMaker creates and deletes a VPC "
    "training job's network interfaces with its execution role, and its documented "
    f"execution-role policy grants these four on '*' ({SAGEMAKER_ROLES}, 'CreateTrainingJob API: "
    "Execution Role Permissions'). The Service Authorization Reference lists resource types for "
    f"them ({SAR_EC2}), so they could be narrowed to the cluster subnet and security group, but "
    "that is untested against a real SageMaker job; the accepted exception of docs/security.md, "
    "held to this role by test_security_invariants.py (SAGEMAKER_ENI_ACTIONS)"
)


@dataclass(frozen=True)
class Skip:
    """A check whose failure is accepted on exactly these resources (``Type.LogicalId``, as
    checkov names them), in every template where they exist."""

    reason: str
    resources: frozenset[str]


SKIPS: dict[str, Skip] = {
    "CKV_AWS_158": Skip(
        "wants a customer managed KMS key on each log group. CloudWatch Logs always encrypts log "
        "data at rest, with server-side encryption by default "
        "(https://docs.aws.amazon.com/AmazonCloudWatch/latest/logs/encrypt-log-data-kms.html); "
        "a key of our own was decided against (docs/security.md: every reader is in the account, "
        "and a key adds a key policy to keep and a KMS cost)",
        frozenset(
            {
                "AWS::Logs::LogGroup.ContainerLogsB6BC7C88",
                "AWS::Logs::LogGroup.NetworkFlowLogs2BEC3212",
            }
        ),
    ),
    "CKV_AWS_18": Skip(
        "wants S3 server access logging on the checkpoint bucket, which needs a second log bucket "
        "per cluster. The bucket is private, SSL-only, versioned and written only by the "
        "cluster's two roles; where an access audit is required, CloudTrail's S3 data events "
        "record object-level requests without one "
        "(https://docs.aws.amazon.com/AmazonS3/latest/userguide/cloudtrail-logging-s3-info.html"
        "#cloudtrail-data-events). The same finding as cdk-nag's AwsSolutions-S1 (infra/nag.py)",
        frozenset({"AWS::S3::Bucket.CheckpointsBucket6BA0C50D"}),
    ),
    "CKV_AWS_109": Skip(
        "wants no permissions-management action without a resource constraint: "
        "ec2:CreateNetworkInterfacePermission and ec2:DeleteNetworkInterfacePermission in "
        + SAGEMAKER_ENI,
        frozenset({"AWS::IAM::Policy.SageMakerRoleDefaultPolicy21C5BC01"}),
    ),
    "CKV_AWS_111": Skip(
        "wants no write action without a resource constraint: ec2:CreateNetworkInterface and "
        "ec2:DeleteNetworkInterface in " + SAGEMAKER_ENI + "; and the SSM agent's Session "
        "Manager actions on the instance role, ssm:UpdateInstanceInformation and the four "
        "ssmmessages channel actions on Resource '*', as AWS's minimal Session Manager policy "
        "grants them (the ssmmessages actions have no resource types: "
        "https://docs.aws.amazon.com/systems-manager/latest/userguide/"
        "getting-started-create-iam-instance-profile.html)",
        frozenset(
            {
                "AWS::IAM::Policy.SageMakerRoleDefaultPolicy21C5BC01",
                "AWS::IAM::Policy.InstanceRoleDefaultPolicy1064ADAC",
            }
        ),
    ),
}


@dataclass(frozen=True)
class Finding:
    check_id: str
    template: str  # "<spec>-<stack>", the file name without .template.json
    resource: str  # Type.LogicalId

    def __str__(self) -> str:
        return f"{self.check_id} {self.template} {self.resource}"


@dataclass
class Scan:
    templates: list[str]
    summary: dict[str, Any]
    failed: list[Finding]
    scanned: set[str]  # templates with at least one check result


def _template_name(file_path: str) -> str:
    return Path(file_path).name.removesuffix(".template.json")


def _run_checkov(files: list[Path]) -> list[dict[str, Any]]:
    if not CHECKOV.exists():
        pytest.fail(f"{CHECKOV.relative_to(REPO_ROOT)} is missing: run `make install-dev`")
    # Not --quiet: its JSON leaves out the passed checks, which show that every template was read.
    env = {**os.environ, "CKV_SKIP_PACKAGE_UPDATE_CHECK": "true", "LOG_LEVEL": "WARNING"}
    proc = subprocess.run(
        [str(CHECKOV), "--framework", "cloudformation", "--output", "json", "--compact",
         "--skip-download", "--file", *map(str, files)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    # Exit status 1 means "a check failed" (the canary always does); anything else is an error.
    assert proc.returncode in (0, 1), f"checkov exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout)
    return report if isinstance(report, list) else [report]


@pytest.fixture(scope="module")
def scan(tmp_path_factory: pytest.TempPathFactory) -> Scan:
    out = tmp_path_factory.mktemp("checkov")
    templates: dict[str, dict[str, Any]] = {}
    for which, spec_text in SPECS.items():
        built = build(tmp_path_factory.mktemp(which), spec_text)
        templates[f"{which}-network"] = dict(built.network.to_json())
        templates[f"{which}-cluster"] = dict(built.cluster.to_json())
    canary = copy.deepcopy(templates["default-cluster"])
    bucket = canary["Resources"]["CheckpointsBucket6BA0C50D"]["Properties"]
    del bucket["PublicAccessBlockConfiguration"]
    templates[CANARY] = canary
    files = []
    for name, template in templates.items():
        path = out / f"{name}.template.json"
        path.write_text(json.dumps(template, indent=1))
        files.append(path)
    reports = _run_checkov(files)
    assert [r.get("check_type") for r in reports] == ["cloudformation"], reports
    results = reports[0]["results"]
    return Scan(
        templates=sorted(templates),
        summary=reports[0]["summary"],
        failed=[
            Finding(f["check_id"], _template_name(f["file_path"]), f["resource"])
            for f in results["failed_checks"]
        ],
        scanned={
            _template_name(r["file_path"])
            for r in results["passed_checks"] + results["failed_checks"]
        },
    )


def _accepted(finding: Finding) -> bool:
    skip = SKIPS.get(finding.check_id)
    return skip is not None and finding.resource in skip.resources


def test_checkov_is_the_pinned_version_and_reads_every_template(scan: Scan) -> None:
    assert scan.summary["checkov_version"] == PINNED_VERSION, "run `make install-dev`"
    assert scan.summary["parsing_errors"] == 0
    assert scan.scanned == set(scan.templates)


def test_no_checkov_finding_beyond_the_skip_list(scan: Scan) -> None:
    new = [str(f) for f in scan.failed if f.template != CANARY and not _accepted(f)]
    assert new == [], "fix the template, or add the check to SKIPS with its reason"


def test_every_skip_still_fires_on_exactly_its_resources(scan: Scan) -> None:
    """A skip whose finding has gone (or moved) is stale: remove or narrow it."""
    for check_id, skip in SKIPS.items():
        fired = {f.resource for f in scan.failed if f.check_id == check_id and f.template != CANARY}
        assert fired == skip.resources, check_id


def test_every_skip_has_a_specific_reason() -> None:
    for check_id, skip in SKIPS.items():
        assert re.fullmatch(r"CKV2?_AWS_\d+", check_id), check_id
        assert skip.reason.startswith("wants ") and len(skip.reason) > 120, check_id
        assert "https://docs.aws.amazon.com/" in skip.reason, check_id
        assert skip.resources, check_id


def test_checkov_fails_a_template_with_a_new_finding(scan: Scan) -> None:
    """The check can fail: the bucket without its public access block is reported."""
    canary = {f.check_id for f in scan.failed if f.template == CANARY and not _accepted(f)}
    assert {"CKV_AWS_53", "CKV_AWS_54", "CKV_AWS_55", "CKV_AWS_56"} <= canary
