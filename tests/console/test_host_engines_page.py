"""The console names each host's engine and what it can do: the hosts table's engine column,
the host page's engine (a vLLM host's server state and restarts) and capabilities. Filled the
way hosts fill it: heartbeats through the intake."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from api.services.fleet import base_model_register, deployment_create, host_register
from api.services.reports import host_report_apply
from api.services.tenants import operator_create
from gpu_runtime.contract.protocol import report

pytestmark = pytest.mark.django_db
GIB = 2**30


def _text(page: str, pattern: str) -> str:
    match = re.search(pattern, page, re.S)
    assert match is not None, f"nothing matches {pattern!r}"
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", match.group(1))).strip()


@pytest.fixture
def client(db: None) -> Client:
    operator_create(username="ops", password="pw-ops-1")
    tiny = base_model_register(name="tiny", preset="tiny")
    harli = deployment_create(name="chat", base_model=tiny, tpot_slo_ms=50, ttft_slo_ms=500)
    vllm = deployment_create(name="chat-vllm", base_model=tiny, tpot_slo_ms=50, ttft_slo_ms=500,
                             engine="vllm")  # fmt: skip
    host_register(name="h-harli", gpu_kind="H200", gpu_memory_bytes=141 * GIB, deployment=harli)
    host_register(name="h-vllm", gpu_kind="H200", gpu_memory_bytes=141 * GIB, deployment=vllm)
    host_register(name="h-new", gpu_kind="H200", gpu_memory_bytes=141 * GIB)
    common = {"base_model": "tiny", "total_bytes": 141 * GIB, "placements": []}
    assert host_report_apply(message=report("heartbeat", "h-harli", free_bytes=GIB, **common,
        engine="harli", capabilities={"colocation": True, "architectures": ["llama", "qwen2"],
                                      "max_loras": 8, "max_lora_rank": 64}))  # fmt: skip
    assert host_report_apply(message=report("heartbeat", "h-vllm", free_bytes=0, **common,
        engine="vllm", capabilities={"colocation": False, "architectures": ["LlamaForCausalLM"],
                                     "max_loras": 2, "max_lora_rank": 8},
        engine_state={"state": "ready", "restarts": 1}))  # fmt: skip
    browser = Client()
    assert browser.login(username="ops", password="pw-ops-1")
    return browser


def test_the_hosts_table_names_each_hosts_engine(client: Client) -> None:
    page = client.get("/console/hosts/").content.decode()
    row = r'<tr data-host="{}">.*?<td data-engine="[a-z]*">(.*?)</td>'
    assert _text(page, row.format("h-harli")) == "Harli serves · trains"
    assert _text(page, row.format("h-vllm")) == "vLLM serves only"
    assert _text(page, row.format("h-new")) == "—"


def test_the_host_page_shows_engine_state_and_capabilities(client: Client) -> None:
    page = client.get("/console/hosts/h-vllm/").content.decode()
    engine = _text(page, r'<tr id="host-engine">(.*?)</tr>')
    assert engine == "Engine vLLM serves only · server ready, 1 restart"
    caps = _text(page, r'<tr id="host-capabilities">(.*?)</tr>')
    assert caps == (
        "Capabilities trains nothing (no finetune job is placed here) · architectures "
        "LlamaForCausalLM · adapters 2 in GPU slots, rank ≤ 8"
    )
    harli = client.get("/console/hosts/h-harli/").content.decode()
    assert _text(harli, r'<tr id="host-engine">(.*?)</tr>') == "Engine Harli serves · trains"
    assert "co-locates finetuning with decode · architectures llama, qwen2 · adapters 8" in (
        _text(harli, r'<tr id="host-capabilities">(.*?)</tr>')
    )
    fresh = client.get("/console/hosts/h-new/").content.decode()
    assert _text(fresh, r'<tr id="host-capabilities">(.*?)</tr>') == "Capabilities no heartbeat yet"
