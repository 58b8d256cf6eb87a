"""Parts and their assembly stream through the live server: memory stays far below their size."""

from __future__ import annotations

import http.client
import json
import tracemalloc
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest

from api.models import File
from api.services.apikeys import api_key_issue_for_tenant
from api.services.tenants import tenant_create
from tests.api.conftest import CHAT_LINE, jsonl

MIB = 1 << 20
LINE = jsonl(CHAT_LINE)
BOUNDARY = "harli-test-boundary"


def repeated(line: bytes, count: int) -> Iterator[bytes]:
    batch = 256
    for start in range(0, count, batch):
        yield line * min(batch, count - start)


class Server:
    def __init__(self, url: str, key: str) -> None:
        self.address = urlparse(url)
        self.headers = {"Authorization": f"Bearer {key}"}

    def post(self, path: str, body: Any, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
        conn = http.client.HTTPConnection(self.address.netloc, timeout=60)
        try:
            conn.request("POST", path, body=body, headers={**self.headers, **headers})
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    def post_json(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return self.post(path, json.dumps(body).encode(), {"Content-Type": "application/json"})

    def post_part(self, upload_id: str, chunks: Iterator[bytes], size: int) -> dict[str, Any]:
        """Send a part's multipart body chunk by chunk (the client never holds it whole)."""
        head = (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="data"; filename="blob"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        tail = f"\r\n--{BOUNDARY}--\r\n".encode()

        def body() -> Iterator[bytes]:
            yield head
            yield from chunks
            yield tail

        status, answer = self.post(
            f"/v1/uploads/{upload_id}/parts",
            body(),
            {
                "Content-Type": f"multipart/form-data; boundary={BOUNDARY}",
                "Content-Length": str(len(head) + size + len(tail)),
            },
        )
        assert status == 200, answer
        return answer


def peak_bytes_during(call: Any) -> tuple[Any, int]:
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    result = call()
    return result, tracemalloc.get_traced_memory()[1] - before


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_parts_and_assembly_are_streamed(live_server: Any) -> None:
    key = api_key_issue_for_tenant(tenant=tenant_create(name="acme")).key
    server = Server(live_server.url, key)
    lines_per_part = (6 * MIB) // len(LINE)
    part_size = lines_per_part * len(LINE)
    status, upload = server.post_json(
        "/v1/uploads",
        {"filename": "big.jsonl", "purpose": "fine-tune", "bytes": 2 * part_size,
         "mime_type": "text/jsonl"},
    )  # fmt: skip
    assert status == 200, upload

    tracemalloc.start()
    try:
        part_ids = []
        for _ in range(2):
            part, peak = peak_bytes_during(
                lambda: server.post_part(upload["id"], repeated(LINE, lines_per_part), part_size)
            )
            assert peak < 2 * MIB, f"a {part_size}-byte part took {peak} bytes of memory"
            part_ids.append(part["id"])
        (status, completed), peak = peak_bytes_during(
            lambda: server.post_json(f"/v1/uploads/{upload['id']}/complete", {"part_ids": part_ids})
        )
    finally:
        tracemalloc.stop()
    assert status == 200, completed
    assert completed["file"]["bytes"] == 2 * part_size
    # Assembly copies 1 MiB chunks; validation reads 64 KiB chunks and one line at a time.
    assert peak < 4 * MIB, f"assembling {2 * part_size} bytes took {peak} bytes of memory"
    assert File.objects.get().line_count == 2 * lines_per_part
