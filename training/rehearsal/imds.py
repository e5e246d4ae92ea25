"""An IMDSv2 endpoint for one emulated EC2 instance, on 127.0.0.1.

It answers what the launcher and the SDKs ask an instance's metadata service, in AWS's formats:

- ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds: 1..21600`` returns a
  session token; every GET must carry it in ``X-aws-ec2-metadata-token`` (401 otherwise).
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html
- ``/latest/meta-data/instance-id``, ``local-ipv4``, ``placement/region``,
  ``placement/availability-zone``; a folder path lists its entries, one a line.
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/instancedata-data-retrieval.html
- ``/latest/meta-data/tags/instance`` lists the tag keys, ``tags/instance/<key>`` is a value
  (instance metadata tags enabled in the launch template).
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/work-with-tags-in-IMDS.html
- ``spot/instance-action``: 404 until an interruption is announced, then
  ``{"action": "terminate", "time": "2017-09-18T08:22:00Z"}`` (the time the instance goes).
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html
- ``events/recommendations/rebalance``: 404 until a recommendation, then
  ``{"noticeTime": "2020-11-05T08:22:00Z"}``.
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/rebalance-recommendations.html
- ``autoscaling/target-lifecycle-state``: ``InService``, later ``Terminated``.
  https://docs.aws.amazon.com/autoscaling/ec2/userguide/retrieving-target-lifecycle-state-through-imds.html

The setters are thread-safe: the fault injector changes an instance's metadata while its
launcher polls it.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

TOKEN_PATH = "/latest/api/token"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
MAX_TTL_S = 21600
META = "/latest/meta-data"
INSTANCE_ACTION = f"{META}/spot/instance-action"
REBALANCE = f"{META}/events/recommendations/rebalance"
TARGET_LIFECYCLE_STATE = f"{META}/autoscaling/target-lifecycle-state"


def iso_utc(when: float) -> str:
    """``2017-09-18T08:22:00Z``: the format of the notices' times (seconds, UTC)."""
    return datetime.fromtimestamp(when, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ImdsEmulator:
    """IMDSv2 of one instance: ``start()`` binds 127.0.0.1 on a free port (``url``)."""

    def __init__(
        self,
        *,
        instance_id: str,
        local_ipv4: str,
        region: str,
        availability_zone: str | None = None,
        tags: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.instance_id = instance_id
        self._lock = threading.Lock()
        self._tokens: dict[str, float] = {}
        self._values: dict[str, str] = {
            "instance-id": instance_id,
            "local-ipv4": local_ipv4,
            "placement/region": region,
            "placement/availability-zone": availability_zone or f"{region}a",
            "autoscaling/target-lifecycle-state": "InService",
        }
        self._values |= {f"tags/instance/{key}": value for key, value in (tags or {}).items()}
        self.requests = 0
        self._server = ThreadingHTTPServer((host, port), self._handler_class())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> ImdsEmulator:
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name=f"imds-{self.instance_id}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> ImdsEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what the fault injector changes -----------------------------------------------------

    def set_spot_interruption(self, at: float, action: str = "terminate") -> str:
        """Announce a Spot interruption: ``action`` at wall time ``at``; returns the body."""
        body = json.dumps({"action": action, "time": iso_utc(at)})
        self._set("spot/instance-action", body)
        return body

    def set_rebalance_recommendation(self, at: float | None = None) -> str:
        """Publish a rebalance recommendation noticed at ``at`` (default now)."""
        body = json.dumps({"noticeTime": iso_utc(time.time() if at is None else at)})
        self._set("events/recommendations/rebalance", body)
        return body

    def set_target_lifecycle_state(self, state: str) -> None:
        """``InService``, ``Terminated``, ... as Auto Scaling would set it."""
        self._set("autoscaling/target-lifecycle-state", state)

    def value(self, path: str) -> str | None:
        """The body at ``/latest/meta-data/<path>`` now (None: 404)."""
        with self._lock:
            return self._values.get(path.strip("/"))

    def _set(self, key: str, value: str) -> None:
        with self._lock:
            self._values[key] = value

    # -- HTTP --------------------------------------------------------------------------------

    def _new_token(self, ttl_s: int) -> str:
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._tokens[token] = time.monotonic() + ttl_s
        return token

    def _token_valid(self, token: str | None) -> bool:
        if not token:
            return False
        with self._lock:
            expires = self._tokens.get(token)
        return expires is not None and time.monotonic() < expires

    def _lookup(self, path: str) -> str | None:
        """The body for a GET of ``path`` (a value, or a folder's listing), or None."""
        if path != META and not path.startswith(META + "/"):
            return None
        key = path[len(META) :].strip("/")
        with self._lock:
            if key in self._values:
                return self._values[key]
            prefix = f"{key}/" if key else ""
            entries = sorted(
                {
                    k[len(prefix) :].split("/", 1)[0] + ("/" if "/" in k[len(prefix) :] else "")
                    for k in self._values
                    if k.startswith(prefix)
                }
            )
        if not entries:
            return None
        if key == "tags/instance":
            return "\n".join(e.rstrip("/") for e in entries)
        return "\n".join(entries)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        imds = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "EC2ws"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _reply(self, code: int, body: str = "", headers: Mapping[str, str] = {}) -> None:
                data = body.encode()
                self.send_response(code)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:
                imds.requests += 1
                if self.path.rstrip("/") != TOKEN_PATH:
                    self._reply(404)
                    return
                raw = self.headers.get(TTL_HEADER)
                try:
                    ttl = int(raw) if raw is not None else 0
                except ValueError:
                    ttl = 0
                if not 1 <= ttl <= MAX_TTL_S:
                    self._reply(400, f"{TTL_HEADER} must be 1..{MAX_TTL_S}")
                    return
                self._reply(200, imds._new_token(ttl), {TTL_HEADER: str(ttl)})

            def do_GET(self) -> None:
                imds.requests += 1
                if not imds._token_valid(self.headers.get(TOKEN_HEADER)):
                    self._reply(401)
                    return
                path = self.path.split("?", 1)[0]
                body = imds._lookup(path.rstrip("/") or "/")
                if body is None:
                    self._reply(404)
                else:
                    self._reply(200, body)

        return Handler
