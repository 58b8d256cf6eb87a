"""The gateway's reading of an inference body: the rate-limit estimate charges every sequence
a request generates (`n`, `best_of`), and bad counts are refused naming the field."""

from __future__ import annotations

import json

import pytest

from api.errors import HarliError
from api.gateway.requests import CHAT_COMPLETIONS, COMPLETIONS, parse_inference_request


def _estimate(path: str, **body: object) -> int:
    return parse_inference_request(
        path, json.dumps({"model": "tiny", **body}).encode()
    ).estimated_tokens


def test_the_estimate_counts_every_sequence_of_every_prompt() -> None:
    one = _estimate(COMPLETIONS, prompt=["abcd", "efgh"], max_tokens=10)
    assert one == 2 + 2 * 10  # 8 characters, two prompts of 10 tokens each
    assert _estimate(COMPLETIONS, prompt=["abcd", "efgh"], max_tokens=10, n=3) == 2 + 2 * 3 * 10
    assert _estimate(COMPLETIONS, prompt="abcd", max_tokens=10, n=2, best_of=5) == 1 + 5 * 10
    messages = [{"role": "user", "content": "abcdefgh"}]
    assert _estimate(CHAT_COMPLETIONS, messages=messages, max_tokens=7, n=4) == 2 + 4 * 7


@pytest.mark.parametrize("field", ["n", "best_of"])
@pytest.mark.parametrize("value", [0, -1, "2", 1.5, True])
def test_bad_counts_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(HarliError) as refused:
        _estimate(COMPLETIONS, prompt="abcd", max_tokens=1, **{field: value})
    assert refused.value.param == field
