"""CUDA-only: fan-out and prompt logprobs on the graph engine (the copy-on-write copy on the
device, children on the bucketed decode graphs, prompt rows through the fused step)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.model import CausalLM
from tests.gpu_runtime.small_model import small_cuda_model

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, detokenize=False, ignore_eos=True)


def _engine(model: CausalLM, **overrides: object) -> Engine:
    base: dict[str, object] = dict(
        num_kv_blocks=256,
        block_size=16,
        max_num_seqs=8,
        max_model_len=256,
        max_num_batched_tokens=64,
        device="cuda",
    )
    engine = Engine(model, EngineConfig(**{**base, **overrides}))  # type: ignore[arg-type]
    assert engine.capture_cuda_graphs() == [8, 4, 2, 1]
    return engine


def _finals(engine: Engine) -> dict[str, list[int]]:
    final: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = list(out.output_token_ids)
    return final


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("length", [37, 33])  # partial last block (copied), block boundary
def test_greedy_children_on_graphs_equal_the_single_answer(
    async_scheduling: bool, length: int
) -> None:
    model = small_cuda_model()
    prompt = torch.randint(1, 1000, (length,), generator=torch.Generator().manual_seed(2)).tolist()
    single = _engine(model, async_scheduling=async_scheduling)
    rid = single.add_request(prompt, GREEDY)
    expected = _finals(single)[rid]
    engine = _engine(model, async_scheduling=async_scheduling)
    engine.add_request(prompt, dataclasses.replace(GREEDY, n=4))
    finals = _finals(engine)
    assert sorted(finals.values()) == [expected] * 4
    assert engine.runner.decode.num_static_decode_steps >= GREEDY.max_tokens - 1  # the graphs
    assert engine.block_manager.num_free_blocks == 256


@pytest.mark.parametrize("mixed_graphs", [False, True])
def test_prompt_logprobs_through_the_fused_step_match_a_full_forward(mixed_graphs: bool) -> None:
    model = small_cuda_model()
    prompt = torch.randint(1, 1000, (90,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = _engine(model, mixed_cuda_graphs=mixed_graphs)  # 64-token chunks: two of them
    engine.add_request(prompt, dataclasses.replace(GREEDY, prompt_logprobs=3, max_tokens=2, n=2))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    got = outs[0].prompt_logprobs
    assert got is not None and got[0] is None and len(got) == len(prompt)

    reference = _reference(model, prompt)
    values = [e.logprob for e in got[1:] if e is not None]
    expected = [float(reference[p - 1, prompt[p]]) for p in range(1, len(prompt))]
    assert values == pytest.approx(expected, abs=0.1)  # bf16
    assert [e.token_id for e in got[1:] if e is not None] == prompt[1:]


def _reference(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    """log-softmax of a fresh engine-free forward: HF over the same bf16 weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**model.config.to_hf_config())
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).cuda().eval()
    hf.load_state_dict(model.state_dict(), strict=False)
    hf.tie_weights()
    with torch.no_grad():
        return hf(input_ids=torch.tensor([tokens], device="cuda")).logits[0].float().log_softmax(-1)
