"""End-to-end engine behaviour on CPU (fp32) against HF transformers and against itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_runtime.engine import (
    Engine,
    EngineConfig,
    EngineConfigError,
    SamplingParams,
    UnknownAdapterError,
)
from gpu_runtime.model import CausalLM, build_random_model
from gpu_runtime.model.tiny import tiny_config

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, detokenize=False, ignore_eos=True)


def _config(**overrides: object) -> EngineConfig:
    base: dict[str, object] = dict(
        num_kv_blocks=96,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=24,
        max_model_len=128,
    )
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 480, (n,), generator=gen).tolist() for n in lengths]


def _hf_greedy(model: CausalLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF generate on a left-padded batch (mixed prompt lengths)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**model.config.to_hf_config())
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    hf.load_state_dict(model.state_dict(), strict=False)
    hf.tie_weights()
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[:, width:].tolist()


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_greedy_generation_equals_hf_generate(architecture: str) -> None:
    model = build_random_model(tiny_config(architecture), seed=21)
    prompts = _prompts(0, (3, 17, 40, 9, 26))
    expected = _hf_greedy(model, prompts, GREEDY.max_tokens)
    outputs = Engine(model, _config()).generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)


def _one_at_a_time(model: CausalLM, prompts: list[list[int]]) -> list[list[int]]:
    engine = Engine(model, _config(max_num_seqs=1))
    return [engine.generate([p], GREEDY)[0].output_token_ids for p in prompts]


@pytest.mark.parametrize("mixed_attention", [False, True])
def test_continuous_batching_with_staggered_arrivals_equals_sequential(
    tiny_llama: CausalLM, mixed_attention: bool
) -> None:
    """A 16-token budget: long prompts are chunked while others decode in the same steps
    (with `mixed_attention`, those steps batch the decode rows: `MixedPagedAttention`)."""
    prompts = _prompts(1, (5, 30, 12, 2, 44, 8))
    expected = _one_at_a_time(tiny_llama, prompts)
    config = _config(max_num_batched_tokens=16, mixed_batch_attention=mixed_attention)
    engine = Engine(tiny_llama, config)
    assert engine.runner.general.mixed_attention == mixed_attention
    finished: dict[str, list[int]] = {}
    ids: list[str] = []
    pending = list(prompts)
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 2 == 0:  # a new request joins every other step
            ids.append(engine.add_request(pending.pop(0), GREEDY))
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.output_token_ids
        steps += 1
    assert [finished[i] for i in ids] == expected


def test_preemption_by_recomputation_gives_the_same_tokens(tiny_llama: CausalLM) -> None:
    prompts = _prompts(2, (9, 14, 6, 11))
    expected = _one_at_a_time(tiny_llama, prompts)
    # 14 blocks of 4 tokens cannot hold four sequences of ~20 tokens: preemption must happen
    engine = Engine(tiny_llama, _config(num_kv_blocks=14))
    outputs = engine.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outputs] == expected
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == 14


def test_preemption_counter_is_visible(tiny_llama: CausalLM) -> None:
    engine = Engine(tiny_llama, _config(num_kv_blocks=14))
    ids = [engine.add_request(p, GREEDY) for p in _prompts(2, (9, 14, 6, 11))]
    seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        live = [engine.scheduler.requests[i] for i in ids if i in engine.scheduler.requests]
        seen = max([seen, *(r.num_preemptions for r in live)])
    assert seen >= 1 and len(ids) == 4


def test_kv_storage_comes_from_the_injected_factory(tiny_llama: CausalLM) -> None:
    made: list[tuple[int, ...]] = []

    def factory(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        made.append(shape)
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    config = _config(num_kv_blocks=20, kv_block_capacity=32)
    engine = Engine(tiny_llama, config, kv_storage_factory=factory)
    # [capacity + padding block, layers, K/V, kv heads, block size, head dim]
    assert made == [(33, 2, 2, 2, 4, 16)]
    assert engine.block_manager.num_usable_blocks == 20
    engine.grow_kv_blocks(list(range(20, 32)))
    assert engine.shrink_kv_blocks(4) == [31, 30, 29, 28]
    prompts = _prompts(3, (7, 13))
    outputs = engine.generate(prompts, GREEDY)  # NaN-initialised storage must not leak
    assert [o.output_token_ids for o in outputs] == _one_at_a_time(tiny_llama, prompts)


def test_bad_requests_and_configs_are_rejected(tiny_llama: CausalLM) -> None:
    engine = Engine(tiny_llama, _config())
    with pytest.raises(ValueError, match="max_model_len=128"):
        engine.add_request(list(range(1, 120)), SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
        engine.add_request([1, 512])
    with pytest.raises(UnknownAdapterError, match="'tenant-a'"):
        engine.add_request([1, 2], lora_name="tenant-a")
    with pytest.raises(EngineConfigError, match="max_num_batched_tokens=4 < max_num_seqs=8"):
        _config(max_num_batched_tokens=4)
    with pytest.raises(EngineConfigError, match="block_size=6"):
        _config(block_size=6)
    with pytest.raises(EngineConfigError, match="decode_blas_library='mkl'"):
        _config(decode_blas_library="mkl")
    for rows in (-1, 2.5, True):
        with pytest.raises(EngineConfigError, match=f"decode_programmatic_launch_rows={rows}"):
            _config(decode_programmatic_launch_rows=rows)
    assert _config(decode_programmatic_launch_rows=0).decode_programmatic_launch_rows == 0
    with pytest.raises(EngineConfigError, match="chunk_attention='flash'"):
        _config(chunk_attention="flash")


def test_mixed_graph_token_buckets() -> None:
    """Mixed-step graphs: 64, 128, 256, then every 256 below the token budget, then it."""
    assert _config(max_num_batched_tokens=2080).mixed_graph_token_sizes() == (
        64,
        128,
        256,
        512,
        768,
        1024,
        1280,
        1536,
        1792,
        2048,
        2080,
    )
    assert _config(max_num_batched_tokens=100).mixed_graph_token_sizes() == (64, 100)
    assert _config(max_num_batched_tokens=24).mixed_graph_token_sizes() == (24,)


def test_text_prompts_stop_strings_and_eos(tiny_dir: Path) -> None:
    engine = Engine.from_directory(tiny_dir, _config())
    free = engine.generate(["Hello world"], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert engine.tokenizer is not None
    assert free.text == engine.tokenizer.decode(free.output_token_ids, skip_special_tokens=True)
    assert len(free.text) > 3
    stop = free.text[2:4]
    cut = engine.generate(
        ["Hello world"], SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,))
    )[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]
    first = free.output_token_ids[0]
    by_token = engine.generate(
        ["Hello world"], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(first,))
    )[0]
    assert by_token.output_token_ids == [first] and by_token.finish_reason == "stop"


def test_runner_state_is_dropped_for_finished_aborted_and_idle_steps(tiny_llama: CausalLM) -> None:
    engine = Engine(tiny_llama, _config(max_num_seqs=2))
    for _ in range(4):  # more request cycles than runner rows (max_num_seqs + 1)
        first = engine.add_request([1, 2, 3], GREEDY)
        engine.add_request([4, 5], GREEDY)
        engine.step()
        engine.abort_request(first)
        while engine.has_unfinished_requests():
            engine.step()
        engine.step()  # idle step: finished ids still reach the runner
        assert engine.runner.states == {}
        assert engine.block_manager.num_free_blocks == 96


def test_fixed_shape_decode_batches_give_the_same_tokens(tiny_llama: CausalLM) -> None:
    """The bucketed decode path (padding, staged block tables, static buffers) on CPU."""
    prompts = _prompts(4, (3, 17, 40, 9, 26))
    dynamic = Engine(tiny_llama, _config()).generate(prompts, GREEDY)
    static_engine = Engine(
        tiny_llama, _config(static_decode_batches=True, cuda_graph_batch_sizes=(1, 2, 4))
    )
    assert static_engine.runner.static_decode
    # 5 sequences are padded into the bucket of 8 (max_num_seqs) for every decode step
    outputs = static_engine.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in dynamic]
    assert static_engine.runner.decode.num_static_decode_steps >= GREEDY.max_tokens - 2
