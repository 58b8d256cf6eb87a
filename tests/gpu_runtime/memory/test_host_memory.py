"""`build_host_memory` on CPU (the accounting pool): the engine and host loop it wires produce
the tokens of a plain engine while a LoRA job borrows pages, and the budget goes back when the
host has no job left."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.colocation import HostLoop, NaivePolicy
from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.finetune.data import TokenizedExample
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.memory import build_host_memory
from gpu_runtime.model import CausalLM, build_random_model
from gpu_runtime.model.tiny import tiny_config
from tests.gpu_runtime.tiny_host import ENGINE, GREEDY, POLICY, block_bytes


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return build_random_model(tiny_config("llama"), seed=11)


def test_host_memory_wires_engine_and_loop_and_returns_the_budget(model: CausalLM) -> None:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 480, (n,), generator=gen).tolist() for n in (5, 30, 12, 40)]
    plain = Engine(model, EngineConfig(num_kv_blocks=128, **ENGINE))  # type: ignore[arg-type]
    expected = [o.output_token_ids for o in plain.generate(prompts, GREEDY)]

    block = block_bytes(model)
    config = EngineConfig(num_kv_blocks=1, **ENGINE)  # type: ignore[arg-type]
    host = build_host_memory(model, config, pool_bytes=48 * block, config=POLICY)
    assert host.pool.page_bytes == block and host.pool.num_pages == 48
    assert host.engine_config.num_kv_blocks == host.memory.binding.initial_blocks >= 16
    assert host.engine_config.kv_block_capacity == host.memory.binding.capacity_blocks
    assert host.engine_config.max_model_len == 64
    engine = Engine(model, host.engine_config, kv_storage_factory=host.storage_factory)
    host.attach(engine)
    host.decode_ready()
    loop = HostLoop(engine, NaivePolicy(quantum_examples=1), tpot_slo_ms=1e9, memory=host.memory)
    host.bind_loop(loop)
    assert host.memory.finetune_busy is not None and not host.memory.finetune_busy()
    assert host.pool.before_flush is not None

    examples = [
        TokenizedExample(tuple(ids), tuple(ids))
        for ids in torch.randint(1, 480, (4, 12), generator=gen).tolist()
    ]
    hparams = resolve_hyperparameters(
        n_train_examples=4, n_epochs=2, batch_size=2, lora=LoraSpec(rank=4, alpha=8), seed=0
    )
    trainer = LoraTrainer(model, examples, hparams)
    released: list[int] = []
    trainer.release_cuda_graphs = lambda: released.append(1)  # type: ignore[method-assign]
    loop.add_job("ft", trainer)
    host.pool.before_flush()  # a flush first drops every job's CUDA graphs
    assert released == [1]
    host.set_finetune_jobs(1)
    ids = [loop.add_request(p, GREEDY) for p in prompts]
    finished: dict[str, list[int]] = {}
    outputs: list[object] = []
    loop.output_sink = outputs.extend
    records = loop.run_until_idle(max_iterations=300)
    for out in outputs:
        if out.finished:  # type: ignore[attr-defined]
            finished[out.request_id] = out.output_token_ids  # type: ignore[attr-defined]
    assert [finished[i] for i in ids] == expected
    assert loop.job_state("ft").finished and loop.job_state("ft").failed is None
    assert max(r.memory_lent_bytes or 0 for r in records) > 0
    host.pool.check()

    loop.remove_job("ft")
    host.set_finetune_jobs(0)
    for _ in range(20):  # nothing runs: the unwanted budget goes back in small steps
        loop.run_iteration()
    assert host.split().finetune_budget_bytes == 0
    assert host.memory.lent_bytes() == 0
    host.pool.check()
    loop.close()
    host.close()


def test_host_memory_checks_its_arguments(model: CausalLM) -> None:
    config = EngineConfig(num_kv_blocks=1, **ENGINE)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs pool_bytes"):
        build_host_memory(model, config)
    host = build_host_memory(model, config, pool_bytes=48 * block_bytes(model), config=POLICY)
    with pytest.raises(ValueError, match="job count"):
        host.set_finetune_jobs(-1)
    host.close()
