"""Under the ASGI app an upload too large for its route is refused from its headers, before a
byte of its body is read (Django's ASGI handler reads a whole body before its middleware)."""

from __future__ import annotations

import socket
import time

import pytest
from django.core.asgi import get_asgi_application

from api.gateway.asgi import with_gateway
from gpu_runtime.server.threaded import ThreadedServer

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_oversize_upload_is_refused_before_its_body_is_sent() -> None:
    server = ThreadedServer(with_gateway(get_asgi_application()))
    server.start()
    try:
        with socket.create_connection((server.host, server.port), timeout=5) as sock:
            sock.sendall(
                b"POST /v1/files HTTP/1.1\r\nhost: x\r\nauthorization: Bearer hk-x\r\n"
                b"content-type: multipart/form-data; boundary=b\r\n"
                b"content-length: 10000000000\r\n\r\n--b\r\n"
            )  # 10 GB declared, a few bytes sent: an answer now means nothing was waited for
            started = time.monotonic()
            head = sock.recv(65536).decode("latin-1")
        assert head.startswith("HTTP/1.1 413"), head[:200]
        assert '"code": "file_too_large"' in head
        assert time.monotonic() - started < 5
    finally:
        server.stop()


@pytest.mark.parametrize(
    "request_line", [b"POST /v1/fine_tuning/jobs", b"PATCH /api/ops/tenants/acme"]
)
def test_an_oversize_json_body_is_refused_before_it_is_sent(request_line: bytes) -> None:
    server = ThreadedServer(with_gateway(get_asgi_application()))
    server.start()
    try:
        with socket.create_connection((server.host, server.port), timeout=5) as sock:
            sock.sendall(
                request_line + b" HTTP/1.1\r\nhost: x\r\nauthorization: Bearer hk-x\r\n"
                b"content-type: application/json\r\n"
                b"content-length: 10000000000\r\n\r\n{"
            )
            started = time.monotonic()
            head = sock.recv(65536).decode("latin-1")
        assert head.startswith("HTTP/1.1 413"), head[:200]
        assert '"code": "request_too_large"' in head
        assert time.monotonic() - started < 5
    finally:
        server.stop()
