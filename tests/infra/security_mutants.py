"""Mutation check of the security invariants: break one security property at a time in a copy of
the construct code and run ``tests/infra/test_security_invariants.py`` against the copy; every
mutant must be killed (a test of that module fails with an assertion) or the check fails.

    .venv/bin/python tests/infra/security_mutants.py [--jobs N] [NAME ...]

Each mutant is a text edit of the source (``infra/*.py``, or the pinned CDK CLI's bootstrap
template that the image repository comes from) in a fresh copy of the files synthesis needs, so
the tree being worked on is never touched; the same pytest module runs in a subprocess with the
copy first on ``sys.path`` (synthesis is in-process there, no CDK CLI). An edit whose text is not
found exactly once stops the check: a refactor must update its mutant, not silently skip it.
``tests/infra/test_security_mutants.py`` runs this under ``make test``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
INVARIANTS = "tests/infra/test_security_invariants.py"
BOOTSTRAP = "node_modules/aws-cdk/lib/api/bootstrap/bootstrap-template.yaml"
# What synthesis and the invariant tests read: the construct code, the packages it imports, the
# specs, the CDK context, the Dockerfile the image asset checks for, and the bootstrap template.
COPIED = (
    "infra",
    "training",
    "tests/infra/infra_support.py",
    INVARIANTS,
    "cluster.toml",
    "cdk.json",
    "pyproject.toml",
    ".dockerignore",
    "containers/Dockerfile",
    BOOTSTRAP,
)


@dataclass(frozen=True)
class Edit:
    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutant:
    name: str
    """What the mutant breaks (the property a test must defend)."""
    edits: tuple[Edit, ...]


def _edit(path: str, old: str, new: str) -> tuple[Edit, ...]:
    return (Edit(path, old, new),)


IG, NET, CLUSTER, STACKS, EFA = (
    "infra/instance_group.py",
    "infra/network.py",
    "infra/cluster.py",
    "infra/stacks.py",
    "infra/efa.py",
)
CLUSTER_SG_OUTBOUND = (
    'description="Cluster instances: all traffic to and from members (EFA, NCCL, gRPC)",\n'
    "            allow_all_outbound=False,"
)
SELF_INGRESS = (
    "            self.cluster_security_group, ec2.Port.all_traffic(), "
    '"all traffic from the cluster"\n        )\n'
)
PUBLIC_SUBNET = (
    "ec2.SubnetConfiguration(name='public', subnet_type=ec2.SubnetType.PUBLIC, cidr_mask=24),"
)
MUTANTS: tuple[Mutant, ...] = (
    Mutant("IMDSv2 not required", _edit(IG, "require_imdsv2=True", "require_imdsv2=False")),
    Mutant(
        "IMDS hop limit 2 -> 3",
        _edit(IG, "http_put_response_hop_limit=2", "http_put_response_hop_limit=3"),
    ),
    Mutant(
        "instance metadata tags off",
        _edit(IG, "instance_metadata_tags=True", "instance_metadata_tags=False"),
    ),
    Mutant("root volume unencrypted", _edit(IG, "encrypted=True,", "encrypted=False,")),
    Mutant(
        "public IP on EFA interfaces",
        _edit(
            EFA,
            '"DeleteOnTermination": True,',
            '"DeleteOnTermination": True, "AssociatePublicIpAddress": True,',
        ),
    ),
    Mutant(
        "a public subnet beside the cluster's (internet gateway)",
        _edit(NET, "subnet_configuration=[", "subnet_configuration=[" + PUBLIC_SUBNET),
    ),
    Mutant(
        "NAT gateway attached",
        (
            Edit(NET, "nat_gateways=0,", "nat_gateways=1,"),
            Edit(
                NET,
                "subnet_configuration=[",
                "subnet_configuration=[" + PUBLIC_SUBNET,
            ),
        ),
    ),
    Mutant(
        "flow logs dropped",
        _edit(NET, "self.vpc.add_flow_log(", "(lambda *_, **__: None)("),
    ),
    Mutant(
        "flow logs record rejected traffic only",
        _edit(NET, "FlowLogTrafficType.ALL", "FlowLogTrafficType.REJECT"),
    ),
    Mutant(
        "flow log retention off",
        _edit(
            NET, "retention=logs.RetentionDays.ONE_MONTH", "retention=logs.RetentionDays.INFINITE"
        ),
    ),
    Mutant(
        "container log retention off",
        _edit(
            STACKS,
            "retention=logs.RetentionDays.THREE_MONTHS",
            "retention=logs.RetentionDays.INFINITE",
        ),
    ),
    Mutant(
        "ingress from 0.0.0.0/0 on the gRPC port",
        _edit(
            NET,
            SELF_INGRESS,
            SELF_INGRESS + "        self.cluster_security_group.add_ingress_rule("
            "ec2.Peer.any_ipv4(), ec2.Port.tcp(50051), 'grpc')\n",
        ),
    ),
    Mutant(
        "ingress from the VPC CIDR (SSH)",
        _edit(
            NET,
            SELF_INGRESS,
            SELF_INGRESS + "        self.cluster_security_group.add_ingress_rule("
            "ec2.Peer.ipv4(cidr), ec2.Port.tcp(22), 'ssh')\n",
        ),
    ),
    Mutant(
        "interface endpoints open to the VPC CIDR",
        _edit(NET, "                open=False,", "                open=True,"),
    ),
    Mutant(
        "cluster egress open to everything",
        _edit(NET, CLUSTER_SG_OUTBOUND, CLUSTER_SG_OUTBOUND.replace("False", "True")),
    ),
    Mutant(
        "bucket not SSL-only",
        _edit(CLUSTER, "enforce_ssl=True", "enforce_ssl=False"),
    ),
    Mutant(
        "bucket public access partly allowed",
        _edit(CLUSTER, "s3.BlockPublicAccess.BLOCK_ALL", "s3.BlockPublicAccess.BLOCK_ACLS"),
    ),
    Mutant("bucket unversioned", _edit(CLUSTER, "versioned=True", "versioned=False")),
    Mutant(
        "bucket unencrypted",
        _edit(CLUSTER, "s3.BucketEncryption.S3_MANAGED", "s3.BucketEncryption.UNENCRYPTED"),
    ),
    Mutant(
        "bucket deleted on destroy",
        _edit(
            CLUSTER,
            "RemovalPolicy.DESTROY if destroy_on_delete else RemovalPolicy.RETAIN",
            "RemovalPolicy.DESTROY",
        ),
    ),
    Mutant(
        "checkpoint actions widened to s3:*",
        _edit(
            CLUSTER,
            '"s3:AbortMultipartUpload",\n',
            '"s3:AbortMultipartUpload",\n                    "s3:*",\n',
        ),
    ),
    Mutant(
        "checkpoint objects on Resource *",
        _edit(
            CLUSTER,
            'resources=[self.bucket.arn_for_objects(f"{self.prefix}/*")]',
            'resources=["*"]',
        ),
    ),
    Mutant(
        "a mutating EC2 action on Resource *",
        _edit(
            CLUSTER,
            'actions=["ec2:DescribeInstances", ',
            'actions=["ec2:TerminateInstances", "ec2:DescribeInstances", ',
        ),
    ),
    Mutant(
        "group scaling without the cluster tag condition",
        _edit(
            CLUSTER,
            "                resources=asg_arns,\n                conditions=",
            "                resources=asg_arns,\n                conditions=None and ",
        ),
    ),
    Mutant(
        "job pointer readable on every parameter",
        _edit("infra/job.py", "resources=[self.parameter.parameter_arn]", 'resources=["*"]'),
    ),
    Mutant(
        "SageMaker role gets AmazonSageMakerFullAccess",
        _edit(
            CLUSTER,
            'description=f"{cluster_name}: SageMaker training jobs of the cluster",',
            'description=f"{cluster_name}: SageMaker training jobs of the cluster", '
            "managed_policies=[iam.ManagedPolicy.from_aws_managed_policy_name("
            "'AmazonSageMakerFullAccess')],",
        ),
    ),
    Mutant(
        "SageMaker output on the whole bucket",
        _edit(
            CLUSTER,
            'resources=[bucket.arn_for_objects(f"{aws_tags.SAGEMAKER_JOB_PREFIX}/*")]',
            'resources=[bucket.arn_for_objects("*")]',
        ),
    ),
    Mutant(
        "dataset read on the whole dataset bucket",
        _edit(CLUSTER, 'resources=[f"{bucket_arn}/{prefix}*"]', 'resources=[f"{bucket_arn}/*"]'),
    ),
    Mutant(
        "an own ECR repository without scan on push",
        _edit(
            CLUSTER,
            "        self.image_uri: str = self.asset.image_uri",
            "        self.image_uri: str = self.asset.image_uri\n"
            "        __import__('aws_cdk.aws_ecr', fromlist=['Repository'])"
            ".Repository(self, 'Repo')",
        ),
    ),
    Mutant(
        "image tags mutable in the bootstrap repository",
        _edit(
            BOOTSTRAP, "      ImageTagMutability: IMMUTABLE", "      ImageTagMutability: MUTABLE"
        ),
    ),
)


@dataclass(frozen=True)
class Outcome:
    name: str
    killed: bool
    killed_by: str
    """The first failing test, or why the mutant was not killed."""
    seconds: float


def copy_tree(destination: Path) -> None:
    """Copy what synthesis and the invariant tests read into ``destination``."""
    for relative in COPIED:
        source = REPO_ROOT / relative
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)


def apply(mutant: Mutant, root: Path) -> None:
    for edit in mutant.edits:
        path = root / edit.path
        text = path.read_text()
        count = text.count(edit.old)
        if count != 1:
            raise SystemExit(
                f"mutant {mutant.name!r}: {edit.old!r} occurs {count} times in {edit.path} "
                "(expected once); update the mutant to the code"
            )
        path.write_text(text.replace(edit.old, edit.new))


def _environment(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_imports_from(root: Path) -> None:
    """The copy's ``infra`` and ``training`` are the ones imported, not the editable install's."""
    code = "import infra, training; print(infra.__file__); print(training.__file__)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        env=_environment(root),
        capture_output=True,
        text=True,
        check=True,
    )
    for line in result.stdout.split():
        if not Path(line).resolve().is_relative_to(root.resolve()):
            raise SystemExit(f"the copy in {root} imports {line}: mutants would not be tested")


def run_invariants(root: Path, *, stop_at_first: bool) -> tuple[int, list[tuple[str, str]]]:
    """Run the invariant module in ``root``; (exit code, [(test id, 'failure'|'error')])."""
    report = root / "report.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        INVARIANTS,
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        f"--junitxml={report}",
        "--rootdir",
        str(root),
    ]
    if stop_at_first:
        command.append("-x")
    result = subprocess.run(
        command, cwd=root, env=_environment(root), capture_output=True, text=True, check=False
    )
    bad: list[tuple[str, str]] = []
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            for kind in ("failure", "error"):
                if case.find(kind) is not None:
                    bad.append((case.get("name", "?"), kind))
    if result.returncode not in (0, 1) or (result.returncode == 1 and not bad):
        tail = (result.stdout + result.stderr)[-3000:]
        bad.append((f"pytest exited {result.returncode}: {tail}", "error"))
    return result.returncode, bad


def run_mutant(mutant: Mutant, workdir: Path) -> Outcome:
    start = time.monotonic()
    root = workdir / mutant.name.replace(" ", "_").replace("/", "_")
    copy_tree(root)
    apply(mutant, root)
    _, bad = run_invariants(root, stop_at_first=True)
    elapsed = time.monotonic() - start
    failures = [name for name, kind in bad if kind == "failure"]
    if failures:
        return Outcome(mutant.name, True, failures[0], elapsed)
    if bad:  # only errors: the mutant broke synthesis or the run, no invariant caught it
        return Outcome(mutant.name, False, f"no assertion failed; error in {bad[0][0]}", elapsed)
    return Outcome(mutant.name, False, "survived: every invariant test passed", elapsed)


def run(mutants: Sequence[Mutant], *, jobs: int) -> tuple[list[Outcome], float]:
    """Check the unmutated copy passes, then run every mutant; (outcomes, baseline seconds)."""
    with tempfile.TemporaryDirectory(prefix="security-mutants-") as tmp:
        workdir = Path(tmp)
        baseline = workdir / "baseline"
        start = time.monotonic()
        copy_tree(baseline)
        check_imports_from(baseline)
        code, bad = run_invariants(baseline, stop_at_first=False)
        if code != 0:
            raise SystemExit(f"the invariant tests fail on the unmutated copy: {bad}")
        baseline_seconds = time.monotonic() - start
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            outcomes = list(pool.map(lambda m: run_mutant(m, workdir), mutants))
    return outcomes, baseline_seconds


def table(outcomes: Sequence[Outcome]) -> str:
    width = max(len(o.name) for o in outcomes)
    lines = [f"{'mutant':<{width}}  killed  seconds  killed by", "-" * (width + 40)]
    lines += [
        f"{o.name:<{width}}  {'yes' if o.killed else 'NO':<6}  {o.seconds:7.1f}  {o.killed_by}"
        for o in outcomes
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="run only the mutants with these names")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once (default 2)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"no such mutant: {sorted(unknown)}")
    start = time.monotonic()
    outcomes, baseline = run(chosen, jobs=args.jobs)
    print(table(outcomes))
    survivors = [o.name for o in outcomes if not o.killed]
    print(
        f"\n{len(outcomes) - len(survivors)} of {len(outcomes)} mutants killed "
        f"(baseline {baseline:.1f} s, total {time.monotonic() - start:.1f} s)"
    )
    if survivors:
        print(f"SURVIVED: {survivors}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
