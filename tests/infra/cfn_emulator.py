"""A local CloudFormation for the deploy rehearsal: moto in server mode on 127.0.0.1, the
environment ``cdk bootstrap`` and AWS itself provide, and the shims for what moto lacks
(``Missing``).

A plain module beside the tests (like ``infra_support``), not a conftest: the deploy rehearsal
is its only user. Nothing here reaches AWS: every client has the server's loopback endpoint and
fake credentials.

moto's backends live in this process and are shared by every server in it; one
``MotoServer`` is reset when it starts and when it stops, and separate ``CloudFormationEmulator``
views of it use separate regions so that their stacks, exports and parameters never meet.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import json
import logging
import re
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from botocore.parsers import ResponseParserError
from moto.cloudformation.parsing import NULL_MODELS, get_model_map
from moto.core import DEFAULT_ACCOUNT_ID
from moto.core.common_models import CloudFormationModel
from moto.core.utils import utcnow
from moto.server import ThreadedMotoServer
from moto.ssm.models import Parameter, ssm_backends

logger = logging.getLogger(__name__)

ACCOUNT_ID = DEFAULT_ACCOUNT_ID
"""moto's account: the one the fake credentials map to."""
STAND_IN_TYPE = "AWS::CloudFormation::WaitConditionHandle"
"""What a resource of a type moto cannot create becomes: a no-op for CloudFormation (moto skips
it), so the logical id, and every ``DependsOn`` on it, stay valid."""
_BOOTSTRAP_PARAMETER = re.compile(r"^/cdk-bootstrap/(?P<qualifier>[a-z0-9]+)/version$")
_SUB_REFERENCE = re.compile(r"\$\{(?P<name>[A-Za-z0-9]+)(?:\.[A-Za-z0-9.]+)?\}")


class Missing(enum.Enum):
    """What moto's CloudFormation lacks for one resource type, which decides the shim."""

    CREATE = "create"
    """No model at all: the resource becomes a ``STAND_IN_TYPE`` stand-in in the template."""
    DELETE = "delete"
    """A model that creates but cannot delete: the emulator deletes the stack's resources of
    the type through the service API (``DELETE_HANDLERS``) right before ``DeleteStack``."""
    MAP_TAGS = "map-tags"
    """A model that reads ``Tags`` only as a list of ``{Key, Value}`` where CloudFormation's
    type takes a map: the deployed template carries the same tags in list form."""


@dataclass(frozen=True)
class DeleteHandler:
    """How CloudFormation deletes one resource of a type: ``delete(client, physical_id)`` with
    a client of ``service``."""

    service: str
    delete: Callable[[Any, str], object]


DELETE_HANDLERS: Mapping[str, DeleteHandler] = {
    "AWS::EC2::RouteTable": DeleteHandler(
        "ec2", lambda ec2, route_table_id: ec2.delete_route_table(RouteTableId=route_table_id)
    ),
}
"""The delete call for each type a ``Missing.DELETE`` shim may name."""


# -- what moto supports --------------------------------------------------------------------


def moto_unsupported_types(resource_types: Iterable[str]) -> set[str]:
    """The types among ``resource_types`` that moto's CloudFormation has no model for.

    moto logs "No Moto CloudFormation support for ..." and skips such a resource (or fails on a
    ``GetAtt`` of it in Outputs); its models are ``moto/cloudformation/parsing.py``'s
    ``get_model_map()``. Custom resources and wait conditions are handled, so not missing.
    """
    supported = set(get_model_map()) | set(NULL_MODELS)
    return {t for t in resource_types if t not in supported and not t.startswith("Custom::")}


def moto_can_delete(resource_type: str) -> bool:
    """Whether moto's model of ``resource_type`` deletes the resource when its stack is
    deleted (an own ``delete`` method or a concrete ``delete_from_cloudformation_json``);
    without either moto's DeleteStack silently leaves the resource behind."""
    model = get_model_map()[resource_type]
    own_delete = any(
        "delete" in vars(cls) for cls in model.__mro__ if cls not in (CloudFormationModel, object)
    )
    concrete = not getattr(model.delete_from_cloudformation_json, "__isabstractmethod__", False)
    return own_delete or concrete


def template_resource_types(template: Mapping[str, Any]) -> set[str]:
    """Every resource type a template declares."""
    return {str(r["Type"]) for r in template.get("Resources", {}).values()}


# -- shims for types moto cannot create -----------------------------------------------------


def stand_in_value(logical_id: str) -> str:
    """What every ``Ref``, ``Fn::GetAtt`` and ``Fn::Sub`` reference to a stand-in becomes."""
    return f"shim-{logical_id}"


def shim_template(template: Mapping[str, Any], shimmed_types: Iterable[str]) -> dict[str, Any]:
    """A copy of ``template`` in which each resource of a type in ``shimmed_types`` is a
    ``STAND_IN_TYPE`` resource (same logical id, ``DependsOn`` and ``Condition``; the original
    type in ``Metadata.ShimFor``) and every reference to it is ``stand_in_value(logical_id)``."""
    types = set(shimmed_types)
    result = copy.deepcopy(dict(template))
    resources: dict[str, Any] = result.get("Resources", {})
    shimmed = {name for name, r in resources.items() if r["Type"] in types}
    for name in shimmed:
        original = resources[name]
        stand_in: dict[str, Any] = {
            "Type": STAND_IN_TYPE,
            "Metadata": {"ShimFor": original["Type"]},
        }
        for key in ("DependsOn", "Condition"):
            if key in original:
                stand_in[key] = original[key]
        resources[name] = stand_in
    if not shimmed:
        return result
    replaced: dict[str, Any] = _replace_references(result, shimmed)
    return replaced


def _replace_references(node: Any, shimmed: set[str]) -> Any:
    if isinstance(node, list):
        return [_replace_references(v, shimmed) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) == 1:
        ((key, value),) = node.items()
        if key == "Ref" and value in shimmed:
            return stand_in_value(value)
        if key == "Fn::GetAtt":
            target = value[0] if isinstance(value, list) else str(value).split(".", 1)[0]
            if target in shimmed:
                return stand_in_value(target)
        if key == "Fn::Sub":
            return {key: _replace_sub(value, shimmed)}
    return {k: _replace_references(v, shimmed) for k, v in node.items()}


def _replace_sub(value: Any, shimmed: set[str]) -> Any:
    def substitute(text: str) -> str:
        return _SUB_REFERENCE.sub(
            lambda m: stand_in_value(m["name"]) if m["name"] in shimmed else m[0], text
        )

    if isinstance(value, str):
        return substitute(value)
    text, variables = value
    return [substitute(text), _replace_references(variables, shimmed)]


def list_form_tags(template: Mapping[str, Any], types: Iterable[str]) -> dict[str, Any]:
    """A copy of ``template`` in which each resource of a type in ``types`` whose ``Tags`` is a
    map carries the same tags as a list of ``{"Key": k, "Value": v}``."""
    wanted = set(types)
    result = copy.deepcopy(dict(template))
    for resource in result.get("Resources", {}).values():
        tags = resource.get("Properties", {}).get("Tags")
        if resource["Type"] in wanted and isinstance(tags, dict):
            resource["Properties"]["Tags"] = [{"Key": k, "Value": v} for k, v in tags.items()]
    return result


def has_map_tags(template: Mapping[str, Any], resource_type: str) -> bool:
    """Whether some resource of ``resource_type`` in ``template`` has ``Tags`` as a map."""
    return any(
        r["Type"] == resource_type and isinstance(r.get("Properties", {}).get("Tags"), dict)
        for r in template.get("Resources", {}).values()
    )


# -- the cloud assembly -------------------------------------------------------------------


@dataclass(frozen=True)
class CdkBootstrap:
    """What ``cdk bootstrap`` creates that the synthesized stacks need at deploy time."""

    version_parameter: str
    """SSM parameter read by every stack's ``BootstrapVersion`` parameter (and its rule)."""
    staging_bucket: str
    """Where ``cdk deploy`` uploads the templates (file assets)."""
    image_repository: str
    """Where ``cdk deploy`` pushes Docker image assets ("" when the stacks have none)."""


def load_assembly(
    outdir: Path, stack_names: Iterable[str]
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The templates (by stack name) and asset manifests ``app.synth()`` wrote to ``outdir``."""
    templates: dict[str, dict[str, Any]] = {}
    manifests: list[dict[str, Any]] = []
    for name in stack_names:
        templates[name] = json.loads((outdir / f"{name}.template.json").read_text())
        assets = outdir / f"{name}.assets.json"
        if assets.is_file():
            manifests.append(json.loads(assets.read_text()))
    return templates, manifests


def bootstrap_from_assembly(
    templates: Mapping[str, Mapping[str, Any]],
    asset_manifests: Iterable[Mapping[str, Any]],
    *,
    region: str,
) -> CdkBootstrap:
    """The bootstrap resources the stacks refer to (their qualifier included), read from the
    templates and asset manifests, with moto's account and ``region`` filled in."""
    parameters = {
        t["Parameters"]["BootstrapVersion"]["Default"]
        for t in templates.values()
        if "BootstrapVersion" in t.get("Parameters", {})
    }
    if len(parameters) != 1 or not _BOOTSTRAP_PARAMETER.match(next(iter(parameters))):
        raise ValueError(f"expected one /cdk-bootstrap/<qualifier>/version: {parameters}")
    buckets: set[str] = set()
    repositories: set[str] = set()
    for manifest in asset_manifests:
        for asset in manifest.get("files", {}).values():
            buckets |= {d["bucketName"] for d in asset["destinations"].values()}
        for asset in manifest.get("dockerImages", {}).values():
            repositories |= {d["repositoryName"] for d in asset["destinations"].values()}
    if len(buckets) != 1 or len(repositories) > 1:
        raise ValueError(
            f"expected one staging bucket, at most one repository: {buckets}, {repositories}"
        )

    def resolve(text: str) -> str:
        return text.replace("${AWS::AccountId}", ACCOUNT_ID).replace("${AWS::Region}", region)

    return CdkBootstrap(
        version_parameter=next(iter(parameters)),
        staging_bucket=resolve(buckets.pop()),
        image_repository=resolve(repositories.pop()) if repositories else "",
    )


# -- the server and one region of it --------------------------------------------------------


class MotoServer:
    """moto in server mode on a free loopback port, reset on start and on stop."""

    def __init__(self) -> None:
        # One access-log line per request would drown the test output.
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"
        if not host.startswith("127."):
            self.stop()
            raise RuntimeError(f"moto server bound to {host}, not to loopback")
        self.reset()

    def reset(self) -> None:
        """Drop every resource of every backend (they are process-wide)."""
        request = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()

    def stop(self) -> None:
        """Reset and stop the server (idempotent)."""
        with contextlib.suppress(Exception):
            self.reset()
        with contextlib.suppress(Exception):
            self._server.stop()


class StackFailed(AssertionError):
    """A stack did not reach the status waited for; the message carries moto's reason."""


class CloudFormationEmulator:
    """One region of a ``MotoServer``, and what ``cdk deploy`` / ``cdk destroy`` do there."""

    def __init__(self, server: MotoServer, *, region: str) -> None:
        self.server = server
        self.region = region

    def client(self, service: str) -> Any:
        """A boto3 client of ``service`` bound to the server (never to AWS), no retries."""
        return boto3.client(
            service,  # type: ignore[call-overload]
            endpoint_url=self.server.endpoint_url,
            region_name=self.region,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            config=Config(retries={"max_attempts": 1}, connect_timeout=5, read_timeout=60),
        )

    # -- the environment --------------------------------------------------------------------

    def bootstrap(self, bootstrap: CdkBootstrap, *, version: str) -> None:
        """Create what ``cdk bootstrap`` would have: the version parameter (``version``), the
        staging bucket and the image repository."""
        self.client("ssm").put_parameter(
            Name=bootstrap.version_parameter, Value=version, Type="String", Overwrite=True
        )
        s3 = self.client("s3")
        if self.region == "us-east-1":
            s3.create_bucket(Bucket=bootstrap.staging_bucket)
        else:
            s3.create_bucket(
                Bucket=bootstrap.staging_bucket,
                CreateBucketConfiguration={"LocationConstraint": self.region},
            )
        if bootstrap.image_repository:
            self.client("ecr").create_repository(repositoryName=bootstrap.image_repository)

    def ensure_public_parameter(self, name: str, value: str) -> bool:
        """Make the AWS-owned public SSM parameter ``name`` exist with ``value`` unless moto
        already publishes it; return whether it had to be added.

        AWS owns ``/aws/service/...``: PutParameter there is refused (by moto too), so a
        missing one goes into moto's SSM backend in this process, where the server runs, and
        is read back through the API.
        """
        ssm = self.client("ssm")
        try:
            ssm.get_parameter(Name=name)
            return False
        except ClientError as e:
            if e.response["Error"]["Code"] != "ParameterNotFound":
                raise
        ssm_backends[ACCOUNT_ID][self.region]._parameters[name].append(
            # moto's stubs mark its CloudFormation models abstract; Parameter is concrete.
            Parameter(  # type: ignore[abstract]
                account_id=ACCOUNT_ID,
                name=name,
                value=value,
                parameter_type="String",
                description=None,
                allowed_pattern=None,
                keyid=None,
                last_modified_date=utcnow(),
                version=1,
                data_type="aws:ec2:image",
            )
        )
        got = ssm.get_parameter(Name=name)["Parameter"]["Value"]
        if got != value:
            raise RuntimeError(f"public parameter {name} reads {got!r}, not {value!r}")
        return True

    # -- deploy and destroy -----------------------------------------------------------------

    def deploy(
        self,
        stack_name: str,
        template: Mapping[str, Any],
        *,
        bootstrap: CdkBootstrap,
        timeout_s: float,
    ) -> dict[str, Any]:
        """Upload ``template`` to the staging bucket and create the stack from its URL (as
        ``cdk deploy`` does); wait, bounded, for CREATE_COMPLETE and return the stack."""
        key = f"templates/{stack_name}-{time.time_ns()}.json"
        self.client("s3").put_object(
            Bucket=bootstrap.staging_bucket, Key=key, Body=json.dumps(template).encode()
        )
        url = f"https://s3.{self.region}.amazonaws.com/{bootstrap.staging_bucket}/{key}"
        try:
            stack_id = self.client("cloudformation").create_stack(
                StackName=stack_name,
                TemplateURL=url,
                Capabilities=["CAPABILITY_IAM", "CAPABILITY_NAMED_IAM"],
            )["StackId"]
        except (ClientError, BotoCoreError, ResponseParserError) as e:
            # moto answers an exception inside a resource handler with an HTML HTTP 500.
            raise StackFailed(f"CreateStack {stack_name} failed: {e}") from e
        return self._wait(stack_id, "CREATE_COMPLETE", timeout_s)

    def destroy(
        self, stack_id: str, *, delete_shims: Iterable[str], timeout_s: float
    ) -> dict[str, Any]:
        """Delete the stack (first the resources of the ``delete_shims`` types, which moto's
        DeleteStack would leave behind); wait, bounded, for DELETE_COMPLETE; return the stack.
        """
        cfn = self.client("cloudformation")
        types = set(delete_shims)
        unknown = types - set(DELETE_HANDLERS)
        if unknown:
            raise ValueError(f"no delete handler for {sorted(unknown)}: add to DELETE_HANDLERS")
        summaries = cfn.list_stack_resources(StackName=stack_id)["StackResourceSummaries"]
        for resource in summaries:
            handler = DELETE_HANDLERS.get(resource["ResourceType"])
            if handler is not None and resource["ResourceType"] in types:
                handler.delete(self.client(handler.service), resource["PhysicalResourceId"])
        try:
            cfn.delete_stack(StackName=stack_id)
        except (ClientError, BotoCoreError, ResponseParserError) as e:
            raise StackFailed(f"DeleteStack {stack_id} failed: {e}") from e
        return self._wait(stack_id, "DELETE_COMPLETE", timeout_s)

    def _wait(self, stack_id: str, wanted: str, timeout_s: float) -> dict[str, Any]:
        cfn = self.client("cloudformation")
        deadline = time.monotonic() + timeout_s
        while True:
            stack: dict[str, Any] = cfn.describe_stacks(StackName=stack_id)["Stacks"][0]
            status = stack["StackStatus"]
            if status == wanted:
                return stack
            if not status.endswith("_IN_PROGRESS") or time.monotonic() > deadline:
                events = cfn.describe_stack_events(StackName=stack_id)["StackEvents"]
                reasons = [
                    f"{e['LogicalResourceId']} {e['ResourceStatus']} "
                    f"{e.get('ResourceStatusReason', '')}".strip()
                    for e in events
                ]
                raise StackFailed(
                    f"{stack['StackName']} is {status}, not {wanted} (waited at most "
                    f"{timeout_s:.0f} s); events: {reasons}"
                )
            time.sleep(0.2)
