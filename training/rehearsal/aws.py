"""moto in server mode standing in for EC2, Auto Scaling and S3, set up as the CDK stack would.

``AwsEmulator.start()`` runs ``moto.server.ThreadedMotoServer`` on 127.0.0.1 (any free port) in
this process; ``provision(spec)`` creates what the cluster stack creates for one spec:

- a VPC ``127.0.0.0/16`` with one subnet ``127.0.N.0/24``, N drawn per emulator from 1..254
  (``subnet_cidr``): moto gives instances private IPs 127.0.N.4, .5, ... in launch order, real
  loopback addresses every process can bind, and two rehearsals on one machine (the test suite
  runs several at once) almost never share one: the data servers' gRPC ports, which the
  servers bind with ``SO_REUSEPORT`` (gRPC's default), would otherwise take each other's
  connections and Shutdown RPCs;
- per instance group a launch template (IMDSv2 required, instance metadata tags on) and an Auto
  Scaling group named ``training.common.names.asg_name(cluster, group)`` with MinSize = MaxSize =
  DesiredCapacity = count (an elastic group: MinSize ``min_size``, MaxSize ``max_size``, as the
  stack), tagged ``hetero:cluster``, ``hetero:group`` and ``hetero:role`` with
  PropagateAtLaunch, and a termination lifecycle hook ``hetero-checkpoint``;
- the checkpoint bucket;
- given the spec's text, the job pointer (SSM), as ``infra/job.py`` writes it.

moto's Auto Scaling launches instances when the desired capacity grows, replaces an instance
terminated with ``TerminateInstances`` or ``TerminateInstanceInAutoScalingGroup`` (without
decrementing), and terminates every instance when the desired capacity goes to 0. What moto does
not do: ``CompleteLifecycleAction`` (it answers HTTP 500), Terminating:Wait (terminations are
immediate), Spot markets (``instances`` marks a Spot group's instances ``spot``, as EC2 lists
them: ``InstanceLifecycle``; ``DescribeSpotPriceHistory`` answers 0.00001 USD/h for every type,
so ``provision`` makes it answer the spec's catalogue estimate, ``_answer_spot_prices``),
capacity running out (``hold_launches``), capacity rebalancing (``injector`` emulates it),
replacing an instance marked Unhealthy (``replace_unhealthy``), an OS shutdown
(``shut_down_from_os``).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
import urllib.request
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

from training.common.hosts import instance_market
from training.common.jobparam import JobPointer, deployed_job_id
from training.common.names import (
    CHECKPOINT_PREFIX,
    TAG_CLUSTER,
    TAG_GROUP,
    TAG_ROLE,
    asg_name,
    job_parameter_name,
)
from training.common.s3 import read_object, s3_uri
from training.instance_types import CATALOG
from training.launcher.boot_watch import INSTANCE_INITIATED_SHUTDOWN
from training.spec import ClusterSpec, Market, PricesSpec

log = logging.getLogger(__name__)

VPC_CIDR = "127.0.0.0/16"
SUBNET_OCTETS = range(1, 255)
"""The third octet of a rehearsal's subnet (127.0.0.0/24 holds 127.0.0.1, where moto listens)."""


def subnet_cidr(octet: int | None = None) -> str:
    """``127.0.<octet>.0/24``; a random octet of ``SUBNET_OCTETS`` when none is given."""
    chosen = random.choice(SUBNET_OCTETS) if octet is None else octet
    if chosen not in SUBNET_OCTETS:
        raise ValueError(f"subnet octet {chosen} is not in 1..254")
    return f"127.0.{chosen}.0/24"


LIFECYCLE_HOOK = "hetero-checkpoint"
DEFAULT_REGION = "us-east-1"
RESET_TIMEOUT_S = 60.0
"""How long the emulator waits for moto's reset (a loopback call to its own server)."""
FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
JOB_RECORD_KEY = "job/outcome.json"
"""The launcher's job record, relative to the checkpoint URI."""
_AMI = "ami-12c6146b"  # one of moto's default images
_SPOT_PRICES: PricesSpec | None = None
"""The spec whose catalogue estimate ``DescribeSpotPriceHistory`` answers (the last
provisioned; ``AwsEmulator._answer_spot_prices``)."""
_MOTO_SPOT_ANSWER: Any = None
"""moto's own ``DescribeSpotPriceHistory`` response method while it is wrapped (None: it is
not); ``AwsEmulator.stop`` puts it back, so other moto users in the process get moto's."""


@dataclass(frozen=True)
class ClusterNames:
    """What ``provision`` created: the names every instance is told."""

    cluster: str
    region: str
    bucket: str
    checkpoint_prefix: str
    """Key prefix of the checkpoints, ending in '/' (``checkpoints/<cluster>/``)."""
    asg_names: dict[str, str]
    """Group name -> Auto Scaling group name."""
    lifecycle_hook: str = LIFECYCLE_HOOK
    job_parameter: str | None = None
    """The SSM job pointer's name, when ``provision`` was given the spec's text."""

    @property
    def checkpoint_uri(self) -> str:
        return s3_uri(self.bucket, self.checkpoint_prefix)

    @property
    def job_record_key(self) -> str:
        return self.checkpoint_prefix + JOB_RECORD_KEY


@dataclass(frozen=True)
class EmulatedInstance:
    """One EC2 instance as moto describes it."""

    instance_id: str
    state: str
    """``pending``, ``running``, ``shutting-down``, ``terminated``, ..."""
    private_ip: str
    group: str
    role: str
    launch_time: float
    """EC2's ``LaunchTime`` as the API gives it (to the second)."""
    launched_at: float | None = None
    """When moto created it (epoch seconds, to the microsecond: its backend's own time)."""
    terminated_at: float | None = None
    """When moto terminated it (epoch seconds, ``AwsEmulator``'s watch on its backend)."""


def region_for(spec: ClusterSpec) -> str:
    """The spec's region when it names one, else us-east-1."""
    return str(getattr(spec, "region", None) or DEFAULT_REGION)


class AwsEmulator:
    """A moto server plus the clients the rehearsal itself uses (always straight to moto)."""

    def __init__(self, region: str = DEFAULT_REGION, *, subnet: str | None = None) -> None:
        self.region = region
        self.subnet = subnet or subnet_cidr()
        """The cluster subnet's CIDR: the instances' private IPs (``subnet_cidr``)."""
        self._server: Any = None
        self._clients: dict[str, Any] = {}
        self.endpoint_url = ""
        self._spot_groups: set[tuple[str, str]] = set()
        """(cluster, group) of every Spot group ``provision`` created."""
        self._terminated_at: dict[str, float] = {}
        """Instance id -> when moto terminated it (``_watch_terminations``)."""
        self.launches_refused: dict[str, int] = {}
        """Auto Scaling group -> instances it could not launch while its launches were held
        (since the last ``hold_launches``)."""

    def start(self) -> AwsEmulator:
        from moto.server import ThreadedMotoServer  # heavy; only a rehearsal needs it

        # One access-log line per request (and a traceback for every unimplemented action,
        # e.g. CompleteLifecycleAction) would drown the rehearsal's own console lines.
        logging.getLogger("werkzeug").setLevel(logging.CRITICAL)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"
        # moto's backends live in this process: start from nothing (an earlier rehearsal in the
        # same process, e.g. the baseline, must not leak its instances into this one).
        self.reset()
        return self

    def reset(self) -> None:
        req = urllib.request.Request(self.endpoint_url + "/moto-api/reset", method="POST")
        # The reset rebuilds every backend of this process: on a loaded machine, after many
        # earlier emulators in the same process, it took more than 10 s (a suite's setup error).
        with urllib.request.urlopen(req, timeout=RESET_TIMEOUT_S) as resp:
            resp.read()
        self._clients.clear()
        self._terminated_at.clear()
        self.launches_refused.clear()
        self._watch_terminations()

    def _ec2_backend(self) -> Any:
        """moto's EC2 backend of this region (it runs in this process)."""
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.ec2.models import ec2_backends

        return ec2_backends[DEFAULT_ACCOUNT_ID][self.region]

    def _watch_terminations(self) -> None:
        """Note when moto terminates each instance: every termination (TerminateInstances, Auto
        Scaling's scale-in and replacements, ``shut_down_from_os``) goes through its EC2
        backend's ``terminate_instances``, wrapped here on the backend object (a reset makes a
        new one). The API gives no termination time; the group simulator looks only every half
        second."""
        backend = self._ec2_backend()
        terminate = backend.terminate_instances
        ended = self._terminated_at

        def terminate_noted(instance_ids: list[str], *args: Any, **kwargs: Any) -> Any:
            result = terminate(instance_ids, *args, **kwargs)
            now = time.time()
            for instance_id in instance_ids:
                ended.setdefault(instance_id, now)
            return result

        backend.terminate_instances = terminate_noted

    def stop(self) -> None:
        if self._server is not None:
            with contextlib.suppress(Exception):
                self.reset()
            self._server.stop()
            self._server = None
        _restore_spot_answer()

    def __enter__(self) -> AwsEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return int(self.endpoint_url.rsplit(":", 1)[1])

    def client(self, service: str) -> Any:
        if service not in self._clients:
            self._clients[service] = boto3.client(
                service,  # type: ignore[call-overload]
                endpoint_url=self.endpoint_url,
                region_name=self.region,
                aws_access_key_id=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                aws_secret_access_key=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                config=Config(retries={"max_attempts": 3, "mode": "standard"}),
            )
        return self._clients[service]

    # -- what the stack creates --------------------------------------------------------------

    def provision(self, spec: ClusterSpec, spec_text: str | None = None) -> ClusterNames:
        """VPC, subnet, launch templates, Auto Scaling groups (which launch the instances),
        lifecycle hooks and the checkpoint bucket for ``spec``; with ``spec_text``, also the job
        pointer the stack writes (SSM ``/hetero/<cluster>/job``, the deployed job
        ``d-<spec hash>``), whose checkpoints are the rehearsal's checkpoint prefix, so that
        ``hetero job start`` works as on a deployed cluster."""
        ec2, autoscaling, s3 = self.client("ec2"), self.client("autoscaling"), self.client("s3")
        self._answer_spot_prices(spec)
        vpc = ec2.create_vpc(CidrBlock=VPC_CIDR)["Vpc"]["VpcId"]
        subnet = ec2.create_subnet(
            VpcId=vpc, CidrBlock=self.subnet, AvailabilityZone=f"{self.region}a"
        )["Subnet"]["SubnetId"]
        bucket = f"{spec.name}-checkpoints"
        location = {"LocationConstraint": self.region}
        s3.create_bucket(
            Bucket=bucket,
            **({} if self.region == "us-east-1" else {"CreateBucketConfiguration": location}),
        )
        names: dict[str, str] = {}
        for group in spec.groups:
            name = asg_name(spec.name, group.name)
            template = f"{name}-lt"
            ec2.create_launch_template(
                LaunchTemplateName=template,
                LaunchTemplateData={
                    "ImageId": _AMI,
                    "InstanceType": group.instance_types[0],
                    "MetadataOptions": {
                        "HttpTokens": "required",
                        "HttpEndpoint": "enabled",
                        "InstanceMetadataTags": "enabled",
                    },
                },
            )
            tags = {TAG_CLUSTER: spec.name, TAG_GROUP: group.name, TAG_ROLE: group.role.value}
            autoscaling.create_auto_scaling_group(
                AutoScalingGroupName=name,
                LaunchTemplate={"LaunchTemplateName": template, "Version": "$Latest"},
                MinSize=group.min_size,  # count, or an elastic group's min_count
                MaxSize=group.max_size,  # as the stack: ``hetero job start`` checks it
                DesiredCapacity=group.count,
                VPCZoneIdentifier=subnet,
                Tags=[
                    {
                        "Key": k,
                        "Value": v,
                        "PropagateAtLaunch": True,
                        "ResourceId": name,
                        "ResourceType": "auto-scaling-group",
                    }
                    for k, v in tags.items()
                ],
            )
            autoscaling.put_lifecycle_hook(
                LifecycleHookName=LIFECYCLE_HOOK,
                AutoScalingGroupName=name,
                LifecycleTransition="autoscaling:EC2_INSTANCE_TERMINATING",
                HeartbeatTimeout=120,
                DefaultResult="CONTINUE",
            )
            names[group.name] = name
            if group.market is Market.SPOT:
                self._spot_groups.add((spec.name, group.name))
        cluster = ClusterNames(
            cluster=spec.name,
            region=self.region,
            bucket=bucket,
            checkpoint_prefix=f"{CHECKPOINT_PREFIX}/{spec.name}/",
            asg_names=names,
        )
        if spec_text is None:
            return cluster
        parameter = job_parameter_name(spec.name)
        pointer = JobPointer(deployed_job_id(spec_text), cluster.checkpoint_uri)
        self.client("ssm").put_parameter(Name=parameter, Value=pointer.to_json(), Type="String")
        return replace(cluster, job_parameter=parameter)

    # -- what the rehearsal reads and does ---------------------------------------------------

    def _answer_spot_prices(self, spec: ClusterSpec) -> None:
        """``DescribeSpotPriceHistory`` answers, for each type the spec's catalogue has, what
        it estimates (``PricesSpec.hourly``: ``spot_price_ratio`` x the On-Demand list price,
        or the spec's own price), dated now: a job priced from AWS (a deploy's first host,
        ``hetero job start``) gets the budget the spec's offline prices give. moto's answer
        is made in this process by its response class, which is wrapped until ``stop``."""
        from moto.ec2.responses.spot_instances import SpotInstances

        global _SPOT_PRICES, _MOTO_SPOT_ANSWER
        if _MOTO_SPOT_ANSWER is None:
            answer = _MOTO_SPOT_ANSWER = SpotInstances.describe_spot_price_history

            def priced(responses: Any) -> Any:
                result = answer(responses)
                history: list[dict[str, Any]] = result.result["SpotPriceHistory"]  # type: ignore[index]
                for p in history:
                    if _SPOT_PRICES is not None and p["InstanceType"] in CATALOG:
                        usd = _SPOT_PRICES.hourly(p["InstanceType"], Market.SPOT)
                        p["SpotPrice"] = f"{usd:.6f}"
                        p["Timestamp"] = datetime.now(UTC).isoformat()
                return result

            wrap: Any = priced
            setattr(SpotInstances, "describe_spot_price_history", wrap)  # noqa: B010
        _SPOT_PRICES = spec.job.prices

    def instances(self, cluster: str) -> list[EmulatedInstance]:
        """Every instance tagged with ``cluster`` (any state), in launch order. A Spot group's
        instance is marked ``spot`` the first time it is seen here (the simulator looks every
        half second, before it starts the instance's launcher)."""
        pages = (
            self.client("ec2")
            .get_paginator("describe_instances")
            .paginate(Filters=[{"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster]}])
        )
        reservations = [r for page in pages for r in page.get("Reservations", [])]
        created = {
            i.id: i.launch_time.replace(tzinfo=UTC).timestamp()
            for i in self._ec2_backend().all_instances()
        }
        found = []
        for inst in (i for r in reservations for i in r.get("Instances", [])):
            tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
            spot = (cluster, tags.get(TAG_GROUP, "")) in self._spot_groups
            if spot and instance_market(inst) != Market.SPOT:
                self._mark_spot(inst["InstanceId"])
            found.append(
                EmulatedInstance(
                    instance_id=inst["InstanceId"],
                    state=inst["State"]["Name"],
                    private_ip=inst.get("PrivateIpAddress", ""),
                    group=tags.get(TAG_GROUP, ""),
                    role=tags.get(TAG_ROLE, ""),
                    launch_time=inst["LaunchTime"].timestamp(),
                    launched_at=created.get(inst["InstanceId"]),
                    terminated_at=self._terminated_at.get(inst["InstanceId"]),
                )
            )
        return sorted(found, key=lambda i: (i.launch_time, _ip_key(i.private_ip)))

    def _group_sizes(self, names: ClusterNames, size: str) -> dict[str, int]:
        groups = self.client("autoscaling").describe_auto_scaling_groups(
            AutoScalingGroupNames=list(names.asg_names.values())
        )["AutoScalingGroups"]
        return {g["AutoScalingGroupName"]: int(g[size]) for g in groups}

    def desired_capacities(self, names: ClusterNames) -> dict[str, int]:
        """Auto Scaling group name -> desired capacity (groups that no longer exist: absent)."""
        return self._group_sizes(names, "DesiredCapacity")

    def max_sizes(self, names: ClusterNames) -> dict[str, int]:
        """Auto Scaling group name -> MaxSize (groups that no longer exist: absent)."""
        return self._group_sizes(names, "MaxSize")

    def set_desired_capacity(self, asg: str, desired: int) -> None:
        self.client("autoscaling").set_desired_capacity(
            AutoScalingGroupName=asg, DesiredCapacity=desired
        )

    def max_size(self, asg: str) -> int:
        (group,) = self.client("autoscaling").describe_auto_scaling_groups(
            AutoScalingGroupNames=[asg]
        )["AutoScalingGroups"]
        return int(group["MaxSize"])

    def set_max_size(self, asg: str, max_size: int) -> None:
        self.client("autoscaling").update_auto_scaling_group(
            AutoScalingGroupName=asg, MaxSize=max_size
        )

    def terminate_instance(self, instance_id: str) -> None:
        """EC2 TerminateInstances (the Auto Scaling group then launches a replacement)."""
        self.client("ec2").terminate_instances(InstanceIds=[instance_id])

    def terminate_in_group(self, instance_id: str, *, decrement: bool) -> None:
        """TerminateInstanceInAutoScalingGroup."""
        self.client("autoscaling").terminate_instance_in_auto_scaling_group(
            InstanceId=instance_id, ShouldDecrementDesiredCapacity=decrement
        )

    def shut_down_from_os(self, instance_id: str) -> None:
        """What EC2 does with ``shutdown -h now`` on an instance whose launch template says
        InstanceInitiatedShutdownBehavior ``terminate`` (the boot's give-up point): the instance
        terminates with the state reason ``Client.InstanceInitiatedShutdown``, and its group
        launches a replacement. moto has no OS to shut down: the termination goes through its
        API (so its Auto Scaling replaces the instance) and the state reason is set in its
        backend, which runs in this process."""
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.ec2.models import ec2_backends
        from moto.ec2.models.instances import StateReason

        self.terminate_instance(instance_id)
        instance = ec2_backends[DEFAULT_ACCOUNT_ID][self.region].get_instance(instance_id)
        instance.state_reason = StateReason(
            f"{INSTANCE_INITIATED_SHUTDOWN}: Instance initiated shutdown",
            INSTANCE_INITIATED_SHUTDOWN,
        )

    def _autoscaling_group(self, asg: str) -> Any:
        """moto's Auto Scaling group object (it runs in this process)."""
        from moto.autoscaling.models import autoscaling_backends
        from moto.core import DEFAULT_ACCOUNT_ID

        return autoscaling_backends[DEFAULT_ACCOUNT_ID][self.region].autoscaling_groups[asg]

    def hold_launches(self, asg: str) -> None:
        """From now on the group finds no capacity: each launch it would make (a replacement, a
        higher desired capacity) fails, as Auto Scaling's activity fails with
        ``InsufficientInstanceCapacity`` when EC2 has none of the group's types, and the group
        stays below its desired capacity. moto launches at once whatever capacity there is; its
        group object's launch method is replaced until ``release_launches``."""
        group = self._autoscaling_group(asg)
        refused = self.launches_refused
        refused[asg] = 0

        def no_capacity(count_needed: int, propagated_tags: dict[str, str]) -> None:
            refused[asg] = refused.get(asg, 0) + count_needed

        group.replace_autoscaling_group_instances = no_capacity

    def release_launches(self, asg: str) -> None:
        """Capacity is back: the group launches what its desired capacity misses, as Auto
        Scaling retries a failed launch."""
        group = self._autoscaling_group(asg)
        if "replace_autoscaling_group_instances" in vars(group):
            del group.replace_autoscaling_group_instances
            group.set_desired_capacity(group.desired_capacity)

    def _mark_spot(self, instance_id: str) -> None:
        """EC2 lists a Spot Instance with ``InstanceLifecycle`` ``spot``; moto's Auto Scaling
        launches On-Demand ones only, so the mark is set in its backend (in this process)."""
        self._ec2_backend().get_instance(instance_id).lifecycle = "spot"

    def replace_unhealthy(self, names: ClusterNames) -> list[str]:
        """Auto Scaling's part of ``SetInstanceHealth``: an InService instance marked Unhealthy
        is terminated and replaced (moto records the health status and does nothing more).
        Returns the instances terminated."""
        groups = set(names.asg_names.values())
        paginator = self.client("autoscaling").get_paginator("describe_auto_scaling_instances")
        replaced = [
            inst["InstanceId"]
            for page in paginator.paginate()
            for inst in page.get("AutoScalingInstances", [])
            if inst["AutoScalingGroupName"] in groups
            and inst["HealthStatus"].upper() == "UNHEALTHY"
            and inst["LifecycleState"] == "InService"
        ]
        for instance_id in replaced:
            self.terminate_in_group(instance_id, decrement=False)
        return replaced

    def scheduled_actions(self, names: ClusterNames) -> list[dict[str, Any]]:
        """The cluster's groups' scheduled actions that have not run: group, name, start time
        (epoch seconds) and the sizes each sets."""
        client = self.client("autoscaling")
        found = []
        for asg in names.asg_names.values():
            for a in client.describe_scheduled_actions(AutoScalingGroupName=asg)[
                "ScheduledUpdateGroupActions"
            ]:
                found.append({"group": asg, "name": a["ScheduledActionName"],
                              "start": a["StartTime"].timestamp(), **_sizes(a)})  # fmt: skip
        return found

    def run_scheduled_actions(
        self, actions: list[dict[str, Any]], now: float | None = None
    ) -> list[dict[str, Any]]:
        """Auto Scaling's part of one-time scheduled actions (``scheduled_actions``; moto
        stores them and runs none): one whose start time has come sets the sizes it names on
        its group, and is gone after (DescribeScheduledActions lists the actions that have not
        run). Returns those run."""
        now = time.time() if now is None else now
        client = self.client("autoscaling")
        due = [a for a in actions if a["start"] <= now]
        for a in due:
            client.update_auto_scaling_group(AutoScalingGroupName=a["group"], **_sizes(a))
            client.delete_scheduled_action(
                AutoScalingGroupName=a["group"], ScheduledActionName=a["name"]
            )
        return due

    def read_object(self, bucket: str, key: str) -> bytes | None:
        """The object's bytes, or None when it does not exist (404, or a 403 whose exact-key
        listing lacks it: the launcher's own reader, ``training.common.s3.read_object``)."""
        return read_object(self.client("s3"), bucket, key)

    def list_keys(self, bucket: str, prefix: str) -> list[str]:
        paginator = self.client("s3").get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=bucket, Prefix=prefix)
        return [obj["Key"] for page in pages for obj in page.get("Contents", [])]

    def download_prefix(self, bucket: str, prefix: str, dest: Path) -> int:
        """Every object under ``prefix`` into ``dest`` (same relative paths); files written."""
        keys = self.list_keys(bucket, prefix)
        for key in keys:
            target = dest / key[len(prefix) :]
            target.parent.mkdir(parents=True, exist_ok=True)
            self.client("s3").download_file(bucket, key, str(target))
        return len(keys)


def _sizes(action: dict[str, Any]) -> dict[str, int]:
    """The group sizes a scheduled action sets (those it names)."""
    return {k: action[k] for k in ("MinSize", "MaxSize", "DesiredCapacity") if k in action}


def _restore_spot_answer() -> None:
    """moto's own ``DescribeSpotPriceHistory`` answer back (``AwsEmulator._answer_spot_prices``)."""
    global _SPOT_PRICES, _MOTO_SPOT_ANSWER
    if _MOTO_SPOT_ANSWER is not None:
        from moto.ec2.responses.spot_instances import SpotInstances

        setattr(SpotInstances, "describe_spot_price_history", _MOTO_SPOT_ANSWER)  # noqa: B010
        _MOTO_SPOT_ANSWER = _SPOT_PRICES = None


def _ip_key(ip: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in ip.split("."))
    except ValueError:
        return (0,)
