"""A loopback TCP proxy in front of moto that can be switched off: the S3 outage.

The instances reach S3 through it (``AWS_ENDPOINT_URL_S3``); EC2 and Auto Scaling go to moto
directly, so an outage cuts off S3 only. While it is down, every open connection is reset and
every new one is reset as soon as it is accepted (the SDK sees connection errors, retries, then
fails), as an unreachable endpoint would behave.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import struct
import threading

log = logging.getLogger(__name__)

_CHUNK = 1 << 16
_MAX_CONNECTIONS = 256


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), not FIN: the peer sees 'connection reset'."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class SwitchableProxy:
    """Forwards 127.0.0.1:``port`` to ``upstream``; ``set_reachable(False)`` cuts it off."""

    def __init__(self, upstream: tuple[str, int], host: str = "127.0.0.1", port: int = 0) -> None:
        self.upstream = upstream
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(0.2)
        self._lock = threading.Lock()
        self._reachable = True
        self._pairs: set[tuple[socket.socket, socket.socket]] = set()
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self.connections = 0
        """Connections forwarded."""
        self.refused = 0
        """Connections reset at once because S3 was down."""

    @property
    def url(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"http://{host}:{port}"

    @property
    def reachable(self) -> bool:
        return self._reachable

    def start(self) -> SwitchableProxy:
        t = threading.Thread(target=self._accept_loop, name="s3-proxy", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stopped.set()
        for t in self._threads:
            t.join(timeout=5)
        self._close_all()
        with contextlib.suppress(OSError):
            self._listener.close()

    def __enter__(self) -> SwitchableProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def set_reachable(self, reachable: bool) -> None:
        """False: reset every open connection and every new one until set back to True."""
        with self._lock:
            self._reachable = reachable
        if not reachable:
            self._close_all()

    def _close_all(self) -> None:
        with self._lock:
            pairs = list(self._pairs)
            self._pairs.clear()
        for a, b in pairs:
            _reset(a)
            _reset(b)

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                down = not self._reachable or len(self._pairs) >= _MAX_CONNECTIONS
            if down:
                self.refused += 1
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError as e:
                log.warning("S3 proxy: upstream %s:%d unreachable: %s", *self.upstream, e)
                _reset(client)
                continue
            self.connections += 1
            pair = (client, upstream)
            with self._lock:
                self._pairs.add(pair)
            t = threading.Thread(target=self._pump, args=(pair,), name="s3-proxy-pump", daemon=True)
            t.start()
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _pump(self, pair: tuple[socket.socket, socket.socket]) -> None:
        a, b = pair
        peer = {a: b, b: a}
        sel = selectors.DefaultSelector()
        try:
            for s in (a, b):
                s.setblocking(False)
                sel.register(s, selectors.EVENT_READ)
            while not self._stopped.is_set():
                with self._lock:
                    if pair not in self._pairs:
                        return  # reset by set_reachable(False)
                for key, _ in sel.select(timeout=0.2):
                    src: socket.socket = key.fileobj  # type: ignore[assignment]
                    data = src.recv(_CHUNK)
                    if not data:
                        return
                    peer[src].settimeout(10.0)  # bounded: a peer that stops reading
                    peer[src].sendall(data)
                    peer[src].setblocking(False)
        except (OSError, ValueError):  # ValueError: a socket closed by set_reachable(False)
            return
        finally:
            sel.close()
            with self._lock:
                self._pairs.discard(pair)
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()
