"""Streamed text deltas over the engine's per-step text, and completion logprob offsets."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.engine.request import Request, SamplingParams, TokenLogprob
from gpu_runtime.engine.stopping import StopChecker
from gpu_runtime.model.tiny import build_tiny_tokenizer
from gpu_runtime.server.responses import Tracked, completion_logprobs, text_delta, text_length
from tests.gpu_runtime.engine.test_stopping import byte_ids_by_value, random_ids

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    directory: Path = tmp_path_factory.mktemp("tiny-tok")
    build_tiny_tokenizer(directory)
    return AutoTokenizer.from_pretrained(str(directory))


def _stream(tokenizer: Any, ids: list[int], stops: tuple[str, ...]) -> tuple[list[str], str]:
    """Pieces the server would send (as `app.py` calls `text_delta`) and the final text."""
    checker = StopChecker(tokenizer, [EOS], 10_000)
    request = Request("r", [5], SamplingParams(max_tokens=len(ids), stop=stops, ignore_eos=True))
    holdback = max((len(s) for s in stops), default=1) - 1
    pieces: list[str] = []
    sent = 0
    for token in ids:
        request.output_token_ids.append(token)
        text, status, _ = checker.check(request)
        piece, sent = text_delta(text, sent, status is not None, holdback)
        pieces.append(piece)
        if status is not None:
            return pieces, text
    raise AssertionError("max_tokens ends every request")


@pytest.mark.parametrize("seed", range(60))
def test_streamed_pieces_join_to_the_final_text(tokenizer: Any, seed: int) -> None:
    rng = random.Random(seed)
    ids = random_ids(tokenizer, rng, 120)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    stops = tuple(
        full[start : start + rng.randrange(1, 6)]
        for start in (rng.randrange(len(full) // 3, len(full)) for _ in range(rng.randrange(3)))
    )
    pieces, final = _stream(tokenizer, ids, stops)
    assert "".join(pieces) == final


def test_a_stop_string_completed_by_a_multibyte_character_cuts_nothing_sent(
    tokenizer: Any,
) -> None:
    """'xa' then the bytes of '€' one by one, stop 'a€': the 'a' must not go out while '€' is
    U+FFFD (held back before the stop-string margin is taken)."""
    byte_ids = byte_ids_by_value(tokenizer)
    ids = tokenizer.encode("xa", add_special_tokens=False) + [byte_ids[b] for b in "€".encode()]
    pieces, final = _stream(tokenizer, ids, ("a€",))
    assert final == "x"
    assert "".join(pieces) == "x"


def test_text_delta_holds_back_partial_characters_and_stop_prefixes() -> None:
    assert text_delta("hello", 0, False, 2) == ("hel", 3)
    assert text_delta("hello wo\ufffd", 3, False, 0) == ("lo wo", 8)
    assert text_delta("hello wo\ufffd", 3, False, 1) == ("lo w", 7)
    assert text_delta("hello", 4, False, 3) == ("", 4)
    assert text_delta("hel", 4, True, 3) == ("", 4)
    assert text_delta("hello\ufffd", 2, True, 3) == ("llo\ufffd", 6)


def test_completion_text_offsets(tokenizer: Any) -> None:
    ids = tokenizer.encode("héllo wörld, 中文 😀", add_special_tokens=False)
    tracked = Tracked(1, logprobs=[TokenLogprob(i, -1.0, ((i, -1.0),)) for i in ids])
    body = completion_logprobs(tokenizer, tracked.logprobs)
    tokens = body["tokens"]
    assert body["text_offset"] == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert completion_logprobs(tokenizer, Tracked(1).logprobs)["text_offset"] == []
    # a chunk's offsets continue from the characters of the tokens before it
    head, tail = tracked.logprobs[:3], tracked.logprobs[3:]
    first = completion_logprobs(tokenizer, head)
    rest = completion_logprobs(tokenizer, tail, text_length(first))
    assert first["text_offset"] + rest["text_offset"] == body["text_offset"]
    assert first["tokens"] + rest["tokens"] == tokens
