"""The S3 proxy forwards while up, resets every connection while down, and recovers."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from training.rehearsal.s3proxy import SwitchableProxy


class _Hello(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = b"hello " + self.path.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def upstream() -> Iterator[tuple[str, int]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    t.start()
    try:
        host, port = server.server_address[:2]
        yield str(host), int(port)
    finally:
        server.shutdown()
        server.server_close()
        t.join(timeout=5)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def test_outage_and_recovery(upstream: tuple[str, int]) -> None:
    with SwitchableProxy(upstream) as proxy:
        assert _get(proxy.url + "/a") == "hello /a"
        proxy.set_reachable(False)
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            _get(proxy.url + "/b")
        assert proxy.refused >= 1
        proxy.set_reachable(True)
        assert _get(proxy.url + "/c") == "hello /c"
