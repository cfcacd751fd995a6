"""What the tests that start other processes share: a free loopback port, and waiting for a
started server to answer its health check (failing at once if a process it needs has exited)."""
from __future__ import annotations

import socket
import time


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(port: int, procs: list, what: str, limit_s: float = 180) -> dict:
    """GET /health of the server on `port` until it answers (its JSON); asserts that every
    process in `procs` is still running meanwhile (their output in the failure) and that it
    answers within limit_s."""
    import httpx
    deadline = time.monotonic() + limit_s
    while True:
        assert all(p.poll() is None for p in procs), [p.communicate()[0].decode()[-2000:] for p in procs]
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
        except httpx.TransportError:
            assert time.monotonic() < deadline, f"{what} did not come up"
            time.sleep(0.5)
