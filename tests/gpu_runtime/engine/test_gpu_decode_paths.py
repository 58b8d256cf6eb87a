"""CUDA-only: the decode paths that change how a step runs but not what it computes (async
scheduling: the same tokens as the synchronous engine)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.engine.cuda_graphs import DecodeGraphs
from gpu_runtime.model import CausalLM
from tests.gpu_runtime.small_model import small_cuda_model

pytestmark = pytest.mark.gpu


_ENGINE_CONFIG: dict[str, object] = dict(
    num_kv_blocks=256,
    block_size=16,
    max_num_seqs=8,
    max_model_len=256,
    max_num_batched_tokens=64,
    device="cuda",
)


def _engine(model: CausalLM, **overrides: object) -> Engine:
    base = {**_ENGINE_CONFIG, **overrides}
    engine = Engine(model, EngineConfig(**base))  # type: ignore[arg-type]
    assert engine.capture_cuda_graphs() == [8, 4, 2, 1]
    return engine


def _run(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, staggered: bool = True
) -> dict[str, tuple]:
    """`staggered`: a request joins every other step, else all are queued before the first;
    per request: tokens, logprobs, finish reason."""
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    reasons: dict[str, str | None] = {}
    pending = list(prompts)
    ids: list[str] = []
    steps = 0
    while pending or engine.has_unfinished_requests():
        while pending and (steps % 2 == 0 or not staggered):
            rid = engine.add_request(pending.pop(0), params)
            ids.append(rid)
            tokens[rid], logprobs[rid] = [], []
            if staggered:
                break
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [lp.logprob for lp in out.new_logprobs]
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        steps += 1
    return {f"r{i}": (tokens[r], logprobs[r], reasons[r]) for i, r in enumerate(ids)}


def _async_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in (5, 40, 77, 3, 20)]


_GREEDY = SamplingParams(
    max_tokens=16, temperature=0.0, logprobs=1, detokenize=False, ignore_eos=True
)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_async_scheduling_gives_the_synchronous_tokens(architecture: str) -> None:
    """Every request queued before the first step: the async engine runs the synchronous
    engine's steps (same batches, same graphs; only decode-only steps overlap), so tokens and
    logprobs are bit-equal (greedy with logprobs, seeded sampling)."""
    model = small_cuda_model(architecture)
    prompts = _async_prompts()
    seeded = SamplingParams(
        max_tokens=12, temperature=0.8, seed=5, detokenize=False, ignore_eos=True
    )
    for params in (_GREEDY, seeded):
        reference = _run(_engine(model), prompts, params, staggered=False)
        engine = _engine(model, async_scheduling=True)
        got = _run(engine, prompts, params, staggered=False)
        assert got == reference
        assert engine.runner.num_overlapped_steps > 0
        engine.step()
        assert engine.runner.states == {}


def test_capture_survives_a_collection_of_dropped_engines() -> None:
    """A dropped engine that is cyclic garbage holds its CUDA graphs until the collector runs;
    a collection in the middle of another engine's capture would destroy graphs there
    ("operation not permitted when stream is capturing"), then invalidate the capture. Here a
    collection runs inside every capture on purpose; the capture collects first, so the dropped
    graphs are gone before it begins and the new graphs give the reference tokens."""
    model = small_cuda_model("qwen2")  # q|k|v bias: the linear that failed in D2
    prompts = _async_prompts()
    reference = _run(_engine(model), prompts, _GREEDY, staggered=False)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        dropped = _engine(model)
        # An engine holds no reference cycle of its own; one held by its user (a closure, a
        # traceback) leaves it to the collector, graphs included.
        dropped.held_by_user = [dropped]  # type: ignore[attr-defined]
        runner = weakref.ref(dropped.runner)
        del dropped
        assert runner() is not None  # cyclic garbage, graphs included
        engine = Engine(model, EngineConfig(**_ENGINE_CONFIG))  # type: ignore[arg-type]
        forward = engine.runner.decode.decode_forward
        collected_while_capturing = []

        def collecting_forward(bucket: int) -> torch.Tensor:
            if torch.cuda.is_current_stream_capturing():
                collected_while_capturing.append(gc.collect())
            return forward(bucket)

        graphs = DecodeGraphs(collecting_forward)
        engine.runner.decode.graphs = graphs
        assert engine.capture_cuda_graphs() == [8, 4, 2, 1]
        assert runner() is None
        assert len(collected_while_capturing) == 4
    finally:
        if was_enabled:
            gc.enable()
    replayed = []
    replay = graphs.replay

    def counting_replay(batch_size: int, partition: object = None) -> torch.Tensor:
        replayed.append(batch_size)
        return replay(batch_size, partition)

    graphs.replay = counting_replay  # type: ignore[method-assign]
    assert _run(engine, prompts, _GREEDY, staggered=False) == reference
    assert replayed  # the decode steps ran the graphs captured above


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_async_scheduling_with_arrivals_agrees_within_bf16(architecture: str) -> None:
    """A request joins every other call. A request added while a step is in flight is admitted
    one call later (the in-flight step is decode-only), so that call's decode rows run in a
    decode graph where the synchronous engine ran them in a step with the new prompt: other
    kernels, bf16-rounding differences (logprobs a few 1e-3 apart, so bit equality
    cannot hold). A request
    that stops on a token has its next step computed and discarded, which can move the others
    into another bucket for that step."""
    model = small_cuda_model(architecture)
    prompts = _async_prompts()
    expected = _run(_engine(model), prompts, _GREEDY)
    stop = tuple({t for tokens, _, _ in list(expected.values())[:2] for t in tokens[5:6]})
    stopping = SamplingParams(max_tokens=16, temperature=0.0, detokenize=False, stop_token_ids=stop)
    for params in (_GREEDY, stopping):
        reference = _run(_engine(model), prompts, params)
        engine = _engine(model, async_scheduling=True)
        got = _run(engine, prompts, params)
        assert _agreement(reference, got) >= 0.9
        for key, (tokens, logprobs, _) in reference.items():
            ours_tokens, ours_logprobs, _ = got[key]
            same = next(
                (i for i, (a, b) in enumerate(zip(tokens, ours_tokens, strict=False)) if a != b),
                min(len(tokens), len(ours_tokens)),
            )
            if logprobs and same:
                diff = torch.tensor(logprobs[:same]) - torch.tensor(ours_logprobs[:same])
                assert float(diff.abs().max()) < 0.05, (key, diff)
        assert engine.runner.num_overlapped_steps > 0
        engine.step()
        assert engine.runner.states == {}


def _agreement(expected: dict[str, tuple], got: dict[str, tuple]) -> float:
    """Fraction of expected tokens before each request's first difference."""
    agree = total = 0
    for key, (tokens, _, _) in expected.items():
        ours = got[key][0]
        first = next(
            (i for i, (a, b) in enumerate(zip(tokens, ours, strict=False)) if a != b), None
        )
        agree += min(len(tokens), len(ours)) if first is None else first
        total += len(tokens)
    return agree / total


@pytest.mark.parametrize("rows", [0, 4, 1 << 30])
def test_programmatic_launch_keeps_the_tokens(rows: int) -> None:
    """Programmatic dependent launch changes when kernels start, not what they compute: with it
    at no bucket, the small ones or every one, the same tokens and logprobs bit for bit."""
    model = small_cuda_model("llama")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in (5, 40, 77, 3, 20)]
    greedy = SamplingParams(
        max_tokens=16, temperature=0.0, logprobs=1, detokenize=False, ignore_eos=True
    )
    plain = _engine(model, async_scheduling=True, decode_programmatic_launch_rows=0)
    expected = _run(plain, prompts, greedy)
    del plain
    engine = _engine(model, async_scheduling=True, decode_programmatic_launch_rows=rows)
    assert engine.runner.fused is not None
    assert engine.runner.fused.programmatic_launch_rows == rows
    assert _run(engine, prompts, greedy) == expected


@pytest.mark.parametrize("block_size", [16, 32])
def test_varlen_kernel_matches_the_reference_bf16(block_size: int) -> None:
    """Llama-3-8B heads (32 / 8 / 128), bf16 cache: decode rows, a 496-token chunk, a chunk
    after a 700-token prefix, a padded row, a 2048-token chunk; against the fp32 reference and
    the SDPA path of `MixedPagedAttention`."""
    from gpu_runtime.engine.attention.metadata import AttentionMetadata
    from gpu_runtime.engine.attention.mixed import MixedPagedAttention
    from gpu_runtime.engine.attention.triton_varlen import triton_varlen_fn
    from gpu_runtime.engine.attention.varlen import (
        build_varlen_tiles,
        varlen_attention_reference,
        varlen_block_q,
    )
    from gpu_runtime.engine.kv_cache import PagedKVCache
    from gpu_runtime.model import ModelConfig

    dev = torch.device("cuda")
    config = ModelConfig.preset("llama3-8b")
    gen = torch.Generator(device=dev).manual_seed(block_size)
    query_lens = [1, 496, 1, 3, 130, 1, 2048, 1]
    seq_lens = [17, 496, 900, 0, 830, 1, 2048, 2000]
    width = -(-2100 // block_size)
    blocks_needed = sum(-(-n // block_size) for n in seq_lens) + 8
    cache = PagedKVCache(config, blocks_needed + 64, block_size, torch.bfloat16, dev)
    cache.storage.normal_(generator=gen)
    table = torch.randint(0, blocks_needed + 64, (len(seq_lens), width), device=dev, generator=gen)
    table = table.int()
    metadata = AttentionMetadata(
        slot_blocks=torch.zeros(1, dtype=torch.long, device=dev),
        slot_offsets=torch.zeros(1, dtype=torch.long, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=table,
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
    )
    tokens = sum(query_lens)
    q = torch.randn(tokens, 32, 128, device=dev, generator=gen).to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    varlen = MixedPagedAttention(cache, metadata, varlen_fn=triton_varlen_fn(block_size))
    varlen.attend(3, q, out)
    tiles = build_varlen_tiles(query_lens, varlen_block_q(4))
    reference = varlen_attention_reference(
        q,
        cache.key_caches[3],
        cache.value_caches[3],
        table,
        metadata.seq_lens,
        tiles,
        block_size,
        torch.zeros(q.shape, dtype=torch.float32, device=dev),
    )
    err = float((out.float() - reference).norm() / reference.norm())
    assert err < 1e-2, err
    assert not out[498:501].any()  # the padded row
    sdpa = MixedPagedAttention(cache, metadata).attend(3, q)
    keep = torch.ones(tokens, dtype=torch.bool, device=dev)
    keep[498:501] = False  # the SDPA path zeroes them too
    err = float((out[keep].float() - sdpa[keep].float()).norm() / sdpa[keep].float().norm())
    assert err < 1e-2, err
    # another mix of lengths reuses the compiled kernel (no new specialization)
    from gpu_runtime.engine.attention.triton_varlen import _varlen_paged_kernel

    caches = _varlen_paged_kernel.device_caches[torch.cuda.current_device()][0]
    compiled = len(caches)
    short = AttentionMetadata(
        slot_blocks=metadata.slot_blocks,
        slot_offsets=metadata.slot_offsets,
        seq_lens=metadata.seq_lens[:3],
        block_tables=table[:3],
        query_lens_host=[1, 33, 1],
        seq_lens_host=seq_lens[:3],
    )
    MixedPagedAttention(cache, short, varlen_fn=triton_varlen_fn(block_size)).attend(3, q[:35])
    torch.cuda.synchronize()
    assert len(caches) == compiled


def test_varlen_chunk_attention_gives_the_sdpa_tokens() -> None:
    """Engines differing only in `chunk_attention`, with mixed-step graphs: greedy tokens and
    logprobs agree (bf16 rounding aside)."""
    model = small_cuda_model("llama")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in (5, 140, 77, 3, 60)]
    greedy = SamplingParams(
        max_tokens=12, temperature=0.0, logprobs=1, detokenize=False, ignore_eos=True
    )
    expected = _run(_engine(model, chunk_attention="sdpa", mixed_cuda_graphs=True), prompts, greedy)
    engine = _engine(model, mixed_cuda_graphs=True)
    got = _run(engine, prompts, greedy)
    assert engine.runner.general.num_mixed_graph_steps > 0
    assert _agreement(expected, got) >= 0.8
