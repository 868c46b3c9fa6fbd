"""The server's connections: requests that never finish are cut at their deadlines, --timeout counts from the first
byte, hundreds of idle connections leave it answering, and asyncio's accept error is not logged on every try."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.serve.servers import KEY, LONG, Served, long_base_bundle, slow_server


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    yield from slow_server(long_base_bundle(tmp_path_factory), tmp_path_factory)


def raw_request(port: int, data: bytes) -> socket.socket:
    """A connection that has sent ``data`` (part of a request) and waits."""
    raw = socket.create_connection(("127.0.0.1", port))
    raw.sendall(data)
    return raw


def closed_within(raw: socket.socket, seconds: float) -> tuple[bytes, float]:
    """What the server sent before closing ``raw`` and when it closed (seconds from now); fails past ``seconds``."""
    started, got = time.monotonic(), b""
    raw.settimeout(seconds)
    try:
        while chunk := raw.recv(65536):
            got += chunk
    except TimeoutError:
        pytest.fail(f"the server kept the connection open over {seconds} s (it sent {got[:200]!r})")
    except ConnectionResetError:
        pass
    raw.close()
    return got, time.monotonic() - started


def test_requests_that_never_arrive_are_cut_at_their_deadlines(slow):
    """--timeout 3: a connection that sends nothing, one whose headers never end, one whose body never ends: each is
    closed within the deadline (the last two told why: 408), and the server answers on."""
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n".encode()
    silent = raw_request(slow.port, b"")
    half_header = raw_request(slow.port, head)
    half_body = raw_request(slow.port, head + b"Content-Length: 1000\r\n\r\n" + b'{"model": "x", "prompt"')
    for raw, answer in ((silent, b""), (half_header, b"408"), (half_body, b"408")):
        got, seconds = closed_within(raw, 6)
        assert answer in got[:12] and seconds < 4.5, (got[:300], seconds)
    assert b"body did not arrive" in got
    r = slow.post("/v1/completions", {"model": slow.model, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_the_timeout_counts_from_the_first_byte(slow):
    """Headers sent slowly over 2 s, then a request that would generate for long: the 504 comes 3 s (--timeout) after
    the request's first byte, not 3 s after its headers."""
    body = json.dumps({"model": slow.model, "prompt": "The quick brown fox", "max_tokens": LONG, "temperature": 0})
    raw = raw_request(slow.port, b"POST /v1/completions HTTP/1.1\r\n")
    started = time.monotonic()
    time.sleep(2)
    raw.sendall(f"Host: x\r\nAuthorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
    raw.settimeout(10)
    got = raw.recv(65536)
    seconds = time.monotonic() - started
    raw.close()
    assert got.startswith(b"HTTP/1.1 504") and seconds < 4.5, (got[:200], seconds)
    slow.wait_idle()


def test_hundreds_of_idle_connections_leave_the_server_answering(tiny_bundle, tmp_path):
    """A server started with 160 open files (hard limit 320) raises the limit to 320 and keeps its connections below
    it: 600 idle connections never exhaust the descriptors (the oldest waiting ones give way), /health answers
    throughout, and asyncio's accept error is not logged at all."""
    log = tmp_path / "idle.log"
    server = Served(Path(tiny_bundle), log, "--method", "plain", files=(160, 320))
    idle = []
    try:
        limits = Path(f"/proc/{server.proc.pid}/limits").read_text()
        assert re.search(r"Max open files\s+320\s+320", limits), limits
        process = psutil.Process(server.proc.pid)
        assert "Connections: at most " in log.read_text() and "open-files limit leaves fewer" in log.read_text()
        for i in range(600):
            idle.append(raw_request(server.port, b"" if i % 2 else b"GET /health HTTP/1.1\r\n"))
            if i % 100 == 99:
                assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        assert process.num_fds() < 320 - 32, process.num_fds()
        assert (
            server.post("/v1/completions", {"model": server.model, "prompt": "Hi", "max_tokens": 2}).status_code == 200
        )
    finally:
        for raw in idle:
            raw.close()
        server.stop()
    assert "out of system resource" not in log.read_text()


def test_accept_errors_are_logged_once_a_minute():
    """Should accept still run out of descriptors (another process's share, say), asyncio's error on every try is
    let through once a minute, other records always."""
    import logging

    from specdec_edge.serve.connections import OncePerMinute

    quiet = OncePerMinute()
    record = lambda msg: logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, None)  # noqa: E731
    passed = [quiet.filter(record("socket.accept() out of system resource")) for _ in range(1000)]
    assert passed.count(True) == 1 and all(quiet.filter(record("another error")) for _ in range(3))
