"""A small IMDSv2 client: one session token (PUT), then GETs that carry it.

Only what the launcher needs: instance tags, identity facts and the Spot notices. Every call has a
short timeout, so a machine that is not on EC2 answers within a second or two.
"""

from __future__ import annotations

import logging
import time
import urllib.error
import urllib.request
from collections.abc import Mapping

log = logging.getLogger(__name__)

DEFAULT_IMDS_URL = "http://169.254.169.254"
ENV_IMDS_ENDPOINT = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
"""The variable boto3 and the AWS CLI read for the IMDS endpoint (botocore's
``ec2_metadata_service_endpoint`` setting)."""
TOKEN_PATH = "/latest/api/token"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
TOKEN_TTL_S = 21600
# Refresh the token this long before IMDS would expire it.
_TOKEN_MARGIN_S = 60.0


def endpoint_from_env(environ: Mapping[str, str]) -> str:
    """The IMDS endpoint as boto3 resolves it: ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` when set
    (e.g. ``http://127.0.0.1:8080``), else the IPv4 link-local address."""
    return environ.get(ENV_IMDS_ENDPOINT, "").strip() or DEFAULT_IMDS_URL


class ImdsError(RuntimeError):
    """IMDS could not be reached or refused the request (not a plain 'not found')."""


class ImdsClient:
    """IMDSv2 client bound to one endpoint; caches its session token until shortly before expiry.

    Not shared between threads: each user (group detection, the Spot watcher) makes its own.
    """

    def __init__(self, base_url: str = DEFAULT_IMDS_URL, timeout_s: float = 1.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._token: str | None = None
        self._token_expires = 0.0

    def token(self) -> str:
        """A valid session token, fetched with ``PUT /latest/api/token`` when needed."""
        if self._token is not None and time.monotonic() < self._token_expires:
            return self._token
        req = urllib.request.Request(
            self.base_url + TOKEN_PATH,
            method="PUT",
            headers={TOKEN_TTL_HEADER: str(TOKEN_TTL_S)},
        )
        body = self._send(req)
        self._token = body
        self._token_expires = time.monotonic() + TOKEN_TTL_S - _TOKEN_MARGIN_S
        return body

    def get(self, path: str) -> str | None:
        """The text at ``/latest/meta-data/...`` path ``path``; None when IMDS answers 404.

        A 401 (token expired or revoked) refreshes the token once and retries.
        Raises ``ImdsError`` when IMDS is unreachable or answers with another error.
        """
        url = self.base_url + "/" + path.lstrip("/")
        for attempt in range(2):
            req = urllib.request.Request(url, headers={TOKEN_HEADER: self.token()})
            try:
                return self._send(req)
            except _HttpStatus as e:
                if e.code == 404:
                    return None
                if e.code == 401 and attempt == 0:
                    self._token = None
                    continue
                raise ImdsError(f"GET {url} answered HTTP {e.code}") from e
        raise AssertionError("unreachable")  # pragma: no cover

    def _send(self, req: urllib.request.Request) -> str:
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return str(resp.read().decode())
        except urllib.error.HTTPError as e:
            if req.get_method() == "GET":
                raise _HttpStatus(e.code) from e
            raise ImdsError(f"{req.get_method()} {req.full_url} answered HTTP {e.code}") from e
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            reason = getattr(e, "reason", e)
            raise ImdsError(f"{req.full_url} is unreachable ({reason})") from e


class _HttpStatus(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code
