"""What a host can do, as its heartbeat says: the host-level fields `engine`, `capabilities`
and `engine_state` (all optional).

* `engine`: "harli" (Harli's own engine: serves and co-locates finetuning) or "vllm" (a vLLM
  OpenAI server the agent supervises: serves base models and adapters, trains nothing).
* `capabilities`: `{"colocation": bool (finetune jobs can be placed on it), "architectures":
  [names the host serves; empty: whatever its engine loads], "max_loras": int,
  "max_lora_rank": int}`.
* `engine_state`: `{"state": str, "restarts": int}`, the supervised server's state (vLLM hosts).

A heartbeat without them (an older agent) reads as a Harli host that co-locates
(:func:`reported_capabilities`). A present field of the wrong shape makes the heartbeat
malformed (:func:`check_capability_fields`).
"""

from __future__ import annotations

from typing import Any

from gpu_runtime.contract.model_config import ARCHITECTURES

ENGINES = ("harli", "vllm")
HARLI_ARCHITECTURES = ARCHITECTURES
"""The architectures Harli's engine implements (`gpu_runtime.contract.model_config`)."""


class CapabilityReportError(ValueError):
    """An `engine`, `capabilities` or `engine_state` field that breaks the module's shape."""


def _count(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CapabilityReportError(f"{name} must be a non-negative integer, got {value!r:.80}")
    return value


def check_capability_fields(message: dict[str, Any]) -> None:
    """Raise CapabilityReportError when a present field breaks the module's shape."""
    if "engine" in message and message["engine"] not in ENGINES:
        raise CapabilityReportError(
            f"engine must be one of {ENGINES}, got {message['engine']!r:.80}"
        )
    caps = message.get("capabilities")
    if caps is not None:
        if not isinstance(caps, dict):
            raise CapabilityReportError("capabilities must be an object")
        if "colocation" in caps and not isinstance(caps["colocation"], bool):
            raise CapabilityReportError("capabilities.colocation must be true or false")
        archs = caps.get("architectures", [])
        if not isinstance(archs, list) or not all(isinstance(a, str) and a for a in archs):
            raise CapabilityReportError("capabilities.architectures must be a list of names")
        for name in ("max_loras", "max_lora_rank"):
            if name in caps:
                _count(caps[name], f"capabilities.{name}")
    state = message.get("engine_state")
    if state is not None:
        if not isinstance(state, dict) or not isinstance(state.get("state", ""), str):
            raise CapabilityReportError("engine_state must be {state, restarts}")
        if "restarts" in state:
            _count(state["restarts"], "engine_state.restarts")


def reported_capabilities(message: dict[str, Any]) -> dict[str, Any]:
    """The heartbeat's engine and capabilities with the defaults filled in: `{"engine",
    "colocation", "architectures", "max_loras", "max_lora_rank"}` (LoRA limits None when not
    reported). Call on a checked message."""
    engine = str(message.get("engine") or "harli")
    caps = message.get("capabilities") or {}
    default_archs = list(HARLI_ARCHITECTURES) if engine == "harli" else []
    return {
        "engine": engine,
        "colocation": bool(caps.get("colocation", engine == "harli")),
        "architectures": [str(a) for a in caps.get("architectures", default_archs)],
        "max_loras": caps.get("max_loras"),
        "max_lora_rank": caps.get("max_lora_rank"),
    }
