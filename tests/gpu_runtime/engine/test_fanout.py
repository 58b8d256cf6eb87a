"""Fan-out (`SamplingParams.n > 1`): one prefill forked into n children sharing its KV blocks,
copy on write of the partial block, seeds per child, preemption and abort; prompt logprobs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpu_runtime.engine import Engine, EngineConfig, RequestOutput, SamplingParams
from gpu_runtime.engine.fanout import child_id
from gpu_runtime.model import CausalLM

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=8, temperature=1.0, seed=7, detokenize=False, ignore_eos=True)


def _config(**overrides: object) -> EngineConfig:
    base: dict[str, object] = dict(
        num_kv_blocks=64,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=96,
    )
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


def _prompt(length: int, seed: int = 3) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 480, (length,), generator=gen).tolist()


def _run(engine: Engine) -> dict[str, RequestOutput]:
    """Step until idle; the final output of every request by id."""
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def _choices(engine: Engine, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    parent = engine.add_request(prompt, params)
    final = _run(engine)
    outs = sorted((o for o in final.values() if o.parent_id == parent), key=lambda o: o.index)
    assert [o.index for o in outs] == list(range(params.n))
    return [list(o.output_token_ids) for o in outs]


@pytest.mark.parametrize("length", [10, 9, 1])  # partial last block, block boundary, one token
def test_greedy_children_equal_the_single_answer(tiny_llama: CausalLM, length: int) -> None:
    prompt = _prompt(length)
    single = Engine(tiny_llama, _config()).generate([prompt], GREEDY)[0].output_token_ids
    engine = Engine(tiny_llama, _config())
    choices = _choices(engine, prompt, dataclasses.replace(GREEDY, n=3))
    assert choices == [single] * 3
    assert engine.block_manager.num_free_blocks == 64


def test_seeded_children_repeat_differ_and_child_zero_is_the_single_answer(
    tiny_llama: CausalLM,
) -> None:
    prompt = _prompt(10)
    params = dataclasses.replace(SAMPLED, n=3)
    first = _choices(Engine(tiny_llama, _config()), prompt, params)
    again = _choices(Engine(tiny_llama, _config()), prompt, params)
    single = Engine(tiny_llama, _config()).generate([prompt], SAMPLED)[0].output_token_ids
    assert first == again
    assert len({tuple(c) for c in first}) == 3
    assert first[0] == single


def test_fork_shares_blocks_and_copies_the_partial_one(tiny_llama: CausalLM) -> None:
    engine = Engine(tiny_llama, _config())
    bm, scheduler = engine.block_manager, engine.scheduler
    parent = engine.add_request(_prompt(10), dataclasses.replace(GREEDY, n=3))
    engine.step()  # prefills 9 tokens in blocks 0, 1, 2 (block 2 holds position 8 only)
    assert parent not in scheduler.requests
    kids = [scheduler.requests[child_id(parent, i)] for i in range(3)]
    assert [k.block_table for k in kids] == [[0, 1, 2], [0, 1], [0, 1]]
    assert [k.cow_source for k in kids] == [None, 2, 2]
    assert [k.num_computed_tokens for k in kids] == [9, 9, 9]
    assert [bm.ref_count(b) for b in range(4)] == [3, 3, 3, 0]
    plan = scheduler.schedule()
    assert plan.block_copies == [(2, 3), (2, 4)]
    assert [k.block_table for k in kids] == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert [bm.ref_count(b) for b in range(6)] == [3, 3, 1, 1, 1, 0]
    assert plan.num_scheduled_tokens == {k.request_id: 1 for k in kids}


def test_fork_on_a_block_boundary_copies_nothing(tiny_llama: CausalLM) -> None:
    engine = Engine(tiny_llama, _config())
    bm, scheduler = engine.block_manager, engine.scheduler
    parent = engine.add_request(_prompt(9), dataclasses.replace(GREEDY, n=3))
    engine.step()  # 8 tokens: blocks 0 and 1, both full
    kids = [scheduler.requests[child_id(parent, i)] for i in range(3)]
    assert [k.block_table for k in kids] == [[0, 1]] * 3
    assert [bm.ref_count(b) for b in range(3)] == [3, 3, 0]
    plan = scheduler.schedule()
    assert plan.block_copies == []
    assert [k.block_table for k in kids] == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]


def test_children_free_every_block_when_done_and_on_abort(tiny_llama: CausalLM) -> None:
    engine = Engine(tiny_llama, _config())
    parent = engine.add_request(_prompt(10), dataclasses.replace(GREEDY, n=3))
    engine.step()
    engine.step()
    engine.abort_request(parent)  # the parent's id aborts every child
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == 64
    queued = engine.add_request(_prompt(10), dataclasses.replace(GREEDY, n=2))
    engine.abort_request(queued)  # before the fork: the parent itself
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == 64


def test_a_preempted_child_is_recomputed_from_its_own_tokens(tiny_llama: CausalLM) -> None:
    prompt = _prompt(10)
    params = dataclasses.replace(GREEDY, max_tokens=14)
    single = Engine(tiny_llama, _config()).generate([prompt], params)[0].output_token_ids
    # 3 children of 24 tokens need 2 shared + 3 * 4 = 14 blocks: 10 cannot hold them all
    engine = Engine(tiny_llama, _config(num_kv_blocks=10))
    parent = engine.add_request(prompt, dataclasses.replace(params, n=3))
    preempted = 0
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        live = engine.scheduler.requests.values()
        preempted = max([preempted, *(r.num_preemptions for r in live)])
    assert preempted >= 1
    outs = [final[child_id(parent, i)] for i in range(3)]
    assert [o.output_token_ids for o in outs] == [single] * 3
    assert engine.block_manager.num_free_blocks == 10


def test_fan_out_is_checked_against_the_limits(tiny_llama: CausalLM) -> None:
    engine = Engine(tiny_llama, _config(num_kv_blocks=16))
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request(_prompt(4), dataclasses.replace(GREEDY, n=9))
    with pytest.raises(ValueError, match="KV blocks"):  # one sequence of 70 tokens: 18 > 16
        engine.add_request(_prompt(10), dataclasses.replace(GREEDY, n=5, max_tokens=60))
    # the sequences together need 2 shared + 5 * 4 = 22 blocks, more than 16: they run in turn
    params = dataclasses.replace(GREEDY, n=5, max_tokens=6)
    one = dataclasses.replace(params, n=1)
    single = Engine(tiny_llama, _config()).generate([_prompt(10)], one)[0].output_token_ids
    assert _choices(engine, _prompt(10), params) == [single] * 5


def _reference_logprobs(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    """log-softmax of HF's full forward over `tokens`: row p predicts token p + 1."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**model.config.to_hf_config())
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    hf.load_state_dict(model.state_dict(), strict=False)
    hf.tie_weights()
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([tokens])).logits[0]
    return logits.float().log_softmax(dim=-1)


@pytest.mark.parametrize("n", [1, 2])
def test_prompt_logprobs_equal_a_full_forward_across_chunks(tiny_llama: CausalLM, n: int) -> None:
    prompt = _prompt(21)
    reference = _reference_logprobs(tiny_llama, prompt)
    engine = Engine(tiny_llama, _config(max_num_batched_tokens=8))  # three prefill chunks
    params = dataclasses.replace(GREEDY, n=n, prompt_logprobs=2, max_tokens=2)
    engine.add_request(prompt, params)
    outs = list(_run(engine).values())
    assert len(outs) == n
    got = outs[0].prompt_logprobs
    assert got is not None and got[0] is None and len(got) == len(prompt)
    assert all(o.prompt_logprobs is got for o in outs)  # one list, shared by the children
    for position in range(1, len(prompt)):
        entry = got[position]
        assert entry is not None and entry.token_id == prompt[position]
        expected = reference[position - 1]
        assert entry.logprob == pytest.approx(float(expected[prompt[position]]), abs=1e-4)
        values, ids = expected.topk(2)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_prompt_logprobs_survive_a_preemption_once(tiny_llama: CausalLM) -> None:
    prompts = [_prompt(9, seed=s) for s in range(4)]
    engine = Engine(tiny_llama, _config(num_kv_blocks=14))
    params = dataclasses.replace(GREEDY, prompt_logprobs=0, max_tokens=12)
    ids = [engine.add_request(p, params) for p in prompts]
    final = _run(engine)
    for rid, prompt in zip(ids, prompts, strict=True):
        got = final[rid].prompt_logprobs
        assert got is not None and len(got) == len(prompt)
        assert [e.token_id for e in got[1:] if e is not None] == prompt[1:]


def test_sampled_children_logprobs_equal_a_full_forward(tiny_llama: CausalLM) -> None:
    """Each child's sampled-token logprobs (what best_of ranks by) are those of a full forward
    over its own tokens: the shared and copied blocks hold the prompt's KV."""
    prompt = _prompt(10)
    engine = Engine(tiny_llama, _config())
    engine.add_request(prompt, dataclasses.replace(SAMPLED, n=3, logprobs=0))
    logprobs: dict[int, list[float]] = {0: [], 1: [], 2: []}
    tokens: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            logprobs[out.index] += [lp.logprob for lp in out.new_logprobs]
            tokens[out.index] = list(out.output_token_ids)
    for index in range(3):
        reference = _reference_logprobs(tiny_llama, prompt + tokens[index])
        rows = range(len(prompt) - 1, len(prompt) - 1 + len(tokens[index]))
        expected = [float(reference[r, t]) for r, t in zip(rows, tokens[index], strict=True)]
        assert logprobs[index] == pytest.approx(expected, abs=1e-4)


def test_generate_returns_the_sequences_prompt_major(tiny_llama: CausalLM) -> None:
    prompts = [_prompt(10, seed=1), _prompt(6, seed=2)]
    singles = Engine(tiny_llama, _config()).generate(prompts, GREEDY)
    outs = Engine(tiny_llama, _config()).generate(prompts, dataclasses.replace(GREEDY, n=2))
    assert [o.output_token_ids for o in outs] == [
        s.output_token_ids for s in singles for _ in range(2)
    ]
    assert [o.index for o in outs] == [0, 1, 0, 1]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalized_children_equal_the_single_answer(
    tiny_llama: CausalLM, async_scheduling: bool
) -> None:
    """Each child's penalty counts start from the prompt and follow its own tokens."""
    prompt = _prompt(10)
    params = dataclasses.replace(
        GREEDY, max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2
    )
    config = _config(async_scheduling=async_scheduling, static_decode_batches=True,
                     cuda_graph_batch_sizes=(1, 2, 4, 8))  # fmt: skip
    single = Engine(tiny_llama, config).generate([prompt], params)[0].output_token_ids
    outs = Engine(tiny_llama, config).generate([prompt], dataclasses.replace(params, n=3))
    assert [o.output_token_ids for o in outs] == [single] * 3


def test_a_child_preempted_before_its_copy_drops_its_shared_references(
    tiny_llama: CausalLM,
) -> None:
    prompt = _prompt(10)
    params = dataclasses.replace(GREEDY, max_tokens=2)
    single = Engine(tiny_llama, _config()).generate([prompt], params)[0].output_token_ids
    engine = Engine(tiny_llama, _config(num_kv_blocks=4))  # one block free after the prefill
    bm, scheduler = engine.block_manager, engine.scheduler
    parent = engine.add_request(prompt, dataclasses.replace(params, n=3))
    engine.step()
    kids = [scheduler.requests[child_id(parent, i)] for i in range(3)]
    preview = scheduler.preview()
    assert preview.preempted_request_ids == (kids[2].request_id,) and preview.new_blocks == 1
    engine.step()  # child 1 takes the free block for its copy, child 2 is preempted
    assert kids[1].block_table == [0, 1, 3] and kids[1].cow_source is None
    assert kids[2].num_preemptions == 1 and kids[2].block_table == []
    assert kids[2].cow_source is None
    assert [bm.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    final = _run(engine)
    assert [final[k.request_id].output_token_ids for k in kids] == [single] * 3
    assert bm.num_free_blocks == 4


def test_a_fan_out_starts_on_a_cached_prefix_and_prompt_logprobs_skip_it(
    tiny_llama: CausalLM,
) -> None:
    prompt = _prompt(14)  # 13 tokens prefilled by a parent: 3 full blocks of 4
    engine = Engine(tiny_llama, _config(enable_prefix_caching=True))
    single = engine.generate([prompt], GREEDY)[0]
    outs = engine.generate([prompt], dataclasses.replace(GREEDY, n=2))
    # a parent leaves its last prompt token and one more to compute: (13 - 1) // 4 blocks hit
    assert [o.num_cached_tokens for o in outs] == [12, 12]
    assert [o.output_token_ids for o in outs] == [single.output_token_ids] * 2
    asked = engine.generate([prompt], dataclasses.replace(GREEDY, n=2, prompt_logprobs=0))
    assert [o.num_cached_tokens for o in asked] == [0, 0]  # every position computed
    got = asked[0].prompt_logprobs
    assert got is not None and len(got) == len(prompt) and all(e is not None for e in got[1:])
