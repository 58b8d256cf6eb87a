"""`GET /metrics` of the inference server, scraped for real after real requests (uvicorn on a
free port, the official `openai` client) and parsed with prometheus-client's parser."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.model.tiny import build_tiny_model_dir
from gpu_runtime.server import BearerKeys, EngineLoop, create_app, static_key_checker
from gpu_runtime.server.prometheus import METRIC_NAMES, ServerMetrics
from tests.gpu_runtime.server.serving import serve_in_thread

KEY = "sk-test-key"
TOKEN = "scrape-token-1"
MODEL = "tiny-llama"


def scrape(
    base: str, token: str | None = TOKEN
) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every sample of `/metrics`: {sample name: {sorted labels: value}}."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(base.removesuffix("/v1") + "/metrics", headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            samples.setdefault(sample.name, {})[labels] = sample.value
    return samples


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir: Path = build_tiny_model_dir(tmp_path_factory.mktemp("prom"), "llama", seed=3)
    engine = Engine.from_directory(
        model_dir,
        EngineConfig(num_kv_blocks=128, block_size=8, max_num_seqs=8,
                     max_num_batched_tokens=256, max_model_len=256),
    )  # fmt: skip
    prometheus = ServerMetrics()
    loop = EngineLoop(engine, on_step=prometheus.iteration)
    loop.start()
    app = create_app(loop, MODEL, BearerKeys(static_key_checker([KEY])),
                     prometheus=prometheus, metrics_token=TOKEN)  # fmt: skip
    try:
        with serve_in_thread(app) as url:
            yield url
    finally:
        loop.stop()


def test_metrics_needs_the_token(served: str) -> None:
    url = served.removesuffix("/v1") + "/metrics"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url, headers={"authorization": f"Bearer {KEY}"}).status_code == 401


def test_histograms_and_counters_move_with_real_requests(served: str) -> None:
    before = scrape(served)
    client = openai.OpenAI(base_url=served, api_key=KEY, max_retries=0, timeout=30)
    streams = 3
    completion_tokens = []
    for i in range(streams):
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=6,
            temperature=0.0, stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        usage = [c.usage for c in chunks if c.usage is not None]
        completion_tokens.append(usage[0].completion_tokens)
    whole = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0.0)
    assert whole.usage is not None
    completion_tokens.append(whole.usage.completion_tokens)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=10_000)
    after = scrape(served)

    def moved(name: str, labels: dict[str, str] | None = None) -> float:
        key = tuple(sorted((labels or {}).items()))
        return after.get(name, {}).get(key, 0.0) - before.get(name, {}).get(key, 0.0)

    finished = streams + 1  # the streams and the whole completion produced tokens
    assert moved("harli_host_ttft_seconds_count") == finished
    assert moved("harli_host_ttft_seconds_bucket", {"le": "+Inf"}) == finished
    assert moved("harli_host_ttft_seconds_sum") > 0
    assert moved("harli_host_tpot_seconds_count") == sum(n > 1 for n in completion_tokens)
    tenant = next(t for (k, t) in next(iter(after["harli_host_requests_total"])) if k == "tenant")
    assert tenant.startswith("key:")  # a bearer key's fingerprint, never the key
    finish = whole.choices[0].finish_reason
    ended = {"tenant": tenant, "adapter": ""}
    counted = sum(moved("harli_host_requests_total", ended | {"outcome": o})
                  for o in ("stop", "length"))  # fmt: skip
    assert counted == finished and finish in ("stop", "length")
    assert moved("harli_host_requests_total", ended | {"outcome": "rejected"}) == 1
    assert moved("harli_host_request_duration_seconds_count", {"outcome": "rejected"}) == 1
    assert moved("harli_host_completion_tokens_total", ended) == sum(completion_tokens)
    assert moved("harli_host_prompt_tokens_total", ended) > 0
    # a step makes at most one token of each request
    assert moved("harli_host_iteration_seconds_count") >= max(completion_tokens)
    names = [n for n in after if n.startswith("harli_") and not n.endswith("_created")]
    families = {_family(name) for name in names}
    assert families <= METRIC_NAMES


def _family(sample: str) -> str:
    for suffix in ("_bucket", "_count", "_sum"):
        if sample.endswith(suffix):
            return sample.removesuffix(suffix)
    return sample


def test_metrics_is_off_without_a_token(tmp_path: Path) -> None:
    model_dir = build_tiny_model_dir(tmp_path / "m", "llama", seed=3)
    engine = Engine.from_directory(
        model_dir,
        EngineConfig(num_kv_blocks=32, block_size=8, max_num_seqs=2,
                     max_num_batched_tokens=64, max_model_len=64),
    )  # fmt: skip
    loop = EngineLoop(engine)
    loop.start()
    try:
        app = create_app(loop, MODEL, BearerKeys(static_key_checker([KEY])))
        with serve_in_thread(app) as url:
            response = httpx.get(url.removesuffix("/v1") + "/metrics")
            assert response.status_code == 404
            assert response.json()["error"]["code"] == "not_found"
    finally:
        loop.stop()
