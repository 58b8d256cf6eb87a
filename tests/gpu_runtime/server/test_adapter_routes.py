"""The operator's adapter routes over real HTTP: load and unload adapters at run time on a
running server (vLLM's `/v1/load_lora_adapter` shape), served at once through the openai
client, with the operator token, the adapter roots and every refusal checked."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch

from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.finetune.checkpoint import ADAPTER_CONFIG, save_adapter
from gpu_runtime.finetune.lora import adapter_parameters, build_training_model
from gpu_runtime.lora.runtime import MultiLoraRuntime
from gpu_runtime.model import CausalLM
from gpu_runtime.model.loader import load_model, load_tokenizer
from gpu_runtime.model.tiny import build_tiny_model_dir
from gpu_runtime.server import BearerKeys, EngineLoop, create_app, static_key_checker
from gpu_runtime.server.adapter_admin import AdapterAdmin, AdapterAdminError, EngineAdapters
from tests.gpu_runtime.server.serving import serve_in_thread

KEY = "sk-tenant-key"
ADMIN = "admin-token-1"
MODEL = "tiny-base"
PROMPT = "Once upon a time"


@dataclass
class Served:
    url: str
    """The server's root URL (the `/v1` base URL without `/v1`)."""
    root: Path
    """The adapter root."""
    outside: Path
    """A directory holding a valid adapter outside the root."""
    loop: EngineLoop


def _save(base: CausalLM, directory: Path, seed: int, rank: int = 4) -> None:
    spec = LoraSpec(rank=rank, alpha=8)
    tree = build_training_model(base, spec, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(tree):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    save_adapter(tree, spec, directory)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("adapter-routes")
    model_dir = build_tiny_model_dir(tmp / "model", "llama", seed=9)
    base = load_model(model_dir, dtype="float32")
    config = EngineConfig(
        num_kv_blocks=128, block_size=8, max_num_seqs=8, max_num_batched_tokens=128,
        max_model_len=128,
    )  # fmt: skip
    lora = MultiLoraRuntime(base, max_tokens=128, num_slots=2, max_rank=4)
    root, outside = tmp / "adapters", tmp / "elsewhere"
    for name, seed in (("poet", 1), ("support", 2)):
        _save(base, root / name, seed)
    _save(base, outside / "escape", 3)
    _save(base, root / "huge", 4, rank=8)
    (root / "link").symlink_to(outside / "escape")
    _save(base, root / "not-lora", 5)
    config_path = root / "not-lora" / ADAPTER_CONFIG
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"peft_type": "IA3"}))
    (root / "empty").mkdir()
    loop = EngineLoop(Engine(base, config, tokenizer=load_tokenizer(model_dir), lora=lora))
    loop.start()
    admin = AdapterAdmin(ADMIN, (root,), EngineAdapters(lambda: loop.engine))
    app = create_app(loop, MODEL, BearerKeys(static_key_checker([KEY])), adapter_admin=admin)
    try:
        with serve_in_thread(app) as url:
            yield Served(url.removesuffix("/v1"), root, outside, loop)
    finally:
        loop.stop()


def _post(
    served: Served, path: str, body: Mapping[str, object], token: str | None = ADMIN
) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"{served.url}{path}", json=body, headers=headers, timeout=30)


def _load(served: Served, name: str, path: str) -> httpx.Response:
    return _post(served, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})


def _client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=30)


def _greedy(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0)
    return out.choices[0].text


def _error(response: httpx.Response) -> dict[str, object]:
    error: dict[str, object] = response.json()["error"]
    return error


def test_load_serves_at_once_and_unload_stops_it(served: Served) -> None:
    client = _client(served)
    base_text = _greedy(client, MODEL)
    assert [m.id for m in client.models.list().data] == [MODEL]
    loaded = _post(served, "/v1/load_lora_adapter", {"lora_name": "poet", "lora_path": "poet"})
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'poet' added successfully."
    absolute = str(served.root / "support")
    loaded = _post(served, "/v1/load_lora_adapter", {"lora_name": "support", "lora_path": absolute})
    assert loaded.status_code == 200, loaded.text
    models = client.models.list().data
    assert [(m.id, getattr(m, "parent", None)) for m in models] == [
        (MODEL, None), ("poet", MODEL), ("support", MODEL),
    ]  # fmt: skip
    poet, support = _greedy(client, "poet"), _greedy(client, "support")
    assert len({base_text, poet, support}) == 3  # each adapter changes the text
    assert _greedy(client, "poet") == poet
    unloaded = _post(served, "/v1/unload_lora_adapter", {"lora_name": "poet"})
    assert unloaded.status_code == 200, unloaded.text
    assert unloaded.text == "Success: LoRA adapter 'poet' removed successfully."
    with pytest.raises(openai.NotFoundError):
        _greedy(client, "poet")
    assert [m.id for m in client.models.list().data] == [MODEL, "support"]
    assert _greedy(client, "support") == support  # the other adapter is untouched
    # loaded again under the same name: served again, same weights, same text
    assert _load(served, "poet", "poet").status_code == 200
    assert _greedy(client, "poet") == poet
    for name in ("poet", "support"):
        assert _post(served, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200


def test_unload_lets_running_requests_finish(served: Served) -> None:
    client = _client(served)
    assert _load(served, "poet", "poet").status_code == 200
    expected = _greedy(client, "poet")
    stream = client.completions.create(
        model="poet", prompt=PROMPT, max_tokens=10, temperature=0, stream=True
    )
    chunks = iter(stream)
    first = next(chunks)
    assert _post(served, "/v1/unload_lora_adapter", {"lora_name": "poet"}).status_code == 200
    text = first.choices[0].text + "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected  # finished with the adapter it started with
    with pytest.raises(openai.NotFoundError) as refused:
        _greedy(client, "poet")
    assert refused.value.code == "model_not_found"


def test_refusals_name_the_field_and_change_nothing(served: Served) -> None:
    client = _client(served)
    assert _load(served, "poet", "poet").status_code == 200
    poet = _greedy(client, "poet")
    cases = [
        ({"lora_name": "poet", "lora_path": "support"}, "lora_name", "already been loaded"),
        ({"lora_name": MODEL, "lora_path": "support"}, "lora_name", "base model"),
        ({"lora_name": "a b", "lora_path": "support"}, "lora_name", "spaces"),
        ({"lora_name": "", "lora_path": "support"}, "lora_name", "1 to 256"),
        ({"lora_name": "x", "lora_path": ""}, "lora_path", "empty"),
        ({"lora_name": "x", "lora_path": str(served.outside / "escape")}, "lora_path", "root"),
        ({"lora_name": "x", "lora_path": "../elsewhere/escape"}, "lora_path", "root"),
        ({"lora_name": "x", "lora_path": "link"}, "lora_path", "root"),
        ({"lora_name": "x", "lora_path": "missing"}, "lora_path", "not a directory"),
        ({"lora_name": "x", "lora_path": "empty"}, "lora_path", "lacks adapter_config"),
        ({"lora_name": "x", "lora_path": "not-lora"}, "lora_path", "only LORA adapters"),
        ({"lora_name": "x", "lora_path": "huge"}, "lora_path", "rank 8 > "),
        (
            {"lora_name": "x", "lora_path": "poet", "base_model": "y"},
            "base_model",
            "Unrecognized request argument",
        ),
        ({"lora_name": "x"}, "lora_path", "Field required"),
    ]
    for body, param, message in cases:
        response = _post(served, "/v1/load_lora_adapter", body)
        assert response.status_code == 400, (body, response.text)
        error = _error(response)
        assert error["param"] == param and message in str(error["message"]), (body, error)
        unsupported = body.get("lora_path") == "not-lora"
        assert (error["code"] == "unsupported_adapter") == unsupported, (body, error)
    assert [m.id for m in client.models.list().data] == [MODEL, "poet"]
    assert _greedy(client, "poet") == poet
    missing = _post(served, "/v1/unload_lora_adapter", {"lora_name": "nobody"})
    assert missing.status_code == 404
    assert _error(missing) | {"message": ""} == {
        "message": "", "type": "invalid_request_error", "param": "lora_name",
        "code": "model_not_found",
    }  # fmt: skip
    assert _post(served, "/v1/unload_lora_adapter", {"lora_name": "poet"}).status_code == 200


def test_only_the_admin_token_opens_the_routes(served: Served) -> None:
    body = {"lora_name": "poet", "lora_path": "poet"}
    for token in (None, KEY, "admin-token-2"):
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            response = _post(served, path, body, token=token)
            assert response.status_code == 401, (token, path)
            assert _error(response)["code"] == "invalid_api_key"
    # an unauthenticated bad body is refused for its credential, before its body is read
    assert _post(served, "/v1/load_lora_adapter", {}, token=None).status_code == 401
    assert [m.id for m in _client(served).models.list().data] == [MODEL]


def test_routes_are_off_without_an_admin(served: Served) -> None:
    app = create_app(served.loop, MODEL, BearerKeys(static_key_checker([KEY])))
    with serve_in_thread(app) as url:
        root = url.removesuffix("/v1")
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            response = httpx.post(
                root + path, json={"lora_name": "poet", "lora_path": "poet"},
                headers={"authorization": f"Bearer {ADMIN}"}, timeout=30,
            )  # fmt: skip
            assert response.status_code == 404 and _error(response)["code"] == "not_found"


def test_concurrent_loads_of_one_name_register_it_once(served: Served) -> None:
    statuses: list[int] = []

    def load() -> None:
        body = {"lora_name": "twin", "lora_path": "support"}
        statuses.append(_post(served, "/v1/load_lora_adapter", body).status_code)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(statuses) == [200, 400, 400, 400]
    assert _post(served, "/v1/unload_lora_adapter", {"lora_name": "twin"}).status_code == 200


def test_admin_settings_are_validated(tmp_path: Path, served: Served) -> None:
    registry = EngineAdapters(lambda: served.loop.engine)
    with pytest.raises(AdapterAdminError, match="non-empty"):
        AdapterAdmin("", (tmp_path,), registry)
    with pytest.raises(AdapterAdminError, match="at least one"):
        AdapterAdmin(ADMIN, (), registry)
    with pytest.raises(AdapterAdminError, match="'relative' is not an absolute directory"):
        AdapterAdmin(ADMIN, (Path("relative"),), registry)
    assert ADMIN not in repr(AdapterAdmin(ADMIN, (tmp_path,), registry))
