"""The sampler's logit processors (penalties, logit bias, min_p, min_tokens) on fixed logits,
each against a per-row reference written in plain Python (vLLM's semantics)."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_runtime.engine import SamplingParams, SamplingParamsError
from gpu_runtime.engine.logits_processing import apply_min_p
from gpu_runtime.engine.runner_types import _RequestState
from gpu_runtime.engine.sampler import Sampler, SamplingBatch
from gpu_runtime.engine.token_counts import TokenCounts

VOCAB = 40
EOS = (3,)


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=gen) * 3


def _reference(
    row: list[float], prompt: list[int], output: list[int], p: SamplingParams
) -> list[float]:
    """One row processed as vLLM does, token by token."""
    row = list(row)
    for token, bias in p.logit_bias:
        row[token] += bias
    if len(output) < p.min_tokens:
        for token in set(p.stop_token_ids) | set(EOS):
            row[token] = -math.inf
    for token in range(VOCAB):
        count = output.count(token)
        if token in prompt or count:
            value = row[token]
            rep = p.repetition_penalty
            row[token] = value / rep if value > 0 else value * rep
        row[token] -= p.frequency_penalty * count
        row[token] -= p.presence_penalty * (count > 0)
    return row


def _state(prompt: list[int], output: list[int], params: SamplingParams, row: int):
    return _RequestState(prompt + output, [], 0, params, len(output), row)


def _processed(
    logits: torch.Tensor, params: list[SamplingParams], prompts, outputs
) -> torch.Tensor:
    """The sampler's processed logits, read through greedy sampling of one-hot shifts: the
    plan is applied exactly as `Sampler.sample` applies it."""
    from gpu_runtime.engine.logits_processing import LogitsPlan

    batch = SamplingBatch(params, [len(o) for o in outputs])
    plan = LogitsPlan.build(params, batch.output_indices, EOS)
    plan.stage(torch.device("cpu"))
    counts = TokenCounts(torch.device("cpu"), len(params))
    states = [_state(prompts[i], outputs[i], params[i], i) for i in batch.penalised_rows]
    rows = counts.prepare(states, VOCAB)
    assert counts.output is not None and counts.prompt is not None
    return plan.apply(logits, (counts.output, counts.prompt, rows))


CASES = [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(frequency_penalty=-0.5, presence_penalty=-1.0),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(logit_bias=((5, 4.0), (9, -100.0))),
    SamplingParams(min_tokens=4, stop_token_ids=(7, 8)),
    SamplingParams(
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.3,
        logit_bias=((1, 2.0),),
        min_tokens=9,
    ),
]


@pytest.mark.parametrize("params", CASES)
def test_each_processor_matches_the_reference(params: SamplingParams) -> None:
    logits = _logits(1, seed=1)
    prompt, output = [1, 2, 2, 5, 11], [5, 7, 7, 7, 20]
    got = _processed(logits, [params], [prompt], [output])[0].tolist()
    want = _reference(logits[0].tolist(), prompt, output, params)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_presence_and_frequency_count_only_the_output_repetition_also_the_prompt() -> None:
    logits = torch.full((3, VOCAB), 2.0)
    params = [
        SamplingParams(presence_penalty=1.0),
        SamplingParams(frequency_penalty=1.0),
        SamplingParams(repetition_penalty=2.0),
    ]
    got = _processed(logits, params, [[4, 4, 6]] * 3, [[6, 6, 9]] * 3)
    assert got[0, 4] == 2.0 and got[0, 6] == 1.0 and got[0, 9] == 1.0
    assert got[1, 4] == 2.0 and got[1, 6] == 0.0 and got[1, 9] == 1.0
    assert got[2, 4] == 1.0 and got[2, 6] == 1.0 and got[2, 9] == 1.0 and got[2, 0] == 2.0


def test_a_mixed_batch_gives_each_row_what_it_gets_alone() -> None:
    rows = len(CASES) + 2
    logits = _logits(rows, seed=2)
    params = [SamplingParams(), *CASES, SamplingParams(temperature=0.0)]
    prompts = [[row, row + 1, 3] for row in range(rows)]
    outputs = [[row % 5, 7, 7] for row in range(rows)]
    together = _processed(logits, params, prompts, outputs)
    for row in range(rows):
        alone = _processed(logits[row : row + 1], [params[row]], [prompts[row]], [outputs[row]])
        assert torch.equal(together[row], alone[0]), row
    assert torch.equal(together[0], logits[0]) and torch.equal(together[-1], logits[-1])


def test_min_tokens_masks_stops_until_reached() -> None:
    params = SamplingParams(min_tokens=2, stop_token_ids=(8,), temperature=0.0)
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = logits[0, 8] = 50.0
    sampler = Sampler(torch.device("cpu"))
    sampler.eos_token_ids = EOS
    picked = [sampler.sample(logits, SamplingBatch([params], [i])).token_ids.item() for i in (0, 1)]
    assert picked[0] not in (3, 8) and picked[1] not in (3, 8)
    assert sampler.sample(logits, SamplingBatch([params], [2])).token_ids.item() == 3


def test_logit_bias_forces_a_token_for_greedy_and_sampled_rows() -> None:
    logits = _logits(2, seed=3)
    params = [
        SamplingParams(temperature=0.0, logit_bias=((17, 100.0),)),
        SamplingParams(temperature=1.0, seed=4, logit_bias=((17, 100.0),)),
    ]
    out = Sampler(torch.device("cpu")).sample(logits, SamplingBatch(params, [0, 0]))
    assert out.token_ids.tolist() == [17, 17]


def test_min_p_drops_tokens_below_min_p_times_the_top_probability() -> None:
    logits = _logits(2, seed=5) / 3
    temperature = torch.tensor([0.7, 1.3])
    scaled = logits / temperature[:, None]
    kept = apply_min_p(scaled, torch.log(torch.tensor([0.2, 0.05])))
    probs = scaled.softmax(-1)
    reference = probs < torch.tensor([[0.2], [0.05]]) * probs.amax(-1, keepdim=True)
    assert torch.equal(kept.isinf(), reference)
    sampler = Sampler(torch.device("cpu"), seed=1)
    params = [SamplingParams(temperature=0.7, min_p=0.2), SamplingParams(temperature=1.3)]
    allowed = set((~reference[0]).nonzero()[:, 0].tolist())
    draws = [sampler.sample(logits, SamplingBatch(params, [i, i])) for i in range(200)]
    first = {d.token_ids[0].item() for d in draws}
    second = {d.token_ids[1].item() for d in draws}
    assert len(allowed) > 2 and first <= allowed and len(first) > 1
    assert not second <= allowed  # the row without min_p is not filtered


def test_seeded_rows_with_processors_do_not_depend_on_the_batch() -> None:
    logits = _logits(3, seed=6)
    logits[2] = logits[1]
    p = SamplingParams(seed=9, logit_bias=((2, 3.0),), min_p=0.01, temperature=1.1)
    sampler = Sampler(torch.device("cpu"))
    together = sampler.sample(logits, SamplingBatch([SamplingParams(), p, p], [0, 4, 4]))
    alone = Sampler(torch.device("cpu"), seed=5).sample(logits[1:2], SamplingBatch([p], [4]))
    assert together.token_ids[1] == together.token_ids[2] == alone.token_ids[0]


def test_logprobs_are_those_of_the_raw_logits() -> None:
    logits = _logits(1, seed=7)
    params = SamplingParams(temperature=0.0, logit_bias=((11, 100.0),), logprobs=3)
    out = Sampler(torch.device("cpu")).sample(logits, SamplingBatch([params], [0]))
    raw = logits.log_softmax(-1)
    assert out.token_ids.item() == 11
    assert out.logprobs is not None and out.logprobs.item() == pytest.approx(raw[0, 11].item())
    assert out.top_logprobs is not None
    assert torch.allclose(out.top_logprobs[0], raw[0].topk(3).values)


def test_penalised_rows_without_counts_are_refused() -> None:
    batch = SamplingBatch([SamplingParams(presence_penalty=1.0)], [0])
    with pytest.raises(ValueError, match="no token counts"):
        Sampler(torch.device("cpu")).sample(_logits(1), batch)


def test_default_rows_build_no_plan() -> None:
    sampler = Sampler(torch.device("cpu"))
    batch = SamplingBatch([SamplingParams(), SamplingParams(temperature=0.0, top_k=3)], [0, 0])
    assert not batch.needs_processing and batch.penalised_rows == []
    sampler.sample(_logits(2), batch)
    assert sampler.num_processed_samples == 0


def test_counts_follow_sampled_tokens_and_rebuild_for_a_new_state() -> None:
    counts = TokenCounts(torch.device("cpu"), 3)
    params = SamplingParams(frequency_penalty=1.0)
    first = _state([1, 2], [4], params, row=2)
    rows = counts.prepare([first], VOCAB)
    counts.add(rows, torch.tensor([4]))
    assert counts.output is not None and counts.prompt is not None
    assert counts.output[2, 4] == 2 and counts.prompt[2, 1] and not counts.prompt[2, 4]
    counts.prepare([first], VOCAB)  # same state: kept
    assert counts.output[2, 4] == 2
    counts.prepare([_state([9], [], params, row=2)], VOCAB)  # the row reused
    assert counts.output[2].sum() == 0 and counts.prompt[2].nonzero()[:, 0].tolist() == [9]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty=2.5"),
        ({"frequency_penalty": -2.1}, "frequency_penalty=-2.1"),
        ({"repetition_penalty": 0.0}, "repetition_penalty=0.0"),
        ({"min_p": 1.5}, "min_p=1.5"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens=20"),
        ({"logit_bias": ((3, 101.0),)}, r"logit_bias\[3\]=101.0"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias token id -1"),
        ({"logit_bias": ((3, 1.0), (3, 2.0))}, "more than once"),
        ({"stop_token_ids": (-4,)}, "stop_token_ids"),
    ],
)
def test_invalid_processor_params_name_field_and_value(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(SamplingParamsError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_vocab_check_names_the_ids() -> None:
    with pytest.raises(SamplingParamsError, match=r"logit_bias token ids \[40\]"):
        SamplingParams(logit_bias=((40, 1.0),)).check_vocab(VOCAB)
    with pytest.raises(SamplingParamsError, match=r"stop_token_ids \[99\]"):
        SamplingParams(stop_token_ids=(99,)).check_vocab(VOCAB)
    SamplingParams(logit_bias=((39, 1.0),), logprobs=20).check_vocab(VOCAB)
