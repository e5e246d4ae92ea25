"""Deploy rehearsal: the synthesized stacks deployed, destroyed and deployed again in moto's
CloudFormation (moto in server mode on 127.0.0.1), the deploy side's twin of ``hetero rehearse``.

What is real: both templates as ``infra.assembly.create_stacks`` synthesizes them for a small
Spot spec (trainer 2 x g5.xlarge, dataprep 1 x c6i.4xlarge), built once per module, deployed
in order (``<name>-network``, then ``<name>-cluster``, which imports the network's exports) from
the bootstrap staging bucket as ``cdk deploy`` does, and deleted cluster first.

What is the environment (created as ``cdk bootstrap`` and AWS would have it, not shims): the
bootstrap version parameter, staging bucket and image repository named by the cloud assembly;
the public AMI parameters the launch templates resolve, where moto does not publish them
(pointing at AMIs moto's EC2 knows).

Shims, all in ``MOTO_SHIMS`` (moto 5.2.5), each proven still needed by a test here:

- no moto model, replaced by a no-op stand-in (``AWS::CloudFormation::WaitConditionHandle``)
  whose references resolve to a placeholder: ``AWS::AutoScaling::LifecycleHook``,
  ``AWS::EC2::PlacementGroup``, ``AWS::EC2::SecurityGroupEgress``, ``AWS::S3::BucketPolicy``;
- a model that creates but never deletes, so DeleteStack of the network fails on the VPC:
  ``AWS::EC2::RouteTable``, deleted through EC2 right before DeleteStack;
- a model that takes ``Tags`` only as a list where the CloudFormation type takes a map (CreateStack
  fails with HTTP 500): ``AWS::SSM::Parameter``, deployed with the same tags in list form.

moto does not apply the placement group, instance types from the mixed-instances overrides or
the launch template's metadata options to the instances it launches; the synth tests
(``test_infra_cluster.py``) check those properties on the template instead.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest
from cfn_emulator import (
    ACCOUNT_ID,
    CdkBootstrap,
    CloudFormationEmulator,
    Missing,
    MotoServer,
    StackFailed,
    bootstrap_from_assembly,
    has_map_tags,
    list_form_tags,
    load_assembly,
    moto_can_delete,
    moto_unsupported_types,
    shim_template,
    template_resource_types,
)
from infra_support import build

from infra.instance_group import DATAPREP_AMI_PARAMETER, TRAINER_AMI_PARAMETER
from training.common.hosts import list_cluster_instances
from training.common.names import TAG_CLUSTER, TAG_GROUP, TAG_ROLE, asg_name
from training.spec import ClusterSpec, Role, load_spec

pytestmark = [
    pytest.mark.timeout(120),
    # moto says so for every stand-in (it skips wait-condition handles by design).
    pytest.mark.filterwarnings(
        "ignore:Tried to parse AWS..CloudFormation..WaitConditionHandle:UserWarning"
    ),
]

MOTO_SHIMS: Final[Mapping[str, Missing]] = {
    # moto 5.2.5 has no CloudFormation model for these types (absent from
    # moto/cloudformation/parsing.py get_model_map()): it skips them with "No Moto
    # CloudFormation support", and the placement group's GetAtt in Outputs makes CreateStack
    # fail with HTTP 500 (AttributeError: 'NoneType' object has no attribute 'has_cfn_attr').
    "AWS::AutoScaling::LifecycleHook": Missing.CREATE,
    "AWS::EC2::PlacementGroup": Missing.CREATE,
    "AWS::EC2::SecurityGroupEgress": Missing.CREATE,
    "AWS::S3::BucketPolicy": Missing.CREATE,
    # moto 5.2.5's RouteTable model has neither delete() nor delete_from_cloudformation_json:
    # DeleteStack leaves the subnet's route table, then fails on the VPC with
    # "DependencyViolation: The vpc vpc-... has dependencies and cannot be deleted" (and drops
    # the stack while keeping its exports, so the next deploy fails on "Export names must be
    # unique"). Other types it leaves behind (VPC endpoints, flow log, ingress rules, route
    # table association) block nothing, so they are not shimmed.
    "AWS::EC2::RouteTable": Missing.DELETE,
    # moto 5.2.5's SSM Parameter model passes Tags to PutParameter as a list of {Key, Value},
    # but the CloudFormation type takes a map ("Tags": {"key": "value"}, as CDK writes it;
    # https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/aws-resource-ssm-parameter.html):
    # CreateStack fails with HTTP 500 (TypeError: string indices must be integers).
    "AWS::SSM::Parameter": Missing.MAP_TAGS,
}
"""Resource types moto's CloudFormation lacks, and what it lacks; nothing else is shimmed."""

REGION = "us-east-1"
PROBE_REGIONS = ("us-west-2", "eu-west-1", "ap-southeast-2")
"""One region per probe of a shim (``PROBED_SHIMS``): a failed stack leaves exports behind."""
FIXED_NAME_REGION = "eu-central-1"
BOOTSTRAP_VERSION = "30"
STACK_TIMEOUT_S = 30.0
CAPACITY_TIMEOUT_S = 20.0

SPEC_TEXT = """
name = "vit-rehearsal"

[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge"]
count = 2
market = "spot"

[[groups]]
name = "dataprep"
role = "dataprep"
instance_types = ["c6i.4xlarge"]
count = 1
market = "spot"
efa = "off"

[job]
steps = 100
"""

AMI_PARAMETER_BY_ROLE = {Role.TRAINER: TRAINER_AMI_PARAMETER, Role.DATAPREP: DATAPREP_AMI_PARAMETER}
_IMAGE_PARAMETER_TYPE = "AWS::SSM::Parameter::Value<AWS::EC2::Image::Id>"


@dataclass(frozen=True)
class Assembly:
    """The synthesized cloud assembly of ``SPEC_TEXT``."""

    spec: ClusterSpec
    stack_names: tuple[str, ...]
    """In deploy order: the network, then the cluster."""
    templates: dict[str, dict[str, Any]]
    asset_manifests: list[dict[str, Any]]

    def resource_types(self) -> set[str]:
        return set().union(*(template_resource_types(t) for t in self.templates.values()))

    def shims(self, missing: Missing) -> set[str]:
        return {t for t, m in MOTO_SHIMS.items() if m is missing}

    def deployable(self, name: str, *, without: str = "") -> dict[str, Any]:
        """The template as deployed: resources moto cannot create replaced by stand-ins, map
        tags in list form where moto needs it; ``without``: a shimmed type left as it is."""
        template = shim_template(self.templates[name], self.shims(Missing.CREATE) - {without})
        return list_form_tags(template, self.shims(Missing.MAP_TAGS) - {without})


@dataclass(frozen=True)
class Environment:
    """One region, prepared: the bootstrap resources and the public AMI parameters."""

    emulator: CloudFormationEmulator
    bootstrap: CdkBootstrap
    ami_by_parameter: dict[str, str]
    added_parameters: frozenset[str]
    """The public parameters moto did not publish (added here)."""


@dataclass(frozen=True)
class Deployment:
    """What the region looked like once both stacks were deployed."""

    stacks: dict[str, dict[str, Any]]
    """Stack name -> DescribeStacks entry."""
    resources: dict[str, list[dict[str, Any]]]
    """Stack name -> ListStackResources summaries."""
    exports: dict[str, str]
    """The network stack's exports: name -> value."""
    groups: dict[str, dict[str, Any]]
    """Every Auto Scaling group in the region, by name."""
    instances: dict[str, dict[str, Any]]
    """The groups' instances (DescribeInstances), by id."""
    discovered: dict[str, list[str]]
    """What the launcher's peer discovery lists: group -> instance ids."""

    def output(self, stack: str, key: str) -> str:
        outputs = {o["OutputKey"]: o["OutputValue"] for o in self.stacks[stack]["Outputs"]}
        return outputs[key]

    def physical_ids(self, stack: str, resource_type: str) -> set[str]:
        return {
            r["PhysicalResourceId"]
            for r in self.resources[stack]
            if r["ResourceType"] == resource_type
        }


@dataclass(frozen=True)
class Destroyed:
    """What was left after both stacks were deleted (cluster first)."""

    stacks: dict[str, dict[str, Any]]
    groups: set[str]
    instance_states: dict[str, str]
    buckets: set[str]
    log_groups: set[str]


# -- steps -------------------------------------------------------------------------------------


def prepare(emulator: CloudFormationEmulator, assembly: Assembly) -> Environment:
    """Bootstrap the region and make every public AMI parameter the templates resolve exist,
    each pointing at a different AMI moto's EC2 knows."""
    bootstrap = bootstrap_from_assembly(
        assembly.templates, assembly.asset_manifests, region=emulator.region
    )
    emulator.bootstrap(bootstrap, version=BOOTSTRAP_VERSION)
    parameters = sorted(
        {
            p["Default"]
            for t in assembly.templates.values()
            for p in t.get("Parameters", {}).values()
            if p["Type"] == _IMAGE_PARAMETER_TYPE
        }
    )
    # A stand-in for an AMI AWS publishes: an AL2023 x86_64 image of moto's (a narrow filter:
    # describing all of moto's ~1000 images takes seconds).
    images = emulator.client("ec2").describe_images(
        Filters=[
            {"Name": "architecture", "Values": ["x86_64"]},
            {"Name": "name", "Values": ["al2023-ami-2023*"]},
        ]
    )["Images"]
    candidates = sorted(i["ImageId"] for i in images)
    if len(candidates) < len(parameters):
        raise RuntimeError(
            f"moto lists {candidates} as AL2023 x86_64 AMIs: too few for "
            f"{parameters}; widen the filter in prepare()"
        )
    ssm = emulator.client("ssm")
    added: set[str] = set()
    values: dict[str, str] = {}
    for name in parameters:
        unused = next(i for i in candidates if i not in values.values())
        if emulator.ensure_public_parameter(name, unused):
            added.add(name)
        values[name] = ssm.get_parameter(Name=name)["Parameter"]["Value"]
    return Environment(emulator, bootstrap, values, frozenset(added))


def deploy_all(env: Environment, assembly: Assembly, *, without: str = "") -> Deployment:
    """Deploy the stacks in order, wait (bounded) for the groups' capacity, describe it all
    (``without``: a shimmed type deployed unshimmed)."""
    emulator = env.emulator
    stacks = {
        name: emulator.deploy(
            name,
            assembly.deployable(name, without=without),
            bootstrap=env.bootstrap,
            timeout_s=STACK_TIMEOUT_S,
        )
        for name in assembly.stack_names
    }
    cfn = emulator.client("cloudformation")
    resources = {
        name: cfn.list_stack_resources(StackName=s["StackId"])["StackResourceSummaries"]
        for name, s in stacks.items()
    }
    network_id = stacks[assembly.stack_names[0]]["StackId"]
    exports = {
        e["Name"]: e["Value"]
        for e in cfn.list_exports()["Exports"]
        if e["ExportingStackId"] == network_id
    }
    groups = _groups_at_capacity(emulator)
    instance_ids = [i["InstanceId"] for g in groups.values() for i in g["Instances"]]
    ec2 = emulator.client("ec2")
    instances = (
        {
            i["InstanceId"]: i
            for r in ec2.describe_instances(InstanceIds=instance_ids)["Reservations"]
            for i in r["Instances"]
        }
        if instance_ids
        else {}
    )
    discovered = {
        group: [i["InstanceId"] for i in members]
        for group, members in list_cluster_instances(ec2, assembly.spec.name).items()
    }
    return Deployment(stacks, resources, exports, groups, instances, discovered)


def _groups_at_capacity(emulator: CloudFormationEmulator) -> dict[str, dict[str, Any]]:
    """Every Auto Scaling group in the region, once each has its desired capacity InService
    (or when CAPACITY_TIMEOUT_S is up: the tests then say which one fell short)."""
    autoscaling = emulator.client("autoscaling")
    deadline = time.monotonic() + CAPACITY_TIMEOUT_S
    while True:
        groups = {
            g["AutoScalingGroupName"]: g
            for g in autoscaling.describe_auto_scaling_groups()["AutoScalingGroups"]
        }
        full = all(
            sum(i["LifecycleState"] == "InService" for i in g["Instances"]) == g["DesiredCapacity"]
            for g in groups.values()
        )
        if (groups and full) or time.monotonic() > deadline:
            return groups
        time.sleep(0.2)


def destroy_all(
    env: Environment, assembly: Assembly, deployment: Deployment, *, without: str = ""
) -> Destroyed:
    """Delete the stacks in reverse order (cluster first) and describe what is left
    (``without``: a shimmed type deleted unshimmed)."""
    emulator = env.emulator
    stacks = {
        name: emulator.destroy(
            deployment.stacks[name]["StackId"],
            delete_shims=assembly.shims(Missing.DELETE) - {without},
            timeout_s=STACK_TIMEOUT_S,
        )
        for name in reversed(assembly.stack_names)
    }
    groups = {
        g["AutoScalingGroupName"]
        for g in emulator.client("autoscaling").describe_auto_scaling_groups()["AutoScalingGroups"]
    }
    states = {
        i["InstanceId"]: i["State"]["Name"]
        for r in emulator.client("ec2").describe_instances(InstanceIds=list(deployment.instances))[
            "Reservations"
        ]
        for i in r["Instances"]
    }
    buckets = {b["Name"] for b in emulator.client("s3").list_buckets()["Buckets"]}
    log_groups = {
        g["logGroupName"] for g in emulator.client("logs").describe_log_groups()["logGroups"]
    }
    return Destroyed(stacks, groups, states, buckets, log_groups)


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def assembly(tmp_path_factory: pytest.TempPathFactory) -> Assembly:
    tmp = tmp_path_factory.mktemp("deploy-rehearsal")
    built = build(tmp, SPEC_TEXT)
    built.app.synth()
    names = (built.stacks.network.stack_name, built.stacks.cluster.stack_name)
    templates, manifests = load_assembly(Path(str(built.app.outdir)), names)
    return Assembly(load_spec(tmp / "cluster.toml"), names, templates, manifests)


@pytest.fixture(scope="module")
def server() -> Iterator[MotoServer]:
    moto = MotoServer()
    try:
        yield moto
    finally:
        moto.stop()


@pytest.fixture(scope="module")
def env(server: MotoServer, assembly: Assembly) -> Environment:
    return prepare(CloudFormationEmulator(server, region=REGION), assembly)


@pytest.fixture(scope="module")
def first(env: Environment, assembly: Assembly) -> Deployment:
    return deploy_all(env, assembly)


@pytest.fixture(scope="module")
def destroyed(env: Environment, assembly: Assembly, first: Deployment) -> Destroyed:
    return destroy_all(env, assembly, first)


@pytest.fixture(scope="module")
def second(env: Environment, assembly: Assembly, destroyed: Destroyed) -> Deployment:
    return deploy_all(env, assembly)


# -- the shims are exactly what moto lacks -----------------------------------------------------


def test_create_shims_are_exactly_the_types_moto_has_no_model_for(assembly: Assembly) -> None:
    lacking = moto_unsupported_types(assembly.resource_types())
    shimmed = assembly.shims(Missing.CREATE)
    assert shimmed == lacking, (
        f"moto cannot create {sorted(lacking - shimmed)} (add them to MOTO_SHIMS as "
        f"Missing.CREATE); moto now supports {sorted(shimmed - lacking)} or the stacks no "
        "longer use them (drop those shims)"
    )


def test_delete_shims_name_types_moto_creates_but_cannot_delete(assembly: Assembly) -> None:
    for resource_type in assembly.shims(Missing.DELETE):
        assert resource_type in assembly.resource_types(), (
            f"{resource_type}: the stacks no longer use it; drop its shim"
        )
        assert not moto_can_delete(resource_type), (
            f"moto now deletes {resource_type}: drop its Missing.DELETE shim"
        )


def test_map_tags_shims_name_types_the_stacks_tag_with_a_map(assembly: Assembly) -> None:
    for resource_type in assembly.shims(Missing.MAP_TAGS):
        assert any(has_map_tags(t, resource_type) for t in assembly.templates.values()), (
            f"no {resource_type} in the stacks has map Tags any more; drop its shim"
        )


PROBED_SHIMS = sorted(t for t, m in MOTO_SHIMS.items() if m is not Missing.CREATE)
"""The shims whose need a deploy shows (a type without a model is skipped or crashes)."""
_PROBE_FAILS_IN = {Missing.DELETE: "DeleteStack", Missing.MAP_TAGS: "CreateStack"}


@pytest.mark.parametrize("resource_type", PROBED_SHIMS)
# The failure the probe expects: moto has no error shape for it in CloudFormation's model.
@pytest.mark.filterwarnings("ignore:Exception\\(DependencyViolationError\\):UserWarning")
def test_rehearsal_fails_without_the_shim(
    server: MotoServer, assembly: Assembly, resource_type: str
) -> None:
    # Its own region: the failed stack leaves its exports there, which would collide.
    region = PROBE_REGIONS[PROBED_SHIMS.index(resource_type)]
    env = prepare(CloudFormationEmulator(server, region=region), assembly)
    phase = _PROBE_FAILS_IN[MOTO_SHIMS[resource_type]]
    with pytest.raises(StackFailed, match=f"^{phase} ") as failure:
        deployment = deploy_all(env, assembly, without=resource_type)
        destroy_all(env, assembly, deployment, without=resource_type)
    print(f"without the {resource_type} shim: {failure.value}")


# -- the environment ---------------------------------------------------------------------------


def test_environment_has_the_launch_templates_ami_parameters(env: Environment) -> None:
    # The stacks resolve exactly the two public parameters infra/instance_group.py names.
    assert set(env.ami_by_parameter) == {TRAINER_AMI_PARAMETER, DATAPREP_AMI_PARAMETER}
    # moto 5.2.5 publishes the ECS-optimised AMI parameters, not the Deep Learning AMI's.
    assert env.added_parameters == {TRAINER_AMI_PARAMETER}
    assert (
        env.ami_by_parameter[TRAINER_AMI_PARAMETER] != env.ami_by_parameter[DATAPREP_AMI_PARAMETER]
    )


# -- first deploy ------------------------------------------------------------------------------


def test_both_stacks_complete(first: Deployment, assembly: Assembly) -> None:
    assert {n: s["StackStatus"] for n, s in first.stacks.items()} == {
        name: "CREATE_COMPLETE" for name in assembly.stack_names
    }


def test_auto_scaling_groups_have_the_launchers_names(
    first: Deployment, assembly: Assembly
) -> None:
    spec = assembly.spec
    assert set(first.groups) == {asg_name(spec.name, g.name) for g in spec.groups}


def test_groups_reach_their_desired_capacity(first: Deployment, assembly: Assembly) -> None:
    for group in assembly.spec.groups:
        asg = first.groups[asg_name(assembly.spec.name, group.name)]
        assert (asg["DesiredCapacity"], asg["MinSize"], asg["MaxSize"]) == (
            group.count,
            0,
            group.count,
        )
        states = [(i["LifecycleState"], i["HealthStatus"]) for i in asg["Instances"]]
        assert states == [("InService", "Healthy")] * group.count, group.name
        for i in asg["Instances"]:
            assert first.instances[i["InstanceId"]]["State"]["Name"] == "running"


def test_instances_carry_the_launchers_tags(first: Deployment, assembly: Assembly) -> None:
    spec = assembly.spec
    for group in spec.groups:
        name = asg_name(spec.name, group.name)
        for member in first.groups[name]["Instances"]:
            instance = first.instances[member["InstanceId"]]
            tags = {t["Key"]: t["Value"] for t in instance["Tags"]}
            assert {
                k: tags.get(k)
                for k in (
                    TAG_CLUSTER,
                    TAG_GROUP,
                    TAG_ROLE,
                    "aws:autoscaling:groupName",
                )
            } == {
                TAG_CLUSTER: spec.name,
                TAG_GROUP: group.name,
                TAG_ROLE: group.role.value,
                "aws:autoscaling:groupName": name,
            }


def test_launcher_peer_discovery_finds_exactly_each_groups_instances(
    first: Deployment, assembly: Assembly
) -> None:
    spec = assembly.spec
    expected = {
        g.name: sorted(
            i["InstanceId"] for i in first.groups[asg_name(spec.name, g.name)]["Instances"]
        )
        for g in spec.groups
    }
    assert {g: sorted(ids) for g, ids in first.discovered.items()} == expected


def test_instances_are_in_the_network_subnet_with_the_cluster_security_group(
    first: Deployment, assembly: Assembly
) -> None:
    network, cluster = assembly.stack_names
    exported = set(first.exports.values())
    (subnet,) = exported & first.physical_ids(network, "AWS::EC2::Subnet")
    (security_group,) = exported & first.physical_ids(network, "AWS::EC2::SecurityGroup")
    # The cluster stack's own outputs name the same two, through its imports.
    assert (first.output(cluster, "SubnetId"), first.output(cluster, "SecurityGroupId")) == (
        subnet,
        security_group,
    )
    for name, asg in first.groups.items():
        assert asg["VPCZoneIdentifier"] == subnet, name
    assert first.instances
    for instance_id, instance in first.instances.items():
        assert instance["SubnetId"] == subnet, instance_id
        assert [g["GroupId"] for g in instance["SecurityGroups"]] == [security_group], instance_id


def test_instances_run_the_ami_of_their_role(
    first: Deployment, assembly: Assembly, env: Environment
) -> None:
    spec = assembly.spec
    for group in spec.groups:
        ami = env.ami_by_parameter[AMI_PARAMETER_BY_ROLE[group.role]]
        for member in first.groups[asg_name(spec.name, group.name)]["Instances"]:
            assert first.instances[member["InstanceId"]]["ImageId"] == ami, group.name


def test_image_uri_is_in_the_bootstrap_image_repository(
    first: Deployment, assembly: Assembly, env: Environment
) -> None:
    tags = {
        a["source"]["dockerBuildTarget"]: d["imageTag"]
        for m in assembly.asset_manifests
        for a in m.get("dockerImages", {}).values()
        for d in a["destinations"].values()
    }
    assert set(tags) == {"trainer", "data-server"}  # two targets of containers/Dockerfile
    repository = env.bootstrap.image_repository
    registry = f"{ACCOUNT_ID}.dkr.ecr.{REGION}.amazonaws.com/{repository}"
    assert first.output(assembly.stack_names[1], "ImageUri") == f"{registry}:{tags['trainer']}"
    assert first.output(assembly.stack_names[1], "DataServerImageUri") == (
        f"{registry}:{tags['data-server']}"
    )
    repositories = env.emulator.client("ecr").describe_repositories()["repositories"]
    assert [r["repositoryName"] for r in repositories] == [repository]


# -- destroy -----------------------------------------------------------------------------------


def test_destroy_completes_and_stops_every_instance(
    destroyed: Destroyed, first: Deployment, assembly: Assembly
) -> None:
    assert {n: s["StackStatus"] for n, s in destroyed.stacks.items()} == {
        name: "DELETE_COMPLETE" for name in assembly.stack_names
    }
    assert destroyed.groups == set()
    assert destroyed.instance_states == {i: "terminated" for i in first.instances}


def test_destroy_keeps_exactly_the_retained_buckets_and_log_groups(
    destroyed: Destroyed, first: Deployment, assembly: Assembly
) -> None:
    kinds = {"AWS::S3::Bucket": destroyed.buckets, "AWS::Logs::LogGroup": destroyed.log_groups}
    for resource_type, left in kinds.items():
        retained: set[str] = set()
        deleted: set[str] = set()
        for name in assembly.stack_names:
            policies = {
                logical: r.get("DeletionPolicy", "Delete")
                for logical, r in assembly.templates[name]["Resources"].items()
            }
            for r in first.resources[name]:
                if r["ResourceType"] == resource_type:
                    retain = policies[r["LogicalResourceId"]] == "Retain"
                    (retained if retain else deleted).add(r["PhysicalResourceId"])
        assert retained | deleted, resource_type
        assert retained <= left, f"{resource_type}: retained ones are gone"
        assert not deleted & left, f"{resource_type}: {sorted(deleted & left)} outlived destroy"


# -- deploy again ------------------------------------------------------------------------------


def test_redeploy_after_destroy_completes_with_new_instances(
    second: Deployment, first: Deployment, assembly: Assembly
) -> None:
    assert {n: s["StackStatus"] for n, s in second.stacks.items()} == {
        name: "CREATE_COMPLETE" for name in assembly.stack_names
    }
    spec = assembly.spec
    assert set(second.groups) == {asg_name(spec.name, g.name) for g in spec.groups}
    for group in spec.groups:
        members = second.groups[asg_name(spec.name, group.name)]["Instances"]
        assert [i["LifecycleState"] for i in members] == ["InService"] * group.count
        ids = {i["InstanceId"] for i in members}
        assert not ids & set(first.instances), "the second deploy kept old instances"
        assert sorted(second.discovered[group.name]) == sorted(ids)
        for instance_id in ids:
            tags = {t["Key"]: t["Value"] for t in second.instances[instance_id]["Tags"]}
            assert (tags[TAG_GROUP], tags[TAG_ROLE]) == (
                group.name,
                group.role.value,
            )


def test_rehearsal_catches_a_retained_resource_with_a_fixed_name(
    server: MotoServer, assembly: Assembly
) -> None:
    # The container log group as it was: a fixed name and DeletionPolicy Retain. destroy keeps
    # it, and the next deploy fails on the name, as it does on AWS; moto reproduces that.
    cluster = assembly.stack_names[1]
    templates = {name: dict(t) for name, t in assembly.templates.items()}
    resources = {k: dict(v) for k, v in templates[cluster]["Resources"].items()}
    logical = next(k for k, r in resources.items() if r["Type"] == "AWS::Logs::LogGroup")
    resources[logical]["Properties"] = {
        **resources[logical].get("Properties", {}),
        "LogGroupName": f"/hetero/{assembly.spec.name}",
    }
    resources[logical]["DeletionPolicy"] = "Retain"
    templates[cluster] = {**templates[cluster], "Resources": resources}
    fixed = dataclasses.replace(assembly, templates=templates)
    env = prepare(CloudFormationEmulator(server, region=FIXED_NAME_REGION), fixed)
    destroy_all(env, fixed, deploy_all(env, fixed))
    with pytest.raises(StackFailed, match="ResourceAlreadyExistsException") as failure:
        deploy_all(env, fixed)
    assert str(failure.value).startswith(f"CreateStack {cluster} ")
