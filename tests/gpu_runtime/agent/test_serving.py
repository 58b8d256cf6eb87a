"""The host serves base model and adapters from ONE engine through the server app: adapter and
base requests share decode steps, keys' grants scope `/v1/models` and routing, and streaming
works through the `openai` client."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import openai
import pytest
import torch

from gpu_runtime.agent.serving import lora_runtime
from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.contract.storage import LocalStorage
from gpu_runtime.engine import SamplingParams
from gpu_runtime.finetune.checkpoint import save_adapter
from gpu_runtime.finetune.lora import adapter_parameters, build_training_model
from gpu_runtime.model.loader import load_model
from gpu_runtime.server import BearerKeys, ModelAccess, create_app
from tests.gpu_runtime.agent.conftest import Host, Reports, make_runtime
from tests.gpu_runtime.server.serving import serve_in_thread

ADAPTER = "ft:tiny:acme::ftjob-9"
GRANTS = {
    "k-acme": ModelAccess(frozenset({"tiny", ADAPTER})),
    "k-globex": ModelAccess(frozenset({"tiny"})),
}


def _adapter_dir(model_dir: Path, target: Path) -> Path:
    spec = LoraSpec(rank=4, alpha=8)
    tree = build_training_model(load_model(model_dir), spec, seed=1)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in adapter_parameters(tree):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    save_adapter(tree, spec, target)
    return target


@pytest.fixture()
def idle_host(
    tiny_model_dir: Path, storage: LocalStorage, tmp_path: Path, reports: Reports
) -> Host:
    host = make_runtime(tiny_model_dir, storage, tmp_path / "work", reports)
    lora = lora_runtime(host.runtime.engine)
    host.runtime.adapters.load_local(lora, ADAPTER, _adapter_dir(tiny_model_dir, tmp_path / "a"))
    return host


def test_adapter_and_base_requests_share_every_decode_step(idle_host: Host) -> None:
    runtime = idle_host.runtime  # driven by hand: the loop thread is not started
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0)
    runtime.add_request([5, 6, 7, 8], params, "base", None)
    runtime.add_request([5, 6, 7, 8], params, "tuned", ADAPTER)
    steps: list[set[str]] = []
    logprobs: dict[str, list[float]] = {"base": [], "tuned": []}
    while runtime.has_work():
        outputs = runtime.step()
        steps.append({o.request_id for o in outputs})
        for out in outputs:
            logprobs[out.request_id] += [lp.logprob for lp in out.new_logprobs]
    assert steps == [{"base", "tuned"}] * 5  # one engine: every step carries both requests
    assert abs(logprobs["base"][0] - logprobs["tuned"][0]) > 1e-4  # the adapter applies
    runtime.after_turn()
    assert runtime.status().adapters == [ADAPTER]


def test_openai_client_streams_base_and_adapter_with_grants(
    idle_host: Host, reports: Reports
) -> None:
    idle_host.loop.start()

    def grant_of(key: str | None) -> ModelAccess | None:
        return GRANTS.get(key or "")

    app = create_app(
        idle_host.loop, "tiny", BearerKeys(grant_of), idle_host.runtime.request_metrics
    )
    try:
        with serve_in_thread(app) as url:
            acme = openai.OpenAI(base_url=url, api_key="k-acme", max_retries=0, timeout=60)
            assert [m.id for m in acme.models.list()] == ["tiny", ADAPTER]
            texts: dict[str, str] = {}

            def stream(model: str) -> None:
                chunks = acme.completions.create(
                    model=model, prompt="Q: hello", max_tokens=6, temperature=0.0, stream=True,
                    stream_options={"include_usage": True},
                )  # fmt: skip
                pieces = list(chunks)
                texts[model] = "".join(c.choices[0].text for c in pieces if c.choices)
                usage = pieces[-1].usage
                assert usage is not None and usage.completion_tokens == 6

            threads = [threading.Thread(target=stream, args=(m,)) for m in ("tiny", ADAPTER)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            for model in ("tiny", ADAPTER):
                whole = acme.completions.create(
                    model=model, prompt="Q: hello", max_tokens=6, temperature=0.0
                )
                assert texts[model] == whole.choices[0].text
            chat = acme.chat.completions.create(
                model=ADAPTER, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                stream=True,
            )  # fmt: skip
            assert [c.choices[0].delta.role for c in chat if c.choices][0] == "assistant"

            health = httpx.get(url.removesuffix("/v1") + "/health").json()
            assert health == {"status": "ok"}  # alive, and nothing about what it serves
            globex = openai.OpenAI(base_url=url, api_key="k-globex", max_retries=0, timeout=60)
            assert [m.id for m in globex.models.list()] == ["tiny"]
            with pytest.raises(openai.NotFoundError):
                globex.completions.create(model=ADAPTER, prompt="x", max_tokens=2)
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=url, api_key="k-none", max_retries=0).models.list()
        # The server's per-request TTFTs reach the host's interval metrics.
        ttfts: list[float] = []
        while not ttfts:
            deployment = reports.wait_for("metrics", timeout=10)["deployment_metrics"] or {}
            ttfts += [deployment["ttft_p50_ms"]] if deployment.get("ttft_p50_ms") else []
        assert ttfts[0] > 0
    finally:
        idle_host.stop()
