"""A host's per-request limits and fair admission, through its server under uvicorn: past a
limit a request is an OpenAI-shaped 400 and nothing reaches the engine (too many prompts: not
even the tokenizer); each request reaches the engine under its caller (the grant's tenant, a
bearer key's fingerprint), and one tenant's large batch delays another tenant's first token by
a bounded number of engine steps."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpu_runtime.contract.grants import GRANT_HEADER, Grant, grant_sign, host_key
from gpu_runtime.engine import Engine, EngineConfig, RequestOutput, SamplingParams
from gpu_runtime.model.tiny import build_tiny_model_dir
from gpu_runtime.server import (
    BearerKeys,
    EngineDriver,
    EngineLoop,
    GatewayGrants,
    ModelAccess,
    create_app,
    static_key_checker,
)
from gpu_runtime.server.limits import PROMPT_TOKENS_CONTEXTS, RequestLimits, RequestLimitsError
from tests.gpu_runtime.server.serving import serve_in_thread

HOST = "gpu-07"
KEY = host_key("fleet-secret", HOST)
MODEL = "tiny-llama"
SEQS = 4
MAX_TOKENS = 8


class RecordingDriver(EngineDriver):
    """The engine alone, recording per request its tenant, the step count when it was added
    and the step that sampled its first token (counts of `step()` calls, not wall time)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.steps = 0
        self.tenants: dict[str, str] = {}
        self.added_at: dict[str, int] = {}
        self.first_token_at: dict[str, int] = {}
        self.finished_at: dict[str, int] = {}

    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        lora_name: str | None,
        tenant: str = "",
    ) -> None:
        super().add_request(prompt, params, request_id, lora_name, tenant)
        self.tenants[request_id] = tenant
        self.added_at[request_id] = self.steps

    def step(self) -> list[RequestOutput]:
        outputs = super().step()
        self.steps += 1
        for out in outputs:
            if out.new_token_ids:
                self.first_token_at.setdefault(out.request_id, self.steps)
            if out.finished:
                self.finished_at[out.request_id] = self.steps
        return outputs

    def of(self, tenant: str) -> list[str]:
        return [rid for rid, t in self.tenants.items() if t == tenant]


class CountingTokenizer:
    """The engine's tokenizer, counting how often the server tokenizes with it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


Served = tuple[str, str, RecordingDriver, CountingTokenizer]
"""`/v1` URLs (small limits; the default limits), the driver, the tokenizer."""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model_dir: Path = build_tiny_model_dir(tmp_path_factory.mktemp("limits"), "llama", seed=3)
    config = EngineConfig(
        num_kv_blocks=256, block_size=8, max_num_seqs=SEQS, max_num_batched_tokens=128,
        max_model_len=128,
    )  # fmt: skip
    engine = Engine.from_directory(model_dir, config)
    tokenizer = CountingTokenizer(engine.tokenizer)
    engine.tokenizer = tokenizer
    driver = RecordingDriver(engine)
    loop = EngineLoop(driver)
    loop.start()
    auth = GatewayGrants(host=HOST, key=KEY, tenant_keys=BearerKeys(static_key_checker(["k1"])))
    small = RequestLimits(max_prompts_per_request=3, max_request_prompt_tokens=20)
    apps = [create_app(loop, MODEL, auth, limits=small), create_app(loop, MODEL, auth)]
    try:
        with serve_in_thread(apps[0]) as limited, serve_in_thread(apps[1]) as defaults:
            yield limited, defaults, driver, tokenizer
    finally:
        loop.stop()


def grant(tenant: str) -> dict[str, str]:
    token = grant_sign(Grant(HOST, tenant, (MODEL,), time.time() + 60, f"gw-{tenant}"), KEY)
    return {GRANT_HEADER: token}


def _post(base: str, route: str, headers: dict[str, str], **body: Any) -> httpx.Response:
    payload = {"model": MODEL, "max_tokens": 2, "temperature": 0.0} | body
    return httpx.post(f"{base}/{route}", json=payload, headers=headers, timeout=120)


def _refusal(response: httpx.Response, param: str, limit: int) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, None)
    assert f"at most {limit} " in error["message"]
    return str(error["message"])


def test_too_many_prompts_is_a_400_before_any_tokenization(served: Served) -> None:
    limited, defaults, driver, tokenizer = served
    calls, added = tokenizer.calls, len(driver.added_at)
    for stream in (False, True):
        refused = _post(
            limited, "completions", grant("acme"), prompt=["a", "b", "c", "d"], stream=stream
        )
        assert _refusal(refused, "prompt", 3).startswith("This request has 4 prompts")
    tokens = [[5, 6]] * (RequestLimits().max_prompts_per_request + 1)
    _refusal(_post(defaults, "completions", grant("acme"), prompt=tokens), "prompt", 256)
    assert tokenizer.calls == calls and len(driver.added_at) == added  # nothing done
    assert _post(limited, "completions", grant("acme"), prompt=["a", "b", "c"]).status_code == 200
    assert tokenizer.calls == calls + 3 and len(driver.added_at) == added + 3


def test_too_many_prompt_tokens_is_a_400_and_nothing_is_enqueued(served: Served) -> None:
    limited, defaults, driver, _ = served
    added = len(driver.added_at)
    refused = _post(limited, "completions", grant("acme"), prompt=[[5] * 10, [6] * 11])
    assert "hold 21 tokens in all" in _refusal(refused, "prompt", 20)
    long_chat = [{"role": "user", "content": "word " * 40}]
    _refusal(_post(limited, "chat/completions", grant("acme"), messages=long_chat), "messages", 20)
    streamed = _post(limited, "completions", grant("acme"), prompt=[5] * 21, stream=True)
    _refusal(streamed, "prompt", 20)
    # the default: 32 contexts of the engine's max_model_len (128)
    limit = PROMPT_TOKENS_CONTEXTS * 128
    many = [[7] * 100] * (limit // 100 + 1)
    _refusal(_post(defaults, "completions", grant("acme"), prompt=many), "prompt", limit)
    assert len(driver.added_at) == added
    assert _post(limited, "completions", grant("acme"), prompt=[[5] * 10, [6] * 10]).is_success


def test_limits_are_validated() -> None:
    with pytest.raises(RequestLimitsError, match="max_prompts_per_request must be >= 1, got 0"):
        RequestLimits(max_prompts_per_request=0)
    with pytest.raises(RequestLimitsError, match="max_request_prompt_tokens must be >= 1, got -"):
        RequestLimits(max_request_prompt_tokens=-5)
    assert RequestLimits().prompt_tokens_limit(512) == 16384
    assert RequestLimits(max_request_prompt_tokens=99).prompt_tokens_limit(512) == 99


def test_requests_reach_the_engine_under_their_caller(served: Served) -> None:
    limited, _, driver, _ = served
    assert _post(limited, "completions", grant("globex"), prompt="Hi").is_success
    bearer = {"authorization": "Bearer k1"}
    chat = [{"role": "user", "content": "x"}]
    assert _post(limited, "chat/completions", bearer, messages=chat).is_success
    assert driver.of("globex") and len(driver.of("globex")) == 1
    (key_caller,) = {t for t in driver.tenants.values() if t.startswith("key:")}
    assert key_caller == "key:" + hashlib.sha256(b"k1").hexdigest()[:16]  # not the key
    k2 = BearerKeys(static_key_checker(["k2"])).access({"authorization": "Bearer k2"})
    assert asyncio.run(k2).caller not in ("", key_caller)
    assert ModelAccess(tenant="acme", key_id="ffff").caller == "acme"


def test_another_tenants_first_token_comes_within_the_bound(served: Served) -> None:
    """Tenant A's 200 prompts are all queued when tenant B sends one: B's first token comes
    within MAX_TOKENS engine steps of its arrival (the engine README's bound: each of A's
    running requests has at most MAX_TOKENS - 1 steps left, and B is next but one in the
    order), and B's answer is back long before A's."""
    _, defaults, driver, _ = served
    a_prompts = [[3 + i % 50, 9, 4, 11, 2] for i in range(200)]
    done = threading.Event()

    def tenant_a() -> httpx.Response:
        try:
            body = {"prompt": a_prompts, "max_tokens": MAX_TOKENS}
            return _post(defaults, "completions", grant("tenant-a"), **body)
        finally:
            done.set()

    with ThreadPoolExecutor(1) as pool:
        a_answer: Future[httpx.Response] = pool.submit(tenant_a)
        deadline = time.monotonic() + 60
        while len(driver.of("tenant-a")) < len(a_prompts) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(driver.of("tenant-a")) == len(a_prompts)
        b_answer = _post(defaults, "completions", grant("tenant-b"), prompt=[5, 8, 13, 21])
        a_pending = not done.is_set()
        assert b_answer.status_code == 200 and a_answer.result().status_code == 200
    (b_id,) = driver.of("tenant-b")
    a_ids = driver.of("tenant-a")
    assert driver.first_token_at[b_id] - driver.added_at[b_id] <= MAX_TOKENS
    assert driver.finished_at[b_id] < max(driver.finished_at[rid] for rid in a_ids)
    assert a_pending  # B's whole answer came back while A's was still being computed
