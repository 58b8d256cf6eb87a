"""The heartbeat's engine, capabilities and engine state: their shape and their defaults."""

from __future__ import annotations

from typing import Any

import pytest

from gpu_runtime.contract.host_capabilities import reported_capabilities
from gpu_runtime.contract.protocol import ProtocolError, check_report, report

BASE = {"free_bytes": 0, "total_bytes": 1, "placements": []}


def _heartbeat(**fields: Any) -> dict[str, Any]:
    return report("heartbeat", "h1", **BASE, **fields)


def test_an_old_heartbeat_reads_as_a_harli_host_that_colocates() -> None:
    assert reported_capabilities(check_report(_heartbeat())) == {
        "engine": "harli",
        "colocation": True,
        "architectures": ["llama", "qwen2"],
        "max_loras": None,
        "max_lora_rank": None,
    }


def test_a_vllm_heartbeat_defaults_to_no_colocation_and_keeps_what_it_reports() -> None:
    caps = {"architectures": ["MistralForCausalLM"], "max_loras": 4, "max_lora_rank": 16}
    message = check_report(
        _heartbeat(engine="vllm", capabilities=caps, engine_state={"state": "ready", "restarts": 2})
    )
    assert reported_capabilities(message) == {"engine": "vllm", "colocation": False, **caps}


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"engine": "tgi"}, "engine must be one of"),
        ({"capabilities": []}, "capabilities must be an object"),
        ({"capabilities": {"colocation": "yes"}}, "colocation must be true or false"),
        ({"capabilities": {"architectures": "llama"}}, "architectures must be a list"),
        ({"capabilities": {"architectures": [""]}}, "architectures must be a list"),
        ({"capabilities": {"max_loras": -1}}, "max_loras must be a non-negative"),
        ({"capabilities": {"max_lora_rank": True}}, "max_lora_rank must be a non-negative"),
        ({"engine_state": "ready"}, "engine_state must be"),
        ({"engine_state": {"state": "ready", "restarts": "1"}}, "restarts must be"),
    ],
)
def test_malformed_fields_make_the_heartbeat_malformed(fields: dict[str, Any], error: str) -> None:
    with pytest.raises(ProtocolError, match=error):
        check_report(_heartbeat(**fields))
