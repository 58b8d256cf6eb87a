"""Constrained requests through the engine on CPU (tiny model, byte-level BPE tokenizer): greedy
outputs match their JSON schema, regex or grammar and stop once the grammar has ended;
unconstrained rows of the same batches keep the tokens they get alone; under async scheduling a
constrained step ahead runs its model early and samples once the matchers hold the previous
step's tokens; preemption keeps each matcher consistent with its output."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import xgrammar as xgr

from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.structured import StructuredOutputError, StructuredOutputParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ada", "bob", "eve"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["name", "age", "admin", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Hello, world!", "The quick brown fox", "Numbers: 0 1 2", "A decode engine reads"]


def _config(**overrides: object) -> EngineConfig:
    base: dict[str, object] = dict(
        num_kv_blocks=96,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=24,
        max_model_len=128,
        static_decode_batches=True,
        cuda_graph_batch_sizes=(1, 2, 4, 8),
    )
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


def _greedy(structured: StructuredOutputParams | None, max_tokens: int = 80) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=structured)


def _replayed(engine: Engine, params: StructuredOutputParams, tokens: list[int]) -> bool:
    """Whether a fresh matcher accepts `tokens` one by one and ends after the last."""
    matcher = xgr.GrammarMatcher(engine.structured.compiler.compile(params))
    return all(matcher.accept_token(t) for t in tokens) and matcher.is_terminated()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_json_schema_outputs_match_the_schema_and_stop(
    tiny_dir: Path, async_scheduling: bool
) -> None:
    engine = Engine.from_directory(tiny_dir, _config(async_scheduling=async_scheduling))
    params = StructuredOutputParams.json_schema(SCHEMA)
    outputs = engine.generate(PROMPTS, _greedy(params))
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert engine.tokenizer is not None
        assert out.output_token_ids[-1] == engine.tokenizer.eos_token_id
        assert _replayed(engine, params, out.output_token_ids)
    assert engine.structured.num_matchers == 0  # released with their requests
    runner = engine.runner
    assert runner.num_deferred_samplings == runner.num_overlapped_steps
    assert (runner.num_overlapped_steps > 20) == async_scheduling


def test_json_object_regex_grammar_and_structural_tag(tiny_dir: Path) -> None:
    engine = Engine.from_directory(tiny_dir, _config())
    regex = StructuredOutputParams("regex", r"[a-c]{3}-[0-9]{2}")
    grammar = StructuredOutputParams("grammar", 'root ::= "yes" | "no" | "maybe " [0-9]')
    tag = StructuredOutputParams(
        "structural_tag",
        json.dumps(
            {
                "type": "structural_tag",
                "format": {
                    "type": "sequence",
                    "elements": [
                        {"type": "const_string", "value": "<call>"},
                        {"type": "regex", "pattern": r"[0-9]{2}"},
                        {"type": "const_string", "value": "</call>"},
                    ],
                },
            }
        ),
    )
    kinds = [StructuredOutputParams("json_object"), regex, grammar, tag]
    ids = [engine.add_request(p, _greedy(k)) for p, k in zip(PROMPTS, kinds, strict=True)]
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    obj, rx, gr, tg = (final[i] for i in ids)
    assert isinstance(json.loads(obj.text), dict)
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", rx.text)
    assert re.fullmatch(r"yes|no|maybe [0-9]", gr.text)
    assert re.fullmatch(r"<call>[0-9]{2}</call>", tg.text)
    assert all(o.finish_reason == "stop" for o in (obj, rx, gr, tg))


def test_unconstrained_rows_keep_their_tokens_beside_constrained_ones(tiny_dir: Path) -> None:
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    alone = Engine.from_directory(tiny_dir, _config()).generate(PROMPTS[:2], free)
    engine = Engine.from_directory(tiny_dir, _config())
    constrained = _greedy(StructuredOutputParams.json_schema(SCHEMA))
    ids = [
        engine.add_request(PROMPTS[0], free),
        engine.add_request(PROMPTS[2], constrained),
        engine.add_request(PROMPTS[1], free),
        engine.add_request(PROMPTS[3], constrained),
    ]
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    mixed = [final[ids[0]], final[ids[2]]]
    assert [o.output_token_ids for o in mixed] == [o.output_token_ids for o in alone]
    assert [o.new_logprobs for o in mixed] == [o.new_logprobs for o in alone]
    assert engine.structured.num_constrained_steps > 0
    for rid in (ids[1], ids[3]):
        jsonschema.validate(json.loads(final[rid].text), SCHEMA)


def test_async_steps_ahead_sample_constrained_rows_after_the_matchers_advance(
    tiny_dir: Path,
) -> None:
    """Constrained and free rows together, requests arriving while steps are in flight: steps
    are launched ahead with their sampling deferred while a constrained row runs, and every
    request gets the synchronous engine's tokens."""
    free = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    regex = StructuredOutputParams("regex", r"[a-c]{3}-[0-9]{2}")
    schema = StructuredOutputParams.json_schema(SCHEMA)
    requests = [(PROMPTS[0], free), (PROMPTS[1], _greedy(regex)), (PROMPTS[2], _greedy(schema))]
    results = []
    for async_scheduling in (False, True):
        engine = Engine.from_directory(tiny_dir, _config(async_scheduling=async_scheduling))
        ids: list[str] = []
        final, steps = {}, 0
        while len(ids) < len(requests) or engine.has_unfinished_requests():
            if len(ids) < len(requests) and steps % 3 == 0:
                ids.append(engine.add_request(*requests[len(ids)]))
            final.update({o.request_id: o for o in engine.step() if o.finished})
            steps += 1
        results.append([final[i].output_token_ids for i in ids])
        assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", final[ids[1]].text)
        jsonschema.validate(json.loads(final[ids[2]].text), SCHEMA)
        runner = engine.runner
        if async_scheduling:
            assert runner.num_deferred_samplings > 20
            assert runner.num_overlapped_steps > runner.num_deferred_samplings  # free row alone
        else:
            assert runner.num_deferred_samplings == runner.num_overlapped_steps == 0
    assert results[0] == results[1]


def test_preempted_constrained_requests_keep_their_matcher_in_step(tiny_dir: Path) -> None:
    """16 blocks of 4 tokens cannot hold four requests of ~50 tokens: requests are preempted and
    recomputed from their output tokens; each output is still the schema's, and the same as
    with room for all (the matcher accepted each token once)."""
    params = StructuredOutputParams.json_schema(SCHEMA)
    roomy = Engine.from_directory(tiny_dir, _config()).generate(PROMPTS, _greedy(params, 50))
    engine = Engine.from_directory(tiny_dir, _config(num_kv_blocks=16))
    ids = [engine.add_request(p, _greedy(params, 50)) for p in PROMPTS]
    final, preemptions = {}, 0
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
        live = [engine.scheduler.requests[i] for i in ids if i in engine.scheduler.requests]
        preemptions = max([preemptions, *(r.num_preemptions for r in live)])
    assert preemptions >= 1
    tight = [final[i] for i in ids]
    assert [o.output_token_ids for o in tight] == [o.output_token_ids for o in roomy]
    for out in tight:
        assert out.finish_reason == "stop"
        assert _replayed(engine, params, out.output_token_ids)


def test_a_length_limit_ends_a_constrained_request_unfinished(tiny_dir: Path) -> None:
    engine = Engine.from_directory(tiny_dir, _config())
    (out,) = engine.generate(PROMPTS[:1], _greedy(StructuredOutputParams.json_schema(SCHEMA), 5))
    assert out.finish_reason == "length" and len(out.output_token_ids) == 5
    assert engine.structured.num_matchers == 0


def test_a_spec_that_cannot_compile_leaves_nothing_behind(tiny_dir: Path) -> None:
    engine = Engine.from_directory(tiny_dir, _config())
    bad = _greedy(StructuredOutputParams("json_schema", '{"type": "objx"}'))
    with pytest.raises(StructuredOutputError, match="invalid json schema"):
        engine.add_request(PROMPTS[0], bad, request_id="bad")
    assert not engine.has_unfinished_requests() and engine.structured.num_matchers == 0
    too_long = _greedy(StructuredOutputParams("json_object"), 200)  # > max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(PROMPTS[0], too_long)
    assert not engine.has_unfinished_requests() and engine.structured.num_matchers == 0


def test_abort_releases_the_matcher(tiny_dir: Path) -> None:
    engine = Engine.from_directory(tiny_dir, _config())
    rid = engine.add_request(PROMPTS[0], _greedy(StructuredOutputParams("json_object")))
    engine.step()
    assert engine.structured.is_constrained(rid)
    engine.abort_request(rid)
    assert engine.structured.num_matchers == 0


def test_an_engine_without_a_tokenizer_refuses_constrained_requests(tiny_dir: Path) -> None:
    model_engine = Engine.from_directory(tiny_dir, _config())
    engine = Engine(model_engine.runner.model, _config())
    with pytest.raises(StructuredOutputError, match="needs the engine's tokenizer"):
        engine.add_request([1, 2, 3], _greedy(StructuredOutputParams("json_object")))
    assert not engine.has_unfinished_requests()
