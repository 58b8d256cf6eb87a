"""Constrained fan-out (`n > 1` with `structured_output`): every child has its own matcher, each
output matches the grammar, and every matcher is released when the children finish or when the
parent's id is aborted."""

from __future__ import annotations

import re
from pathlib import Path

from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.structured import StructuredOutputParams

REGEX = r"[a-c]{3}-[0-9]{2}"


def _engine(tiny_dir: Path) -> Engine:
    config = EngineConfig(num_kv_blocks=96, block_size=4, max_num_seqs=8,
                          max_num_batched_tokens=24, max_model_len=128)  # fmt: skip
    return Engine.from_directory(tiny_dir, config)


def test_each_child_follows_the_grammar_with_its_own_matcher(tiny_dir: Path) -> None:
    engine = _engine(tiny_dir)
    structured = StructuredOutputParams("regex", REGEX)
    params = SamplingParams(
        max_tokens=40, temperature=1.0, seed=2, n=3, structured_output=structured
    )
    parent = engine.add_request("Hello, world!", params)
    assert engine.structured.num_matchers == 3
    texts: dict[int, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.parent_id == parent and out.error is None
            if out.finished:
                texts[out.index] = out.text
    assert sorted(texts) == [0, 1, 2]
    assert all(re.fullmatch(REGEX, t) for t in texts.values()), texts
    assert engine.structured.num_matchers == 0


def test_aborting_the_parent_releases_every_matcher(tiny_dir: Path) -> None:
    engine = _engine(tiny_dir)
    structured = StructuredOutputParams("regex", REGEX)
    params = SamplingParams(max_tokens=40, temperature=1.0, n=2, structured_output=structured)
    queued = engine.add_request("Hello, world!", params)
    engine.abort_request(queued)  # before the fork
    assert engine.structured.num_matchers == 0
    forked = engine.add_request("Hello, world!", params)
    engine.step()
    engine.step()
    assert forked not in engine.scheduler.requests
    engine.abort_request(forked)  # after it
    assert engine.structured.num_matchers == 0
    assert not engine.has_unfinished_requests()
