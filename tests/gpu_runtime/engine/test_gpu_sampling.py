"""CUDA-only: the logit processors on the fused path and in the CUDA-graph decode path. Rows
with penalties or logit bias beside plain rows in one fused-kernel batch; the engine with graphs
(sync and async scheduling) against the same engine with graphs off. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.engine.sampler import Sampler, SamplingBatch
from gpu_runtime.model import build_random_model
from gpu_runtime.model.tiny import tiny_config

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")


def test_fused_rows_beside_processed_rows_get_what_they_get_alone() -> None:
    vocab = 4096
    gen = torch.Generator(device=DEV).manual_seed(0)
    logits = torch.randn(4, vocab, device=DEV, generator=gen, dtype=torch.bfloat16)
    plain = SamplingParams(temperature=0.9, seed=5)
    biased = SamplingParams(temperature=0.9, seed=5, logit_bias=((11, 100.0),))
    penalised = SamplingParams(temperature=0.9, seed=6, frequency_penalty=2.0)
    greedy = SamplingParams(temperature=0.0, logit_bias=((12, 100.0),))
    params = [plain, biased, penalised, greedy]
    counts = torch.zeros(1, vocab, dtype=torch.int32, device=DEV)
    counts[0, logits[2].float().argmax()] = 50  # the top token is penalised away
    prompt = torch.zeros(1, vocab, dtype=torch.bool, device=DEV)
    sampler = Sampler(DEV)
    rows = torch.zeros(1, dtype=torch.int64, device=DEV)
    together = sampler.sample(logits, SamplingBatch(params, [3] * 4), (counts, prompt, rows))
    assert sampler.num_fused_samples == 1 and sampler.num_processed_samples == 1
    alone = Sampler(DEV).sample(logits[:1], SamplingBatch([plain], [3]))
    tokens = together.token_ids.tolist()
    assert tokens[0] == alone.token_ids.item()
    assert tokens[1] == 11 and tokens[3] == 12
    assert tokens[2] != int(logits[2].float().argmax())


def test_triton_penalties_equal_the_torch_form_on_cuda() -> None:
    from gpu_runtime.engine.logits_processing import LogitsPlan

    vocab, rows = 128256, 6
    gen = torch.Generator(device=DEV).manual_seed(1)
    logits = torch.randn(rows, vocab, device=DEV, generator=gen, dtype=torch.bfloat16) * 4
    counts = torch.randint(0, 3, (9, vocab), device=DEV, generator=gen, dtype=torch.int32)
    counts *= torch.rand(9, vocab, device=DEV, generator=gen) < 0.05
    prompt = torch.rand(9, vocab, device=DEV, generator=gen) < 0.02
    penalised = SamplingParams(presence_penalty=0.4, frequency_penalty=0.2, repetition_penalty=1.2)
    params = [penalised, SamplingParams(), penalised, SamplingParams(logit_bias=((3, 1.0),))] * 2
    params = params[:rows]
    plan = LogitsPlan.build(params, [0] * rows, ())
    plan.stage(DEV)
    which = torch.tensor([8, 2, 5], device=DEV)[: plan.num_penalised]
    fused = plan.apply(logits, (counts, prompt, which), fused=True)
    eager = plan.apply(logits, (counts, prompt, which), fused=False)
    torch.testing.assert_close(fused, eager, rtol=1e-6, atol=1e-5)
    assert not torch.equal(fused, logits.float())


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_graph_decode_with_processors_equals_eager(async_scheduling: bool) -> None:
    model = build_random_model(
        tiny_config("llama", eos_token_id=3), seed=4, device=DEV, dtype="bfloat16"
    )
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14]]
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, frequency_penalty=1.0),
        SamplingParams(
            max_tokens=10,
            temperature=0.0,
            ignore_eos=True,
            repetition_penalty=1.5,
            presence_penalty=0.5,
        ),
        SamplingParams(max_tokens=10, temperature=0.0, logit_bias=((3, 100.0),), min_tokens=4),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    ]

    def run(graphs: bool) -> list[list[int]]:
        config = EngineConfig(
            num_kv_blocks=64,
            block_size=16,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_model_len=128,
            device="cuda",
            use_cuda_graphs=graphs,
            cuda_graph_batch_sizes=(1, 2, 4),
            async_scheduling=async_scheduling,
        )
        engine = Engine(model, config)
        if graphs:
            engine.capture_cuda_graphs()
        ids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out.output_token_ids
        if async_scheduling:
            assert engine.runner.num_overlapped_steps > 0
        return [final[i] for i in ids]

    eager, graphed = run(False), run(True)
    assert graphed == eager
    assert len(graphed[2]) == 5 and graphed[2][-1] == 3 and 3 not in graphed[2][:4]
    assert len(set(graphed[0])) > 1
