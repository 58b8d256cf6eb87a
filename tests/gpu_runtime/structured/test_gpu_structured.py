"""CUDA-only: constrained rows through the graph-replayed, async-scheduled decode path (the
bitmask copied and applied on the device), and the device masking against xgrammar's kernel."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.structured import StructuredOutputParams
from gpu_runtime.structured.bitmask import TokenBitmask
from tests.gpu_runtime.small_model import small_cuda_model
from tests.gpu_runtime.structured.test_engine_structured import PROMPTS, SCHEMA

pytestmark = pytest.mark.gpu


def _engine(tiny_dir: Path, async_scheduling: bool = True) -> Engine:
    """The small model (vocab 1,000: ids past the tokenizer's 480 are padding the mask never
    allows) with the tiny tokenizer, graphs captured."""
    config = EngineConfig(
        num_kv_blocks=256,
        block_size=16,
        max_num_seqs=8,
        max_model_len=256,
        max_num_batched_tokens=64,
        device="cuda",
        async_scheduling=async_scheduling,
    )
    engine = Engine(small_cuda_model(), config, tokenizer=AutoTokenizer.from_pretrained(tiny_dir))
    assert engine.capture_cuda_graphs() == [8, 4, 2, 1]
    return engine


def _run(engine: Engine, requests: list[tuple[str, SamplingParams]]) -> list:
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    return [final[i] for i in ids]


def test_constrained_rows_on_cuda_match_the_schema_beside_untouched_rows(tiny_dir: Path) -> None:
    engine = _engine(tiny_dir)
    # free rows end before any constrained one can (a schema answer is 20+ tokens), so all 8
    # rows run in the same bucket while they do
    free = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    bound = SamplingParams(
        max_tokens=120,
        temperature=0.0,
        structured_output=StructuredOutputParams.json_schema(SCHEMA),
    )
    # the same 8 rows twice: once with the last four constrained, once all free
    mixed = _run(engine, [(p, free) for p in PROMPTS] + [(p, bound) for p in PROMPTS])
    alone = _run(engine, [(p, free) for p in PROMPTS] * 2)
    assert [o.output_token_ids for o in mixed[:4]] == [o.output_token_ids for o in alone[:4]]
    for out in mixed[4:]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert engine.structured.num_matchers == 0 and engine.structured.num_constrained_steps > 0
    assert engine.runner.num_deferred_samplings > 0  # constrained steps ran ahead
    synchronous = _run(
        _engine(tiny_dir, async_scheduling=False),
        [(p, free) for p in PROMPTS] + [(p, bound) for p in PROMPTS],
    )
    assert [o.output_token_ids for o in synchronous] == [o.output_token_ids for o in mixed]


@pytest.mark.parametrize("vocab", [1000, 128256])
def test_device_masking_equals_xgrammars_kernel(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    bits = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    rows = [5, 0, 2]
    logits = torch.randn(8, vocab, generator=gen).to(torch.bfloat16)
    expected = logits.float()
    full = torch.full((8, words), -1, dtype=torch.int32)
    full[rows] = bits
    xgr.apply_token_bitmask_inplace(expected, full, indices=rows)
    mask = TokenBitmask(8, vocab, torch.device("cuda"))
    host = mask.host_rows(3)
    host.copy_(bits)
    on_device = logits.cuda()
    mask.apply(on_device, host, rows)
    assert torch.equal(on_device.float().cpu(), expected.to(torch.bfloat16).float())
