"""The agent's calls to its vLLM server (loopback, bearing the key only the agent knows):
the Prometheus scrape and the runtime LoRA API."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

SCRAPE_TIMEOUT_S = 5.0


class VllmApiError(RuntimeError):
    """vLLM refused a call; the message holds its status and answer."""


class VllmClient:
    """`url`: vLLM's root (no `/v1`)."""

    def __init__(self, url: str, api_key: str, timeout_s: float = 30.0) -> None:
        self.url = url
        self._api_key = api_key
        self.timeout_s = timeout_s

    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> str:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self._api_key}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as answer:
                return str(answer.read().decode("utf-8", errors="replace"))
        except urllib.error.HTTPError as exc:
            text = exc.read().decode("utf-8", errors="replace")[:1000]
            raise VllmApiError(f"{method} {path}: {exc.code} {text}") from None

    def metrics_text(self) -> str:
        """The Prometheus scrape (5 s at most: heartbeats wait for it)."""
        return self._call("GET", "/metrics", timeout_s=SCRAPE_TIMEOUT_S)

    def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT directory `path` as `name` (vLLM's `/v1/load_lora_adapter`)."""
        self._call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_lora(self, name: str) -> None:
        self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name})

    def models(self) -> list[str]:
        """The names vLLM serves (its base model's served name and the adapters)."""
        answer = json.loads(self._call("GET", "/v1/models"))
        return [str(entry["id"]) for entry in answer.get("data", [])]
