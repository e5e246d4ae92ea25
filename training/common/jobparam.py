"""The job pointer: which job a deployed cluster runs now, and where its checkpoints are.

An SSM parameter (String, standard tier) named ``/hetero/<cluster>/job``
(``training.common.names.job_parameter_name``) holds one JSON object::

    {"job_id": "j-20261122T100000-ab12",
     "checkpoint_uri": "s3://bucket/checkpoints/d-0123456789ab/",
     "started": "2026-11-22T10:00:00Z",
     "resumed_from": "d-0123456789ab",
     "max_usd": 50.0,
     "max_hours": null,
     "prices": [{"group": "trainer", "instance_type": "g5.xlarge", "market": "spot",
                 "count": 2, "usd_per_hour": 0.4321, "source": "spot-price-history",
                 "as_of": "2026-11-22T10:00:00Z"}, ...],
     "init": "timm:vit_base_patch16_224.augreg2_in21k_ft_in1k",
     "init_uri": "s3://bucket/checkpoints/init/<sha256>/"}

- ``job_id``: ``d-<first 12 hex of sha256(spec)>`` for the job a deploy starts (the same spec
  deploys the same id, so CloudFormation sees no change), ``j-<UTC yyyymmddTHHMMSS>-<4 hex>``
  for one ``hetero job start`` starts.
- ``checkpoint_uri``: where the trainer's checkpoints and the job record (``job/``) are; it
  replaces ``HETERO_CHECKPOINT_URI`` on the instances.
- ``started``: ISO 8601 UTC time of ``hetero job start``; null for the job a deploy created
  (a CloudFormation template has no deploy time to put there).
- ``resumed_from``: the previous job's id when the job resumes its checkpoints, else null.
- ``max_usd``, ``max_hours``: this job's budget when ``hetero job start --max-usd/--max-hours``
  set it (a positive number), instead of the deployed spec's ``job.max_usd`` / ``job.max_hours``;
  null (or absent): the spec's. A stopped job can so be resumed with a larger cap without a
  deploy (a deploy of a changed spec starts a fresh job in a new folder).
- ``prices``: what each instance group costs per hour at its most, priced when
  ``hetero job start`` ran (``GroupPrice``, ``training/prices.py``); absent for the job a deploy
  created (a CloudFormation template cannot ask AWS for prices), whose budget then prices the
  groups from the dated offline catalogue (``training.costs.budget``). A few hundred bytes a
  group, well inside a standard parameter's 4 KB.
- ``init``, ``init_uri``: for a spec whose ``job.model.init`` is ``timm:NAME.TAG``, that value
  and where the job reads its files, staged in S3 because the instances have no internet route
  (``training.common.timm_hub``): ``hetero job start`` puts them in the checkpoint bucket
  (``<checkpoint prefix>/init/<sha256>/``), a deploy in the CDK asset bucket (a zip,
  ``infra/init_asset.py``). For an ``s3://`` init outside the checkpoint prefix (a bucket the
  instance role cannot read), ``hetero job start`` copies it to the same ``init/`` folder
  (``training.common.s3_init``) and ``init_uri`` names the copy (the file's, or the folder).
  The launcher hands ``init_uri`` to the trainer (``HETERO_INIT_URI``) when ``init`` is its
  spec's. Absent for any other spec.

The stack creates the parameter (``infra/job.py``); ``hetero job start`` overwrites it; the
launcher reads it when it starts and at every generation boundary (``JobWatch``), so a host
still running an older job leaves it for the new one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

from training.common.names import MARKET_ON_DEMAND, MARKET_SPOT

log = logging.getLogger(__name__)

DEPLOYED_ID_PREFIX = "d-"
"""Job ids a deploy creates (``deployed_job_id``)."""
STARTED_ID_PREFIX = "j-"
"""Job ids ``hetero job start`` creates."""
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_FIX = "run `hetero job start --spec FILE` to write a valid one"

MAX_ATTEMPTS = 4
"""Attempts per SSM request in all (``training.common.aws.client(..., attempts=)``: botocore's
``standard`` retry mode, with backoff)."""


class JobPointerError(ValueError):
    """The job parameter holds something that is not a job pointer (the message says what)."""


class JobParameterNotFound(LookupError):
    """The job parameter does not exist (the stack was not deployed, or with an older version)."""


PRICE_SOURCES = ("spot-price-history", "price-list", "spec", "catalogue")
"""Where a recorded price comes from: EC2's ``DescribeSpotPriceHistory``, the Price List API,
the spec's ``[job.prices] usd_per_hour``, or the dated offline catalogue
(``training.instance_types``)."""
MARKETS = (MARKET_SPOT, MARKET_ON_DEMAND)


@dataclass(frozen=True)
class GroupPrice:
    """What one instance group costs per hour at its most, as recorded when its job started."""

    group: str
    instance_type: str
    """The dearest of the group's listed types in its market (a Spot group may get any)."""
    market: str
    """``spot`` or ``on-demand``."""
    count: int
    """Instances at its most: the group's count, an elastic group's ``max_count``."""
    usd_per_hour: float
    """One instance of ``instance_type``."""
    source: str
    """One of ``PRICE_SOURCES``."""
    as_of: str | None
    """When the price was true: the time it was read from AWS (ISO 8601 UTC), the catalogue's
    date, or None for the spec's own (undated) prices."""

    @property
    def group_usd_per_hour(self) -> float:
        return self.count * self.usd_per_hour


@dataclass(frozen=True)
class JobPointer:
    """The cluster's current job (see the module docstring for each field)."""

    job_id: str
    checkpoint_uri: str
    started: str | None = None
    resumed_from: str | None = None
    max_usd: float | None = None
    max_hours: float | None = None
    prices: tuple[GroupPrice, ...] | None = None
    init: str | None = None
    init_uri: str | None = None

    def to_json(self) -> str:
        """The parameter's value (keys in the documented order; the caps, the prices and the
        staged init only when set, so a deploy's pointer is what it was before they existed)."""
        value = asdict(self)
        for optional in ("max_usd", "max_hours", "prices", "init", "init_uri"):
            if value[optional] is None:
                del value[optional]
        return json.dumps(value)

    @property
    def usd_per_hour(self) -> float | None:
        """The recorded price of every group at its most, summed; None without prices."""
        if self.prices is None:
            return None
        return sum(p.group_usd_per_hour for p in self.prices)

    @property
    def checkpoint_base(self) -> str:
        """The folder that holds this job's checkpoint folder (``--fresh`` puts the new job's
        folder there): ``s3://b/checkpoints/`` for ``s3://b/checkpoints/d-0123/``."""
        head, sep, _ = self.checkpoint_uri.rstrip("/").rpartition("/")
        if not sep or head.endswith(":/") or head.endswith(":"):
            raise JobPointerError(
                f"checkpoint_uri {self.checkpoint_uri!r} has no parent folder to put a new job's "
                "checkpoints in (expected s3://bucket/prefix/<job id>/)"
            )
        return head + "/"


def parse_job_pointer(text: str, *, source: str = "the job parameter") -> JobPointer:
    """The pointer in ``text``; ``JobPointerError`` naming ``source``, what is wrong and the fix.
    Keys other than the documented ones are ignored (a newer writer may add some)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise JobPointerError(f"{source} is not JSON ({e}): {text[:200]!r}; {_FIX}") from None
    if not isinstance(value, dict):
        raise JobPointerError(
            f"{source} must be a JSON object with job_id and checkpoint_uri, got "
            f"{type(value).__name__}: {text[:200]!r}; {_FIX}"
        )
    problems: list[str] = []
    job_id = value.get("job_id")
    if not isinstance(job_id, str) or not _JOB_ID_RE.match(job_id):
        problems.append(
            f"job_id must be a string of letters, digits, '.', '_' or '-' (got {job_id!r})"
        )
    uri = value.get("checkpoint_uri")
    if not isinstance(uri, str) or not uri.strip() or not uri.endswith("/"):
        problems.append(
            f"checkpoint_uri must be a folder URI ending in '/', e.g. "
            f"s3://bucket/checkpoints/<job id>/ (got {uri!r})"
        )
    for key in ("started", "resumed_from"):
        if value.get(key) is not None and not isinstance(value.get(key), str):
            problems.append(f"{key} must be a string or null (got {value.get(key)!r})")
    for key in ("max_usd", "max_hours"):
        cap = value.get(key)
        if cap is not None and (not _is_number(cap) or not cap > 0):
            problems.append(f"{key} must be a number above 0 or null (got {cap!r})")
    prices = _parse_prices(value.get("prices"), problems)
    init, init_uri = value.get("init"), value.get("init_uri")
    if (init is None) != (init_uri is None) or (
        init is not None and not (isinstance(init, str) and init.strip())
    ):
        problems.append(
            f"init and init_uri go together: job.model.init and where it is staged (got init "
            f"{init!r}, init_uri {init_uri!r})"
        )
    elif init_uri is not None and not (isinstance(init_uri, str) and init_uri.startswith("s3://")):
        problems.append(f"init_uri must be an s3:// URI (got {init_uri!r})")
    if problems:
        raise JobPointerError(f"{source} is not a valid job pointer: {'; '.join(problems)}; {_FIX}")
    return JobPointer(
        job_id=str(job_id),
        checkpoint_uri=str(uri),
        started=value.get("started"),
        resumed_from=value.get("resumed_from"),
        max_usd=_float_or_none(value.get("max_usd")),
        max_hours=_float_or_none(value.get("max_hours")),
        prices=prices,
        init=init,
        init_uri=init_uri,
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _parse_prices(value: Any, problems: list[str]) -> tuple[GroupPrice, ...] | None:
    """The pointer's ``prices`` (None when absent); appends to ``problems`` what is wrong."""
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(p, dict) for p in value):
        problems.append(f"prices must be a list of objects, one per instance group (got {value!r})")
        return None
    found = []
    for i, p in enumerate(value):
        where = f"prices[{i}]"
        wrong = [
            f"{where}.{key} must be a non-empty string (got {p.get(key)!r})"
            for key in ("group", "instance_type")
            if not isinstance(p.get(key), str) or not p.get(key)
        ]
        if p.get("market") not in MARKETS:
            wrong.append(
                f"{where}.market must be one of {', '.join(MARKETS)} (got {p.get('market')!r})"
            )
        if p.get("source") not in PRICE_SOURCES:
            sources = ", ".join(PRICE_SOURCES)
            wrong.append(f"{where}.source must be one of {sources} (got {p.get('source')!r})")
        count = p.get("count")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            wrong.append(f"{where}.count must be a whole number above 0 (got {count!r})")
        usd = p.get("usd_per_hour")
        if not _is_number(usd) or not 0 <= usd < math.inf:
            wrong.append(f"{where}.usd_per_hour must be a number of 0 or more (got {usd!r})")
        if p.get("as_of") is not None and not isinstance(p.get("as_of"), str):
            wrong.append(f"{where}.as_of must be a string or null (got {p.get('as_of')!r})")
        problems.extend(wrong)
        if not wrong:
            found.append(
                GroupPrice(
                    group=p["group"],
                    instance_type=p["instance_type"],
                    market=p["market"],
                    count=count,
                    usd_per_hour=float(usd),
                    source=p["source"],
                    as_of=p.get("as_of"),
                )
            )
    return tuple(found)


def prices_to_json(prices: tuple[GroupPrice, ...]) -> list[dict[str, Any]]:
    """``prices`` as the pointer's ``prices`` holds them (and the job record's ``prices.json``)."""
    return [asdict(p) for p in prices]


def prices_from_json(value: Any, *, source: str) -> tuple[GroupPrice, ...] | None:
    """Prices as ``prices_to_json`` wrote them; None when absent, or (logged) not readable."""
    problems: list[str] = []
    prices = _parse_prices(value, problems)
    if problems:
        log.warning("%s: prices ignored: %s", source, "; ".join(problems))
        return None
    return prices


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def deployed_job_id(spec_text: str) -> str:
    """The id of the job a deploy of ``spec_text`` starts: the same spec gives the same id (an
    unchanged template), a changed spec a new one (and a new checkpoint folder)."""
    return DEPLOYED_ID_PREFIX + hashlib.sha256(spec_text.encode()).hexdigest()[:12]


def deployed_job_pointer(
    spec_text: str,
    checkpoint_base_uri: str,
    *,
    init: str | None = None,
    init_uri: str | None = None,
) -> JobPointer:
    """The pointer the stack writes: ``started`` is null, there is no deploy time to record;
    ``init``/``init_uri``: a ``timm:`` init and its staged copy."""
    job_id = deployed_job_id(spec_text)
    base = checkpoint_base_uri if checkpoint_base_uri.endswith("/") else checkpoint_base_uri + "/"
    return JobPointer(
        job_id=job_id, checkpoint_uri=f"{base}{job_id}/", init=init, init_uri=init_uri
    )


def read_job_pointer(ssm: Any, name: str) -> JobPointer:
    """The pointer in parameter ``name``. ``JobParameterNotFound`` when it does not exist,
    ``JobPointerError`` when its value is not a pointer; other errors (access, network)
    propagate as botocore raises them."""
    try:
        reply = ssm.get_parameter(Name=name)
    except ssm.exceptions.ParameterNotFound:
        raise JobParameterNotFound(
            f"SSM parameter {name} does not exist: deploy the cluster stack first "
            "(npx cdk deploy --all -c spec=FILE), which creates it"
        ) from None
    return parse_job_pointer(reply["Parameter"]["Value"], source=f"SSM parameter {name}")


def read_job_pointer_patiently(
    ssm: Any, name: str, *, timeout_s: float = 60.0, pause_s: float = 5.0
) -> JobPointer:
    """``read_job_pointer``, retried for up to ``timeout_s`` while SSM cannot be reached (an
    instance that has just booted may wait for the VPC endpoint or its role's credentials);
    a missing parameter or a bad value is final at once."""
    deadline = time.monotonic() + timeout_s
    attempt = 0
    while True:
        attempt += 1
        try:
            return read_job_pointer(ssm, name)
        except (JobParameterNotFound, JobPointerError):
            raise
        except Exception as e:  # botocore's connection, credential and service errors
            if time.monotonic() + pause_s > deadline:
                raise JobPointerError(
                    f"could not read SSM parameter {name} in {timeout_s:g}s ({attempt} "
                    f"attempts; last: {e}). Check the instance role's ssm:GetParameter "
                    "permission and the SSM VPC endpoint"
                ) from e
            log.warning("could not read SSM parameter %s (%s); retrying in %gs", name, e, pause_s)
            time.sleep(pause_s)


class JobWatch:
    """Whether the job this host runs is still the cluster's current one.

    Thread-safe (boto3 clients are); a read that fails is logged and counts as "still current",
    so an SSM hiccup never makes a host leave a running job."""

    def __init__(self, ssm: Any, name: str, pointer: JobPointer) -> None:
        self.ssm = ssm
        self.name = name
        self.pointer = pointer
        """The job this host runs."""

    def newer(self) -> JobPointer | None:
        """The parameter's pointer when it names another job than ``pointer``, else None."""
        try:
            current = read_job_pointer(self.ssm, self.name)
        except Exception as e:
            log.warning("could not read the job pointer %s: %s (staying on job %s)",
                        self.name, e, self.pointer.job_id)  # fmt: skip
            return None
        return None if current.job_id == self.pointer.job_id else current


def stale_spec(pointer: JobPointer, spec_text: str) -> str | None:
    """Why this host must not run ``pointer``'s job with the spec it has, or None.

    A job a deploy started (id ``d-<spec hash>``) runs the spec of that deploy. An instance that
    holds another spec was launched from an earlier launch template, and a deploy of a changed
    spec does not replace running instances: joining would mix two specs in one job. Jobs that
    ``hetero job start`` started keep the deployed spec, so only deploy ids can be checked.
    """
    if not pointer.job_id.startswith(DEPLOYED_ID_PREFIX):
        return None
    mine = deployed_job_id(spec_text)
    if pointer.job_id == mine:
        return None
    return (
        f"job {pointer.job_id} was deployed with another spec than this instance's (which "
        f"would be job {mine}): this instance came from an earlier launch template"
    )
