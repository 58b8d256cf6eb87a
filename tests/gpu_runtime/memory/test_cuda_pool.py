"""The CUDA pool on a real GPU: maps, the KV view, the finetune cap, a reclaim. Skipped in CI."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.memory import (
    DecodeDemand,
    KVLayout,
    MemoryManager,
    MemoryManagerConfig,
    MemoryPoolError,
    create_page_pool,
    kv_block_bytes,
)
from tests.gpu_runtime.small_model import small_cuda_model

MIB = 1 << 20
GIB = 1 << 30

pytestmark = pytest.mark.gpu


def _llama3_8b_layout(page_bytes: int) -> KVLayout:
    block = kv_block_bytes(
        block_tokens=16, num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2
    )
    return KVLayout(page_bytes=page_bytes, block_bytes=block)


def test_llama3_8b_block_is_one_cuda_page() -> None:
    pool = create_page_pool(device="cuda", pool_bytes=64 * MIB)
    try:
        assert pool.page_bytes == 2 * MIB
        assert _llama3_8b_layout(pool.page_bytes).block_bytes == pool.page_bytes
    finally:
        pool.close()


def test_reclaim_from_finetune_keeps_kv_data_and_enforces_the_cap() -> None:
    torch.cuda.empty_cache()
    # Process-wide accounting: the test's own tensors stand for finetune's.
    pool = create_page_pool(
        device="cuda", pool_bytes=2 * GIB, torch_headroom_bytes=64 * MIB, finetune_pools=False
    )
    layout = _llama3_8b_layout(pool.page_bytes)
    config = MemoryManagerConfig(
        reserve_low_pages=8,
        reserve_high_pages=32,
        max_step_pages=256,
        shrink_after_iterations=2,
        grow_hold_iterations=1,
    )
    manager = MemoryManager(pool, layout, config)
    try:
        kv = pool.kv_storage()
        assert kv.dtype == torch.uint8 and kv.is_cuda
        assert kv.numel() == pool.num_pages * pool.page_bytes
        blocks = kv.view(pool.num_pages, pool.page_bytes).view(torch.bfloat16)
        # Decode holds 8 blocks with known data.
        gen = torch.Generator(device="cuda").manual_seed(0)
        held = torch.randn((8, pool.page_bytes // 2), generator=gen, device="cuda")
        blocks[:8].copy_(held.to(torch.bfloat16))
        demand = DecodeDemand(used_blocks=8, top_used_block=8)
        assert manager.before_step(demand).short_blocks == 0

        # Finetuning wants 1.5 GiB; idle pages are lent to it over a few maintain steps.
        manager.finetune.set_demand(1536 * MIB)
        for _ in range(8):
            manager.maintain(demand)
        assert manager.finetune.budget_bytes == 1536 * MIB
        # The cap is real: a tensor beyond budget + headroom fails, one inside it fits.
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1700 * MIB, dtype=torch.uint8, device="cuda")
        activations = torch.empty(1200 * MIB, dtype=torch.uint8, device="cuda")
        activations.fill_(1)
        lora_state = torch.ones(32 * MIB, dtype=torch.uint8, device="cuda")
        del activations
        manager.finetune.quantum_done(peak_bytes=1232 * MIB, resident_bytes=32 * MIB)

        # A burst: decode's next step needs 900 more blocks; the pool reclaims from finetuning.
        burst = DecodeDemand(used_blocks=8, top_used_block=8, next_step_blocks=900)
        grant = manager.before_step(burst)
        assert grant.short_blocks == 0
        assert grant.usable_blocks >= 908
        assert manager.counters.finetune_shrinks >= 1
        assert manager.counters.reclaim_latency.percentile_ms(99) > 0
        pool.check()
        # Every new block gets its own value (small integers are exact in bf16); written and
        # compared in chunks, since the test's own tensors also live under the finetune cap.
        tags = (torch.arange(900, device="cuda") % 251 + 1).to(torch.bfloat16).view(-1, 1)
        blocks[8:908].copy_(tags.expand(900, pool.page_bytes // 2))
        torch.cuda.synchronize()
        assert torch.equal(blocks[:8], held.to(torch.bfloat16))
        for start in range(0, 900, 50):
            chunk = blocks[8 + start : 8 + start + 50]
            assert bool((chunk == tags[start : start + 50]).all())
        assert bool((lora_state == 1).all())
        # Finetuning's smaller budget is enforced on its next quantum.
        assert manager.finetune.budget_bytes < 1232 * MIB
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(manager.finetune.budget_bytes + 128 * MIB, dtype=torch.uint8, device="cuda")
        del lora_state
    finally:
        pool.close()
    # The closed pool gives all of its memory back to the device.
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    big = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    assert big.numel() == 2 * GIB and free > 2 * GIB


def test_finetune_pools_leave_decode_growth_out_and_flush_only_for_finetune_memory() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    pool = create_page_pool(device="cuda", pool_bytes=2 * GIB, torch_headroom_bytes=256 * MIB)
    backend = pool.backend
    held: dict[str, object] = {}
    try:
        assert backend.finetune_accounting == "pools"  # type: ignore[attr-defined]
        assert pool.grow_decode(pool.map_unit_pages) == pool.map_unit_pages
        pool.lend_to_finetune(512)  # 1 GiB
        # Decode's own growth after warm-up (eager prefill activations): not finetune's.
        decode_growth = torch.ones(512 * MIB, dtype=torch.uint8, device="cuda")
        assert backend.finetune_reserved_bytes() == 0
        with backend.finetune_allocations():
            lora_state = torch.ones(64 * MIB, dtype=torch.uint8, device="cuda")
        assert 64 * MIB <= backend.finetune_reserved_bytes() < 128 * MIB
        # The cap followed decode's growth: finetune still has its whole budget (process-wide
        # accounting would have charged the 512 MiB to it and failed this allocation).
        with backend.finetune_allocations():
            quantum = torch.empty(768 * MIB, dtype=torch.uint8, device="cuda")
        del quantum  # cached in the MemPool (finetune's) unless an empty_cache returns it
        # A finetune CUDA graph's private pool is finetune's too.
        static_in = torch.ones(1, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            scratch = static_in.expand(256 * MIB // 4).contiguous()
            held["out"] = scratch.sum()
        del scratch
        held["graph"] = graph
        del graph
        torch.cuda.synchronize()
        reserved = backend.finetune_reserved_bytes()
        assert reserved >= (64 + 256) * MIB
        assert pool.finetune_held_pages() * pool.page_bytes >= reserved
        del decode_growth
        # What the finetune allocator does not hold comes back by a cap change, no flush...
        spare = pool.finetune_flush_free_pages()
        assert not pool.reclaim_from_finetune(spare, allow_flush=False)
        with pytest.raises(MemoryPoolError, match="without a cache flush"):
            pool.reclaim_from_finetune(1, allow_flush=False)
        # ... below it a flush runs: the graph (dropped by the hook) gives its pool back.
        pool.before_flush = held.clear
        before = backend.finetune_reserved_bytes()
        assert pool.reclaim_from_finetune(1)
        assert not held and pool.last_flush_s is not None
        assert backend.finetune_reserved_bytes() <= before - 256 * MIB
        assert bool((lora_state == 1).all())
        del lora_state
    finally:
        held.clear()
        pool.close()


@pytest.mark.parametrize("mixed_graphs", [False, True])
def test_engine_over_the_cuda_pool_matches_a_plain_engine(mixed_graphs: bool) -> None:
    """Same tokens as a plain engine of the same config; with `mixed_graphs` the steps carrying
    prefill chunks replay the engine's piecewise graphs (the deployed shape), whose padding
    tokens write to the pool's pinned padding block."""
    from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
    from gpu_runtime.memory import EngineMemory

    model = small_cuda_model()
    greedy = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, ignore_eos=True)
    fields = dict(
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=128,
        mixed_cuda_graphs=mixed_graphs,
    )
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in (5, 70, 12, 33)]
    plain = Engine(model, EngineConfig(num_kv_blocks=64, device="cuda", **fields))  # type: ignore[arg-type]
    plain.capture_cuda_graphs()
    expected = [o.output_token_ids for o in plain.generate(prompts, greedy)]
    del plain
    torch.cuda.empty_cache()

    pool = create_page_pool(device="cuda", pool_bytes=512 * MIB, pinned_tail_pages=1)
    try:
        config = MemoryManagerConfig(reserve_low_pages=16, reserve_high_pages=64, max_step_pages=16)
        memory = EngineMemory.prepare(
            pool, model.config, block_size=16, kv_dtype="bfloat16", max_model_len=128, config=config
        )
        engine_config = EngineConfig(device="cuda", **fields, **memory.engine_config_fields())  # type: ignore[arg-type]
        engine = Engine(model, engine_config, kv_storage_factory=memory.binding.storage_factory)
        memory.attach(engine)
        engine.capture_cuda_graphs()  # graphs bake in KV addresses: the pool's never move
        memory.decode_ready()
        memory.manager.finetune.set_demand(256 * MIB)
        ids = [engine.add_request(p, greedy) for p in prompts]
        finished: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            memory.before_decode()
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.output_token_ids
            memory.after_decode()
        assert [finished[i] for i in ids] == expected
        pool.check()
        assert memory.lent_bytes() > 0
        from gpu_runtime.memory.cuda_backend import CudaVmmBackend

        assert isinstance(pool.backend, CudaVmmBackend)
        stats = pool.backend.allocator_stats()
        assert stats["segments"] > 0 and stats["reserved_bytes"] > 0
        assert memory.last_after.ms > 0
        del engine
    finally:
        pool.close()


def test_a_loop_planning_ahead_over_the_cuda_pool_matches_a_plain_engine() -> None:
    """The co-location loop over an async engine and the CUDA pool (the GPU host's defaults):
    steps launched ahead, a LoRA job's quanta beside them, requests stopping on tokens (their
    step ahead is discarded but may still write freed blocks; the pool waits for it before
    unmapping KV pages, counted in the CPU test): the tokens of a plain synchronous engine,
    the pool consistent."""
    from gpu_runtime.colocation import HostLoop, NaivePolicy
    from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
    from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
    from gpu_runtime.finetune.data import TokenizedExample
    from gpu_runtime.finetune.trainer import LoraTrainer
    from gpu_runtime.memory import EngineMemory

    model = small_cuda_model()
    fields = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in (5, 70, 12, 33, 9, 40)]
    plain = Engine(model, EngineConfig(num_kv_blocks=64, device="cuda", **fields))  # type: ignore[arg-type]
    plain.capture_cuda_graphs()

    def run_plain(engine: Engine, params: list[SamplingParams]) -> list[list[int]]:
        ids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():  # queued up front, as the loop's below
            done |= {o.request_id: o.output_token_ids for o in engine.step() if o.finished}
        return [done[i] for i in ids]

    greedy = SamplingParams(max_tokens=48, temperature=0.0, detokenize=False, ignore_eos=True)
    free = run_plain(plain, [greedy] * len(prompts))
    # Each request stops on the token it would sample at step 12 + 4 i (or earlier, where that
    # token came before): stops on tokens mid-batch, whose steps ahead are discarded.
    params = [
        SamplingParams(
            max_tokens=48,
            temperature=0.0,
            detokenize=False,
            ignore_eos=True,
            stop_token_ids=(tokens[12 + 4 * i],),
        )
        for i, tokens in enumerate(free)
    ]
    expected = run_plain(plain, params)
    assert all(len(t) < 48 for t in expected)
    del plain
    torch.cuda.empty_cache()

    pool = create_page_pool(device="cuda", pool_bytes=512 * MIB, pinned_tail_pages=1)
    try:
        config = MemoryManagerConfig(
            reserve_low_pages=16,
            reserve_high_pages=32,
            max_step_pages=16,
            shrink_after_iterations=2,
        )
        memory = EngineMemory.prepare(
            pool, model.config, block_size=16, kv_dtype="bfloat16", max_model_len=128, config=config
        )
        pooled = {**fields, **memory.engine_config_fields()}
        engine_config = EngineConfig(device="cuda", async_scheduling=True, **pooled)  # type: ignore[arg-type]
        engine = Engine(model, engine_config, kv_storage_factory=memory.binding.storage_factory)
        memory.attach(engine)
        engine.capture_cuda_graphs()
        memory.decode_ready()
        examples = [
            TokenizedExample(tuple(ids), tuple(ids))
            for ids in torch.randint(1, 1000, (8, 32), generator=gen).tolist()
        ]
        hparams = resolve_hyperparameters(
            n_train_examples=8, n_epochs=2, batch_size=2, lora=LoraSpec(rank=8, alpha=16), seed=0
        )
        with memory.finetune_allocations():
            trainer = LoraTrainer(model, examples, hparams)
        outputs: dict[str, list[int]] = {}
        loop = HostLoop(
            engine,
            NaivePolicy(quantum_examples=1),
            tpot_slo_ms=1e9,
            memory=memory,
            output_sink=lambda batch: outputs.update(
                {o.request_id: o.output_token_ids for o in batch}
            ),
        )
        memory.finetune_busy = lambda: loop.executor.in_flight is not None
        memory.manager.finetune.set_demand(256 * MIB)
        loop.add_job("ft", trainer)
        ids = [loop.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
        records = loop.run_until_idle(max_iterations=2000)
        loop.close()
        torch.cuda.synchronize()
        assert [outputs[i] for i in ids] == expected
        assert sum(r.planned_ahead for r in records) > 0
        assert engine.runner.num_discarded_steps > 0  # steps ahead of requests that stopped
        assert loop.job_state("ft").finished and loop.job_state("ft").failed is None
        assert memory.manager.counters.finetune_budget_violations == 0
        pool.check()
        del engine
    finally:
        pool.close()
