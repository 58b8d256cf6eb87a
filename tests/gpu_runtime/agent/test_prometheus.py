"""A host's `GET /metrics`: the server over a `HostRuntime` (as the agent wires them), scraped
for real after base-model and adapter requests of a tenant's grant."""

from __future__ import annotations

import time
from pathlib import Path

import openai

from gpu_runtime.agent.serving import lora_runtime
from gpu_runtime.contract.storage import LocalStorage
from gpu_runtime.server import BearerKeys, ModelAccess, create_app
from gpu_runtime.server.prometheus import ServerMetrics
from tests.gpu_runtime.agent.conftest import Reports, make_runtime
from tests.gpu_runtime.agent.test_serving import _adapter_dir
from tests.gpu_runtime.server.serving import serve_in_thread
from tests.gpu_runtime.server.test_prometheus import scrape

ADAPTER = "ft:tiny:acme::ftjob-7"
TOKEN = "host-scrape-token"


def test_host_metrics_count_per_tenant_and_adapter_and_report_its_memory(
    tiny_model_dir: Path, storage: LocalStorage, tmp_path: Path, reports: Reports
) -> None:
    prometheus = ServerMetrics()
    host = make_runtime(tiny_model_dir, storage, tmp_path / "work", reports, prometheus=prometheus)
    lora = lora_runtime(host.runtime.engine)
    host.runtime.adapters.load_local(lora, ADAPTER, _adapter_dir(tiny_model_dir, tmp_path / "a"))
    host.loop.start()
    grants = {"k-acme": ModelAccess(frozenset({"tiny", ADAPTER}), tenant="acme")}
    app = create_app(host.loop, "tiny", BearerKeys(lambda key: grants.get(key or "")),
                     host.runtime.request_metrics, prometheus=prometheus,
                     metrics_token=TOKEN)  # fmt: skip
    try:
        with serve_in_thread(app) as url:
            client = openai.OpenAI(base_url=url, api_key="k-acme", max_retries=0, timeout=60)
            tokens: dict[str, int] = {}
            for model in ("tiny", ADAPTER, ADAPTER):
                chunks = client.completions.create(
                    model=model, prompt="Q: hello", max_tokens=5, temperature=0.0,
                    stream=True, stream_options={"include_usage": True},
                )  # fmt: skip
                usage = [c.usage for c in chunks if c.usage is not None][0]
                tokens[model] = tokens.get(model, 0) + usage.completion_tokens
            deadline = time.monotonic() + 30
            while True:  # the loop thread retakes the gauges every turn
                samples = scrape(url, TOKEN)
                running = samples["harli_host_requests_in_engine"][(("state", "running"),)]
                if running == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
    finally:
        host.stop()

    assert running == 0
    counted = samples["harli_host_requests_total"]
    assert counted == {
        (("adapter", ""), ("outcome", "length"), ("tenant", "acme")): 1.0,
        (("adapter", ADAPTER), ("outcome", "length"), ("tenant", "acme")): 2.0,
    }
    generated = samples["harli_host_completion_tokens_total"]
    assert generated[(("adapter", ""), ("tenant", "acme"))] == tokens["tiny"]
    assert generated[(("adapter", ADAPTER), ("tenant", "acme"))] == tokens[ADAPTER]
    assert samples["harli_host_ttft_seconds_count"][()] == 3
    assert samples["harli_host_tpot_seconds_count"][()] == 3
    assert samples["harli_host_iteration_seconds_count"][()] >= 5
    runtime = host.runtime
    kv = samples["harli_host_kv_memory_bytes"]
    assert kv[(("state", "total"),)] == 64 * runtime.kv_bytes_per_block  # make_runtime's blocks
    assert kv[(("state", "used"),)] == runtime.engine.block_manager.num_used_blocks * (
        runtime.kv_bytes_per_block
    )
    assert samples["harli_host_adapter_slots"][(("state", "total"),)] == 2
    assert samples["harli_host_finetune_memory_bytes"][()] == 0  # no job
    assert samples["harli_host_finetune_jobs"][()] == 0
    assert "harli_host_harvestable_finetune_tokens_per_second" in samples
    assert "harli_host_sm_share" not in samples or not samples["harli_host_sm_share"]  # CPU
