"""`StructuredOutputParams` validation, the compiler's errors and cache, and the bitmask's
masking against xgrammar's own kernel."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from gpu_runtime.structured import StructuredOutputError, StructuredOutputParams
from gpu_runtime.structured.bitmask import TokenBitmask
from gpu_runtime.structured.compiler import StructuredCompiler


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("yaml", "a: 1", "kind='yaml' must be one of"),
        ("json_object", "{}", "takes no spec"),
        ("json_schema", "", "needs a spec"),
        ("json_schema", "{not json", "is not valid JSON"),
        ("json_schema", "[1, 2]", "must be an object (or true), got list"),
        ("structural_tag", '"tag"', "must be a JSON object, got str"),
        ("regex", "", "needs a spec"),
    ],
)
def test_malformed_params_are_refused_with_the_reason(kind: str, spec: str, message: str) -> None:
    with pytest.raises(StructuredOutputError, match=re.escape(message)):
        StructuredOutputParams(kind, spec)  # type: ignore[arg-type]


def test_params_are_hashable_and_equal_by_value() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}
    one = StructuredOutputParams.json_schema(schema)
    two = StructuredOutputParams.json_schema(schema)
    assert one == two and hash(one) == hash(two)
    assert list(json.loads(one.spec)["properties"]) == ["b", "a"]  # the caller's order is kept


@pytest.fixture(scope="module")
def compiler(tiny_dir: Path) -> StructuredCompiler:
    return StructuredCompiler(AutoTokenizer.from_pretrained(tiny_dir), 512, [2])


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (StructuredOutputParams("json_schema", '{"type": "objx"}'), "invalid json schema: .*objx"),
        (StructuredOutputParams("regex", "(ab"), "invalid regex: .*parenthesis is not closed"),
        (StructuredOutputParams("grammar", "root ::= foo"), 'invalid grammar: .*"foo"'),
        (StructuredOutputParams("structural_tag", '{"type": "nope"}'), "invalid structural tag"),
    ],
)
def test_specs_the_compiler_refuses_raise_a_clear_error(
    compiler: StructuredCompiler, params: StructuredOutputParams, message: str
) -> None:
    with pytest.raises(StructuredOutputError, match=message) as caught:
        compiler.compile(params)
    assert "/project/" not in str(caught.value)  # xgrammar's log prefix is cut
    assert compiler.cached(params) is None


def test_compiled_grammars_are_cached_by_params(compiler: StructuredCompiler) -> None:
    params = StructuredOutputParams("regex", "[ab]{2,4}")
    assert compiler.cached(params) is None
    first = compiler.compile(params)
    assert compiler.cached(params) is first
    assert compiler.compile(StructuredOutputParams("regex", "[ab]{2,4}")) is first


def test_the_cache_keeps_its_most_recently_used_grammars(tiny_dir: Path) -> None:
    small = StructuredCompiler(AutoTokenizer.from_pretrained(tiny_dir), 512, [2], cache_size=2)
    a, b, c = (StructuredOutputParams("regex", r) for r in ("a+", "b+", "c+"))
    small.compile(a)
    small.compile(b)
    small.cached(a)  # a is now the most recent
    small.compile(c)
    assert small.cached(b) is None and small.cached(a) is not None and small.cached(c) is not None


def test_a_compiler_needs_a_tokenizer() -> None:
    with pytest.raises(StructuredOutputError, match="needs the engine's tokenizer"):
        StructuredCompiler(None, 512, [2])


@pytest.mark.parametrize("vocab", [500, 512, 33])
def test_bitmask_masks_exactly_the_rows_given_as_xgrammar_does(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    bits = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    rows = [4, 1, 3]
    logits = torch.randn(6, vocab, generator=gen)
    expected = logits.clone()
    full = torch.full((6, words), -1, dtype=torch.int32)
    full[rows] = bits
    xgr.apply_token_bitmask_inplace(expected, full, indices=rows)
    mask = TokenBitmask(8, vocab, torch.device("cpu"))
    host = mask.host_rows(3)
    host.copy_(bits)
    masked = logits.clone()
    mask.apply(masked, host, rows)
    assert torch.equal(masked, expected)
    untouched = [r for r in range(6) if r not in rows]
    assert torch.equal(masked[untouched], logits[untouched])
    assert torch.isinf(masked[rows]).any()


def test_bitmask_host_buffers_alternate() -> None:
    mask = TokenBitmask(4, 64, torch.device("cpu"))
    first, second, third = mask.host_rows(2), mask.host_rows(2), mask.host_rows(2)
    assert first.data_ptr() != second.data_ptr() and first.data_ptr() == third.data_ptr()
    with pytest.raises(ValueError, match=r"rows=5 must be in \[1, 4\]"):
        mask.host_rows(5)
