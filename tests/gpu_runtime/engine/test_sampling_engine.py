"""The logit processors through the engine on a tiny model: logit_bias, min_tokens,
stop_token_ids, ignore_eos, and penalties against a reference loop over HF's forward (sync and
async scheduling: the counts must include the token of the step in flight)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.model import CausalLM, build_random_model
from gpu_runtime.model.tiny import tiny_config

EOS = 3


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return build_random_model(tiny_config("llama", eos_token_id=EOS), seed=13)


def _config(async_scheduling: bool = False, num_kv_blocks: int = 96) -> EngineConfig:
    return EngineConfig(
        num_kv_blocks=num_kv_blocks,
        block_size=4,
        max_num_seqs=5,
        max_num_batched_tokens=24,
        max_model_len=128,
        static_decode_batches=True,
        cuda_graph_batch_sizes=(1, 2, 4),
        async_scheduling=async_scheduling,
    )


def _run(model: CausalLM, prompts: list[list[int]], params: list[SamplingParams], **kw: Any):
    """Final outputs in prompt order, the engine, and the most preemptions of one request."""
    engine = Engine(model, _config(**kw))
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    final = {}
    preempted = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        running = engine.scheduler.requests.values()
        preempted = max([preempted, *(r.num_preemptions for r in running)])
    return [final[i] for i in ids], engine, preempted


def _reference(model: CausalLM, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding over HF's forward with vLLM's penalties applied in plain Python."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**model.config.to_hf_config())
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    hf.load_state_dict(model.state_dict(), strict=False)
    hf.tie_weights()
    output: list[int] = []
    for _ in range(params.max_tokens):
        with torch.no_grad():
            row = hf(torch.tensor([prompt + output])).logits[0, -1].tolist()
        for token, bias in params.logit_bias:
            row[token] += bias
        for token in range(len(row)):
            count = output.count(token)
            if token in prompt or count:
                rep = params.repetition_penalty
                row[token] = row[token] / rep if row[token] > 0 else row[token] * rep
            row[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
        output.append(max(range(len(row)), key=row.__getitem__))
    return output


PENALISED = [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, frequency_penalty=1.5),
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.6),
    SamplingParams(
        max_tokens=12,
        temperature=0.0,
        ignore_eos=True,
        presence_penalty=1.2,
        logit_bias=((7, 1.0), (8, -2.0)),
    ),
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
]
PROMPTS = [[5, 9, 9, 21, 40], [11, 12, 13], [100, 101, 102, 103, 104, 105, 106], [60, 61]]


@pytest.mark.parametrize(
    ("async_scheduling", "num_kv_blocks"), [(False, 96), (True, 96), (False, 14), (True, 14)]
)
def test_penalties_match_the_reference_loop(
    model: CausalLM, async_scheduling: bool, num_kv_blocks: int
) -> None:
    """Also with too few KV blocks for all of them (preemptions: counts rebuilt on readmission).
    The last prompt holds the plain greedy continuation of another: the repetition penalty of
    its prompt tokens changes what greedy picks."""
    plain = _reference(model, PROMPTS[1], PENALISED[3])
    prompts = [*PROMPTS, PROMPTS[1] + plain[:6]]
    all_params = [*PENALISED, dataclasses.replace(PENALISED[1], repetition_penalty=2.0)]
    outputs, engine, preempted = _run(
        model, prompts, all_params, async_scheduling=async_scheduling, num_kv_blocks=num_kv_blocks
    )
    assert outputs[-1].output_token_ids[:4] != plain[6:10]
    for prompt, params, out in zip(prompts, all_params, outputs, strict=True):
        assert out.output_token_ids == _reference(model, prompt, params)
    if async_scheduling:
        assert engine.runner.num_overlapped_steps >= 4
    assert (preempted > 0) == (num_kv_blocks < 96)


def test_penalties_change_what_greedy_picks(model: CausalLM) -> None:
    plain = dataclasses.replace(PENALISED[0], frequency_penalty=0.0)
    outputs, _, _ = _run(model, [PROMPTS[0]] * 2, [plain, PENALISED[0]])
    assert outputs[0].output_token_ids != outputs[1].output_token_ids
    assert len(set(outputs[1].output_token_ids)) > len(set(outputs[0].output_token_ids))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bias_min_tokens_stop_ids_and_ignore_eos(model: CausalLM, async_scheduling: bool) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
    to_eos = dataclasses.replace(greedy, logit_bias=((EOS, 100.0),))
    params = [
        dataclasses.replace(greedy, logit_bias=((42, 100.0),), ignore_eos=True),
        to_eos,
        dataclasses.replace(to_eos, min_tokens=5),
        dataclasses.replace(greedy, logit_bias=((77, 100.0),), stop_token_ids=(77,)),
        dataclasses.replace(to_eos, ignore_eos=True, max_tokens=4),
    ]
    prompts = [[5, 6, 7]] * len(params)
    outputs, _, _ = _run(model, prompts, params, async_scheduling=async_scheduling)
    forced, eos, late_eos, stop_id, ignored = outputs
    assert forced.output_token_ids == [42] * 8 and forced.finish_reason == "length"
    assert eos.output_token_ids == [EOS] and eos.finish_reason == "stop"
    assert len(late_eos.output_token_ids) == 6 and late_eos.output_token_ids[-1] == EOS
    assert EOS not in late_eos.output_token_ids[:5] and late_eos.finish_reason == "stop"
    assert stop_id.output_token_ids == [77] and stop_id.finish_reason == "stop"
    assert ignored.output_token_ids == [EOS] * 4 and ignored.finish_reason == "length"


def test_add_request_checks_ids_against_the_vocab(model: CausalLM) -> None:
    engine = Engine(model, _config())
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias token ids \[{vocab}\]"):
        engine.add_request([1, 2], SamplingParams(logit_bias=((vocab, 1.0),)))
    with pytest.raises(ValueError, match=rf"stop_token_ids \[{vocab + 1}\]"):
        engine.add_request([1, 2], SamplingParams(stop_token_ids=(vocab + 1,)))
    assert not engine.has_unfinished_requests()
