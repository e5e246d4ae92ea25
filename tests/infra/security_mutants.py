"""Mutation check of the security invariants: break one security property at a time in a copy of
the construct code and run ``tests/infra/test_security_invariants.py`` against the copy; every
mutant must be killed (a test of that module fails with an assertion) or the check fails.

    .venv/bin/python tests/infra/security_mutants.py [--jobs N] [NAME ...]

Each mutant is a text edit of the source (``infra/*.py``, or the pinned CDK CLI's bootstrap
template that the image repository comes from) in a fresh copy of the files synthesis needs, so
the tree being worked on is never touched. The same pytest module then runs on each copy, with
synthesis in-process (no CDK CLI): ``--jobs`` worker processes each run the unmutated copy (every
test must pass), their share of the mutants, and the unmutated copy again, one ``pytest.main``
after another with the copy's ``infra`` and ``training`` imported afresh each time (checked), so
the jsii runtime starts once per worker rather than once per mutant. An edit whose text is not
found exactly once stops the check: a refactor must update its mutant, not silently skip it.
``tests/infra/test_security_mutants.py`` runs this under ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
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
            '                    "ec2:DescribeInstances",\n',
            '                    "ec2:TerminateInstances",\n'
            '                    "ec2:DescribeInstances",\n',
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
            'resources=[bucket.arn_for_objects(f"{SAGEMAKER_JOB_PREFIX}/*")]',
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


@dataclass(frozen=True)
class Run:
    """One run of the invariant module on one copy of the tree."""

    root: str
    report: str
    stop_at_first: bool


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


# Modules that come from a copy of the tree: forgotten before each run, so the next run imports
# its own copy's code (aws_cdk and the jsii runtime stay loaded: that is the time saved).
_TREE_MODULES = ("infra", "training", "infra_support", "test_security_invariants")


def _forget_tree_modules(workdir: Path) -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in _TREE_MODULES:
            del sys.modules[name]
    sys.path[:] = [p for p in sys.path if not Path(p).resolve().is_relative_to(workdir)]


def work(runs: Sequence[Run], workdir: Path, results: Path) -> None:
    """The worker: run the invariant module once per copy, in this one process, and write
    {report: seconds} to ``results``. Each run's copy of ``infra`` and ``training`` is the one
    imported (checked after the run), never another copy's or the editable install's."""
    import pytest

    # This script's own folder (the real tests/infra) is on sys.path as the script's: off it.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() not in (here, REPO_ROOT)]
    seconds: dict[str, float] = {}
    for run in runs:
        start = time.monotonic()
        root = Path(run.root)
        _forget_tree_modules(workdir)
        sys.path.insert(0, str(root))
        os.chdir(root)
        args = [
            INVARIANTS, "-q", "-p", "no:cacheprovider", "-o", "addopts=",
            f"--junitxml={run.report}", "--rootdir", str(root),
        ]  # fmt: skip
        pytest.main([*args, "-x"] if run.stop_at_first else args)
        for name in _TREE_MODULES:
            module = sys.modules.get(name)
            where = Path(getattr(module, "__file__", "") or "").resolve()
            if module is not None and not where.is_relative_to(root.resolve()):
                raise SystemExit(f"the run in {root} imported {name} from {where}")
        seconds[run.report] = time.monotonic() - start
    results.write_text(json.dumps(seconds))


def _failures(report: Path) -> list[tuple[str, str]]:
    """[(test name, 'failure'|'error')] of a junit report; a missing report is an error."""
    if not report.exists():
        return [(f"no report at {report}", "error")]
    bad: list[tuple[str, str]] = []
    for case in ET.parse(report).getroot().iter("testcase"):
        for kind in ("failure", "error"):
            if case.find(kind) is not None:
                bad.append((case.get("name", "?"), kind))
    return bad


def _outcome(mutant: Mutant, report: Path, seconds: float) -> Outcome:
    bad = _failures(report)
    failures = [name for name, kind in bad if kind == "failure"]
    if failures:
        return Outcome(mutant.name, True, failures[0], seconds)
    if bad:  # only errors: the mutant broke synthesis or the run, no invariant caught it
        return Outcome(mutant.name, False, f"no assertion failed; error in {bad[0][0]}", seconds)
    return Outcome(mutant.name, False, "survived: every invariant test passed", seconds)


def run(mutants: Sequence[Mutant], *, jobs: int) -> tuple[list[Outcome], float]:
    """Run every mutant; (outcomes, seconds of the slowest worker's first, unmutated run:
    the jsii start-up and three app builds).

    Each of ``jobs`` worker processes runs the unmutated copy first (every test must pass),
    then its share of the mutants (stopping at the first failure), then the unmutated copy
    again (every test must still pass: nothing of one run leaks into the next)."""
    with tempfile.TemporaryDirectory(prefix="security-mutants-") as tmp:
        workdir = Path(tmp).resolve()
        roots: dict[str, Path] = {}
        for i, mutant in enumerate(mutants):
            roots[mutant.name] = workdir / f"mutant-{i:02d}"
            copy_tree(roots[mutant.name])
            apply(mutant, roots[mutant.name])
        workers = []
        for job in range(max(1, min(jobs, len(mutants)))):
            baseline = workdir / f"baseline-{job}"
            copy_tree(baseline)
            share = [m for i, m in enumerate(mutants) if i % jobs == job]
            runs = [
                Run(str(baseline), str(baseline / "before.xml"), stop_at_first=False),
                *(Run(str(roots[m.name]), str(roots[m.name] / "report.xml"), True) for m in share),
                Run(str(baseline), str(baseline / "after.xml"), stop_at_first=False),
            ]
            plan = workdir / f"worker-{job}.json"
            plan.write_text(json.dumps([r.__dict__ for r in runs]))
            results = workdir / f"seconds-{job}.json"
            command = [
                sys.executable, __file__, "--worker", str(plan), str(workdir), str(results),
            ]  # fmt: skip
            env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
            env.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
            workers.append(
                (
                    baseline,
                    results,
                    subprocess.Popen(
                        command,
                        cwd=workdir,
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                    ),
                )
            )
        seconds: dict[str, float] = {}
        baseline_seconds = 0.0
        for baseline, results, process in workers:
            output, _ = process.communicate()
            if process.returncode != 0 or not results.exists():
                raise SystemExit(f"a worker failed ({process.returncode}):\n{output[-4000:]}")
            seconds.update(json.loads(results.read_text()))
            for report in ("before.xml", "after.xml"):
                bad = _failures(baseline / report)
                if bad:
                    raise SystemExit(f"the unmutated copy fails ({report}): {bad}")
            baseline_seconds = max(baseline_seconds, seconds[str(baseline / "before.xml")])
        outcomes = [
            _outcome(m, roots[m.name] / "report.xml", seconds[str(roots[m.name] / "report.xml")])
            for m in mutants
        ]
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
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["--worker"]:
        plan, workdir, results = args_list[1:]
        runs = [Run(**r) for r in json.loads(Path(plan).read_text())]
        work(runs, Path(workdir), Path(results))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="run only the mutants with these names")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    args = parser.parse_args(args_list)
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
        f"(unmutated copy {baseline:.1f} s, total {time.monotonic() - start:.1f} s)"
    )
    if survivors:
        print(f"SURVIVED: {survivors}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
