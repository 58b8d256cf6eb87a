"""Penalties, logit_bias and vLLM's extra sampling fields through the server, with the `openai`
client (vLLM extras in `extra_body`), over a synchronous and an async-scheduling engine."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.gpu_runtime.server import test_server
from tests.gpu_runtime.server.test_server import MODEL, Served, _client

served = test_server.served
"""The sync and async servers of `test_server` (module-scoped: built again for this module)."""

FORCED = 42


def _tokenizer(served: Served) -> Any:
    return served[2].engine.tokenizer


def _complete(served: Served, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", 6)
    return _client(served[0]).completions.create(
        model=MODEL, prompt="Hello there", temperature=0.0, **kwargs
    )


def test_logit_bias_forces_a_token(served: Served) -> None:
    out = _complete(served, logit_bias={str(FORCED): 100}, extra_body={"ignore_eos": True})
    assert out.usage is not None and out.usage.completion_tokens == 6
    assert out.choices[0].text == _tokenizer(served).decode([FORCED] * 6, skip_special_tokens=True)


def test_min_tokens_stop_token_ids_and_ignore_eos(served: Served) -> None:
    eos = _tokenizer(served).eos_token_id
    to_eos = {str(eos): 100}
    plain = _complete(served, logit_bias=to_eos)
    assert plain.usage.completion_tokens == 1 and plain.choices[0].finish_reason == "stop"
    late = _complete(served, max_tokens=10, logit_bias=to_eos, extra_body={"min_tokens": 4})
    assert late.usage.completion_tokens == 5 and late.choices[0].finish_reason == "stop"
    ignored = _complete(served, logit_bias=to_eos, extra_body={"ignore_eos": True})
    assert ignored.usage.completion_tokens == 6 and ignored.choices[0].finish_reason == "length"
    stopped = _client(served[0]).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=0.0,
        logit_bias={str(FORCED): 100},
        extra_body={"stop_token_ids": [FORCED]},
    )
    assert stopped.usage is not None and stopped.usage.completion_tokens == 1
    assert stopped.choices[0].finish_reason == "stop"


def test_penalties_reach_the_sampler(served: Served) -> None:
    def tokens(extra: dict[str, Any] | None = None, **kwargs: Any) -> list[str]:
        body = {"ignore_eos": True} | (extra or {})
        out = _complete(served, max_tokens=16, logprobs=0, extra_body=body, **kwargs)
        assert out.choices[0].logprobs is not None
        return list(out.choices[0].logprobs.tokens or [])

    plain = tokens()
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself under greedy
    assert len(set(tokens(frequency_penalty=2.0))) > len(set(plain))
    assert len(set(tokens(presence_penalty=2.0))) > len(set(plain))
    repeated = tokens({"repetition_penalty": 3.0})
    assert len(set(repeated)) > len(set(plain))


def test_twenty_logprobs_streamed_per_chunk(served: Served) -> None:
    out = _complete(served, logprobs=20)  # keyed by text: tokens of equal text collapse
    assert all(5 < len(top) <= 20 for top in out.choices[0].logprobs.top_logprobs)
    stream = _client(served[0]).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=20,
        stream=True,
        extra_body={"ignore_eos": True, "min_p": 0.1},
    )
    entries = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            entries += chunk.choices[0].logprobs.content or []
    assert len(entries) == 4 and all(len(e.top_logprobs) == 20 for e in entries)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"5": 200}}, r"logit_bias\[5\]=200"),
        ({"logit_bias": {"many": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"10000000": 1}}, r"logit_bias token ids \[10000000\]"),
        ({"logprobs": 21}, "logprobs"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"min_p": 1.5}}, "min_p"),
        ({"extra_body": {"min_tokens": 50}}, "min_tokens=50"),
        ({"extra_body": {"stop_token_ids": [10000000]}}, "stop_token_ids"),
    ],
)
def test_out_of_range_fields_are_refused(
    served: Served,
    kwargs: dict[str, Any],
    message: str,
) -> None:
    with pytest.raises(openai.BadRequestError, match=message):
        _complete(served, **kwargs)
