"""The IMDSv2 emulator: a token is required, identity and tag paths answer, notices appear."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from training.launcher.imds import ImdsClient
from training.rehearsal.imds import TOKEN_HEADER, TTL_HEADER, ImdsEmulator, iso_utc


@pytest.fixture
def imds() -> Iterator[ImdsEmulator]:
    with ImdsEmulator(
        instance_id="i-0123456789abcdef0",
        local_ipv4="127.0.1.4",
        region="us-east-1",
        tags={"hetero:group": "trainer", "hetero:cluster": "demo"},
    ) as server:
        yield server


def _call(url: str, method: str = "GET", headers: dict[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def _token(imds: ImdsEmulator) -> str:
    code, token = _call(imds.url + "/latest/api/token", "PUT", {TTL_HEADER: "60"})
    assert code == 200 and token
    return token


def test_get_without_a_token_is_401(imds: ImdsEmulator) -> None:
    assert _call(imds.url + "/latest/meta-data/instance-id")[0] == 401
    assert (
        _call(imds.url + "/latest/meta-data/instance-id", headers={TOKEN_HEADER: "forged"})[0]
        == 401
    )


def test_token_needs_a_valid_ttl(imds: ImdsEmulator) -> None:
    assert _call(imds.url + "/latest/api/token", "PUT")[0] == 400
    assert _call(imds.url + "/latest/api/token", "PUT", {TTL_HEADER: "0"})[0] == 400
    assert _call(imds.url + "/latest/api/token", "PUT", {TTL_HEADER: "21601"})[0] == 400
    assert _call(imds.url + "/latest/api/token", "GET")[0] == 401  # not a PUT: a plain GET


def test_identity_and_tag_paths(imds: ImdsEmulator) -> None:
    h = {TOKEN_HEADER: _token(imds)}
    base = imds.url + "/latest/meta-data/"
    assert _call(base + "instance-id", headers=h) == (200, "i-0123456789abcdef0")
    assert _call(base + "local-ipv4", headers=h) == (200, "127.0.1.4")
    assert _call(base + "placement/region", headers=h) == (200, "us-east-1")
    assert _call(base + "placement/availability-zone", headers=h) == (200, "us-east-1a")
    assert _call(base + "tags/instance", headers=h) == (200, "hetero:cluster\nhetero:group")
    assert _call(base + "tags/instance/hetero:group", headers=h) == (200, "trainer")
    assert _call(base + "tags/instance/hetero:cluster", headers=h) == (200, "demo")
    assert _call(base + "tags/instance/nope", headers=h)[0] == 404
    assert _call(base + "autoscaling/target-lifecycle-state", headers=h) == (200, "InService")
    code, listing = _call(base, headers=h)
    assert code == 200 and "instance-id" in listing.split("\n") and "placement/" in listing


def test_notices_appear_when_set(imds: ImdsEmulator) -> None:
    h = {TOKEN_HEADER: _token(imds)}
    base = imds.url + "/latest/meta-data/"
    assert _call(base + "spot/instance-action", headers=h)[0] == 404
    assert _call(base + "events/recommendations/rebalance", headers=h)[0] == 404

    imds.set_spot_interruption(1_700_000_000.0)
    code, body = _call(base + "spot/instance-action", headers=h)
    assert code == 200
    assert json.loads(body) == {"action": "terminate", "time": "2023-11-14T22:13:20Z"}

    imds.set_rebalance_recommendation(1_700_000_000.0)
    code, body = _call(base + "events/recommendations/rebalance", headers=h)
    assert (code, json.loads(body)) == (200, {"noticeTime": iso_utc(1_700_000_000.0)})

    imds.set_target_lifecycle_state("Terminated")
    assert _call(base + "autoscaling/target-lifecycle-state", headers=h) == (200, "Terminated")


def test_the_launchers_own_client_reads_it(imds: ImdsEmulator) -> None:
    client = ImdsClient(imds.url, timeout_s=2.0)
    assert client.get("/latest/meta-data/tags/instance/hetero:group") == "trainer"
    assert client.get("/latest/meta-data/spot/instance-action") is None
    imds.set_spot_interruption(1_700_000_000.0)
    body = client.get("/latest/meta-data/spot/instance-action")
    assert body is not None and json.loads(body)["action"] == "terminate"
