"""Adapters served by name through the OpenAI API: the engine's LoRA runtime behind the server."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.finetune.checkpoint import save_adapter
from gpu_runtime.finetune.lora import adapter_parameters, build_training_model
from gpu_runtime.lora.host_adapter import HostAdapter
from gpu_runtime.lora.runtime import MultiLoraRuntime
from gpu_runtime.model import CausalLM
from gpu_runtime.model.loader import load_model, load_tokenizer
from gpu_runtime.model.tiny import build_tiny_model_dir
from gpu_runtime.server import BearerKeys, EngineLoop, create_app, static_key_checker
from tests.gpu_runtime.server.serving import serve_in_thread

KEY = "sk-lora-key"
MODEL = "tiny-base"
ADAPTERS = {"acme-support": 1, "acme-poet": 2}
PROMPT = "Once upon a time"


def _config(async_scheduling: bool = False) -> EngineConfig:
    return EngineConfig(
        num_kv_blocks=128,
        block_size=8,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        max_model_len=128,
        static_decode_batches=True,
        cuda_graph_batch_sizes=(1, 2, 4, 8),
        async_scheduling=async_scheduling,
    )


@torch.no_grad()
def _merged(model_dir: Path, adapter: HostAdapter) -> CausalLM:
    merged = load_model(model_dir, dtype="float32")
    for (layer, module), (a, b) in adapter.weights.items():
        block = merged.model.layers[layer]
        parent = block.mlp if module.endswith(("gate_proj", "up_proj", "down_proj")) else None
        getattr(parent or block.self_attn, module).weight.add_(
            b @ a
        )  # b holds its module's scaling
    return merged


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def served(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[str, dict[str, str], EngineLoop]]:
    """Server URL, per adapter name the greedy text of the merged-weights model (synchronous
    engines), and the engine loop; the served engine is synchronous or async-scheduling."""
    root = tmp_path_factory.mktemp("lora-srv")
    model_dir = build_tiny_model_dir(root / "model", "llama", seed=9)
    tokenizer = load_tokenizer(model_dir)
    base = load_model(model_dir, dtype="float32")
    runtime = MultiLoraRuntime(
        base, max_tokens=_config().max_num_batched_tokens, num_slots=1, max_rank=4
    )
    expected: dict[str, str] = {}
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    for name, seed in ADAPTERS.items():
        tree = build_training_model(base, LoraSpec(rank=4, alpha=8), seed=seed)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in adapter_parameters(tree):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        save_adapter(tree, LoraSpec(rank=4, alpha=8), root / name)
        runtime.register(name, root / name)
        merged = _merged(model_dir, HostAdapter.from_directory(name, root / name, base.config))
        engine = Engine(merged, _config(), tokenizer=tokenizer)
        expected[name] = engine.generate([PROMPT], greedy)[0].text
    plain = Engine(load_model(model_dir, dtype="float32"), _config(), tokenizer=tokenizer)
    expected[MODEL] = plain.generate([PROMPT], greedy)[0].text
    huge = build_training_model(base, LoraSpec(rank=8, alpha=8), seed=0)
    save_adapter(huge, LoraSpec(rank=8, alpha=8), root / "acme-huge")
    runtime.register("acme-huge", root / "acme-huge")  # rank 8 > the slots' 4: fails at admission
    config = _config(async_scheduling=request.param)
    loop = EngineLoop(Engine(base, config, tokenizer=tokenizer, lora=runtime))
    loop.start()
    app = create_app(loop, MODEL, BearerKeys(static_key_checker([KEY])))
    try:
        with serve_in_thread(app) as url:
            yield url, expected, loop
    finally:
        loop.stop()


def test_adapters_are_listed_and_routed_by_name(
    served: tuple[str, dict[str, str], EngineLoop],
) -> None:
    base_url, expected, loop = served
    client = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=30)
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, "acme-huge", "acme-poet", "acme-support"]
    assert len(set(expected.values())) == 3  # the adapters change the text
    # concurrent requests for two adapters and the base model share one engine with ONE
    # adapter slot (an adapter request waits while the other adapter's request runs)
    results: dict[str, str] = {}

    def ask(model: str) -> None:
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0.0)
        results[model] = out.choices[0].text

    threads = [threading.Thread(target=ask, args=(m,)) for m in expected]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == expected
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="acme-nobody", prompt="hi", max_tokens=2)
    assert missing.value.status_code == 404 and missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="rank 8 > 4"):
        client.completions.create(model="acme-huge", prompt=PROMPT, max_tokens=2)
    again = client.completions.create(
        model="acme-poet", prompt=PROMPT, max_tokens=12, temperature=0
    )
    assert again.choices[0].text == expected["acme-poet"]  # the engine loop is unaffected
    engine = loop.engine
    overlapped = loop.run_in_loop(lambda: engine.runner.num_overlapped_steps).result(10)
    assert (overlapped > 0) == engine.config.async_scheduling
