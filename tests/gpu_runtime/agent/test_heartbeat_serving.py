"""The heartbeat's `serving` figures on a tiny host driven by hand (64 KV blocks of 16 tokens,
8 sequences, 2 adapter slots): exact scheduler counts, KV blocks and adapter slots after each
step, and the window's TPOT once decode iterations ran."""

from __future__ import annotations

import time
from pathlib import Path

from gpu_runtime.agent.runtime import HostRuntime
from gpu_runtime.agent.serving import lora_runtime
from gpu_runtime.contract.protocol import check_report, report
from gpu_runtime.contract.storage import LocalStorage
from gpu_runtime.engine import SamplingParams
from tests.gpu_runtime.agent.conftest import Reports, make_runtime
from tests.gpu_runtime.agent.host_server import random_adapter

ADAPTER = "ft:tiny:acme::ftjob-3"
FIVE = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
PROMPT = list(range(5, 25))  # 20 tokens: 2 blocks of 16
IDLE = {
    "running": 0,
    "waiting": 0,
    "kv_free_pages": 64,
    "kv_total_pages": 64,
    "adapter_slots_used": 0,
    "adapter_slots_total": 2,
    "resident_adapters": [],
    "tpot_p50_ms": None,
    "slo_attainment": None,
}


def _serving(runtime: HostRuntime) -> dict[str, object]:
    runtime.after_turn()  # takes the snapshot, as every turn of the loop thread does
    return dict(runtime.status().heartbeat_fields()["serving"])


def test_counts_and_kv_blocks_follow_the_scheduler(
    tiny_model_dir: Path, storage: LocalStorage, tmp_path: Path, reports: Reports
) -> None:
    runtime = make_runtime(tiny_model_dir, storage, tmp_path / "work", reports).runtime
    assert _serving(runtime) == IDLE
    for i in range(10):
        runtime.add_request(PROMPT, FIVE, f"r{i}", None)
    assert _serving(runtime) == IDLE | {"waiting": 10}
    started = time.perf_counter()
    runtime.step()  # 8 admitted (max_num_seqs), each prompt prefilled into 2 blocks
    assert _serving(runtime) == IDLE | {"running": 8, "waiting": 2, "kv_free_pages": 48}
    for _ in range(4):  # tokens 2 to 5: decode iterations, each timing its 8 tokens
        runtime.step()
    elapsed_ms = (time.perf_counter() - started) * 1e3
    serving = _serving(runtime)
    tpot = serving["tpot_p50_ms"]
    assert isinstance(tpot, float) and 0 < tpot < elapsed_ms
    # the 8 finished; every decode iteration was within the host's SLO (1e6 ms)
    assert serving == IDLE | {"waiting": 2, "tpot_p50_ms": tpot, "slo_attainment": 1.0}
    runtime.step()  # the other 2 admitted
    serving = _serving(runtime)
    assert serving["running"] == 2 and serving["waiting"] == 0
    # both start on the prompt's first block from the prefix cache (one block shared, ref count
    # 2) and take one block each for the rest: 3 used (4 without prefix caching)
    assert serving["kv_free_pages"] == 61


def test_adapter_slots_and_resident_adapters(
    tiny_model_dir: Path, storage: LocalStorage, tmp_path: Path, reports: Reports
) -> None:
    runtime = make_runtime(tiny_model_dir, storage, tmp_path / "work", reports).runtime
    lora = lora_runtime(runtime.engine)
    adapter = random_adapter(tiny_model_dir, tmp_path / "adapter", seed=1)
    runtime.adapters.load_local(lora, ADAPTER, adapter)
    assert _serving(runtime)["resident_adapters"] == []  # registered, not in a GPU slot yet
    runtime.add_request(PROMPT, FIVE, "tuned", ADAPTER)
    runtime.add_request(PROMPT, FIVE, "base", None)
    runtime.step()
    serving = _serving(runtime)
    assert (serving["running"], serving["kv_free_pages"]) == (2, 60)
    assert (serving["adapter_slots_used"], serving["adapter_slots_total"]) == (1, 2)
    assert serving["resident_adapters"] == [ADAPTER]
    while runtime.has_work():
        runtime.step()
    serving = _serving(runtime)
    assert serving["adapter_slots_used"] == 0  # no request holds it now
    assert serving["resident_adapters"] == [ADAPTER]  # still in its slot: no load next time
    runtime.add_request(PROMPT, FIVE, "again", ADAPTER)
    runtime.step()
    runtime.command({"command": "unload_adapter", "command_id": "u", "name": ADAPTER})
    serving = _serving(runtime)
    assert serving["resident_adapters"] == []  # takes no new request
    assert serving["adapter_slots_used"] == 1  # while "again" finishes with it
    while runtime.has_work():
        runtime.step()
    assert _serving(runtime) | {"tpot_p50_ms": None, "slo_attainment": None} == IDLE


def test_a_harli_host_reports_that_it_colocates_and_its_adapter_limits(
    tiny_model_dir: Path, storage: LocalStorage, tmp_path: Path, reports: Reports
) -> None:
    runtime = make_runtime(tiny_model_dir, storage, tmp_path / "work", reports).runtime
    fields = runtime.status().heartbeat_fields()
    check_report(report("heartbeat", "h1", server_url="http://h1/v1", **fields))
    weights = lora_runtime(runtime.engine).weights
    assert fields["engine"] == "harli" and "engine_state" not in fields
    assert fields["capabilities"] == {
        "colocation": True,
        "architectures": ["llama", "qwen2"],
        "max_loras": weights.num_slots,
        "max_lora_rank": weights.max_rank,
    }
