from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from gpu_runtime.engine import Engine, EngineConfig, SamplingParams, SamplingParamsError
from gpu_runtime.engine.sampler import FUSED_MIN_ROWS, Sampler, SamplingBatch, apply_top_k_top_p
from gpu_runtime.model import CausalLM

CPU = torch.device("cpu")


def _batch(*params: SamplingParams) -> SamplingBatch:
    return SamplingBatch(list(params), [0] * len(params))


def test_top_k_and_top_p_masks() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    masked = apply_top_k_top_p(logits, torch.tensor([2, 5, 5]), torch.tensor([1.0, 0.7, 0.71]))
    kept = torch.isfinite(masked)
    assert kept[0].tolist() == [True, True, False, False, False]  # top-k 2
    assert kept[1].tolist() == [True, True, False, False, False]  # 0.5 + 0.2 reaches 0.7
    assert kept[2].tolist() == [True, True, True, False, False]  # 0.71 needs the third
    torch.testing.assert_close(masked[kept], logits[kept])


def test_greedy_rows_and_sampled_rows_in_one_batch() -> None:
    sampler = Sampler(CPU, seed=0)
    logits = torch.randn(4, 50)
    out = sampler.sample(
        logits,
        _batch(
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=1.0, top_k=1),
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.7, top_p=1e-6),
        ),
    )
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_per_request_seed_is_independent_of_batch_and_position() -> None:
    logits = torch.randn(3, 100)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = Sampler(CPU, seed=0).sample(logits[1:2], _batch(seeded)).token_ids
    mixed = (
        Sampler(CPU, seed=99)
        .sample(logits, _batch(SamplingParams(), seeded, SamplingParams()))
        .token_ids
    )
    assert mixed[1] == alone[0]
    draws = {
        int(Sampler(CPU, seed=0).sample(logits[1:2], SamplingBatch([seeded], [step])).token_ids[0])
        for step in range(20)
    }
    assert len(draws) > 1  # a different noise draw for each output index


def test_sampling_follows_the_distribution() -> None:
    sampler = Sampler(CPU, seed=5)
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(4000, 3).contiguous()
    tokens = sampler.sample(logits, _batch(*[SamplingParams()] * 4000)).token_ids
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)


def test_logprobs_are_log_softmax_of_raw_logits() -> None:
    logits = torch.randn(2, 30)
    out = Sampler(CPU).sample(
        logits, _batch(SamplingParams(temperature=0.0, logprobs=3), SamplingParams(logprobs=0))
    )
    reference = logits.log_softmax(-1)
    assert out.logprobs is not None and out.top_token_ids is not None
    torch.testing.assert_close(out.logprobs, reference.gather(-1, out.token_ids[:, None])[:, 0])
    assert out.top_token_ids[0].tolist() == reference[0].topk(3).indices.tolist()


def test_engine_seeded_requests_repeat_and_logprobs_reach_outputs(tiny_llama: CausalLM) -> None:
    config = EngineConfig(
        num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64
    )
    params = SamplingParams(
        max_tokens=8,
        temperature=0.9,
        top_p=0.9,
        seed=7,
        logprobs=2,
        detokenize=False,
        ignore_eos=True,
    )
    first = Engine(tiny_llama, config).generate([[5, 6, 7]], params)[0]
    again = Engine(tiny_llama, dataclasses.replace(config, seed=3))
    second = again.generate([[9, 9], [5, 6, 7]], params)[1]
    assert first.output_token_ids == second.output_token_ids
    engine = Engine(tiny_llama, config)
    rid = engine.add_request([5, 6, 7], params)
    logprobs = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            logprobs.extend(out.new_logprobs)
    assert [lp.token_id for lp in logprobs] == first.output_token_ids
    assert all(lp.logprob <= 0 and len(lp.top) == 2 for lp in logprobs)
    assert all(math.isfinite(lp.logprob) for lp in logprobs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens=0"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"stop": ("x",), "detokenize": False}, "stop strings need detokenize"),
    ],
)
def test_invalid_sampling_params(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(SamplingParamsError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_fused_sampling_parameters_are_staged_per_row() -> None:
    """What the CUDA one-pass kernel gets: inverse temperature (0 = greedy) and a Philox seed
    per row; a seeded request's seed depends on its seed and output index only."""
    sampler = Sampler(CPU, seed=3, fused=True)
    seeded = SamplingParams(temperature=0.5, seed=11)
    rows = [SamplingParams(temperature=0.0), seeded, SamplingParams(temperature=2.0)]
    inv_temp, staged = sampler._stage_fused(SamplingBatch(rows, [0, 4, 0]))
    assert inv_temp.tolist() == [0.0, 2.0, 0.5]
    seeds = staged.clone()  # the staging buffers are reused every step
    again_inv, again = sampler._stage_fused(SamplingBatch([rows[2], seeded], [0, 4]))
    assert again[1] == seeds[1]  # same seed and output index, other row and step
    assert again[0] != seeds[2]  # unseeded rows: a new step seed every step
    assert again_inv.tolist() == [0.5, 2.0]
    _, later = sampler._stage_fused(SamplingBatch([seeded], [5]))
    assert later[0] != seeds[1]
    replay = Sampler(CPU, seed=3, fused=True)
    assert replay._stage_fused(SamplingBatch(rows, [0, 4, 0]))[1].tolist() == seeds.tolist()


def test_batches_below_fused_min_rows_keep_the_torch_sampling_passes() -> None:
    """Below `fused_min_rows` rows the sampler keeps the torch passes (the only ones on CPU);
    by default (FUSED_MIN_ROWS) every batch size takes the split-vocabulary kernels."""
    sampler = Sampler(CPU, seed=0, fused=True, fused_min_rows=8)
    out = sampler.sample(torch.randn(4, 50), _batch(*[SamplingParams(temperature=0.8)] * 4))
    assert out.token_ids.shape == (4,) and sampler.num_fused_samples == 0
    assert Sampler(CPU, seed=0).fused_min_rows == FUSED_MIN_ROWS == 1
