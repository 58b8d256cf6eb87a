"""The observable effect of each sampling field the sampler honours (penalties, logit_bias,
min_p, min_tokens, stop_token_ids, ignore_eos), for `test_request_fields.py`: each sets its
field on the tiny model (greedy unless said) and asserts what the answer shows."""

from __future__ import annotations

from typing import Any

import pytest

from gpu_runtime.contract.tiny_tokenizer import SPECIAL_TOKENS
from tests.gpu_runtime.server.field_checks import HOT, Api, Check

EOS = SPECIAL_TOKENS.index("<|im_end|>")
"""The tiny tokenizer's eos id (its special tokens come first, in order)."""
FORCED = 42
"""A plain token id that a bias of +100 forces."""
TO_EOS = {str(EOS): 100.0}


def _greedy_tokens(api: Api, **fields: Any) -> list[str]:
    """The tokens of a greedy 16-token answer, eos not stopping it."""
    answer = api.create(
        temperature=0.0, max_tokens=16, ignore_eos=True, **api.with_logprobs(1), **fields
    )
    assert answer.tokens is not None and len(answer.tokens) == 16
    return answer.tokens


def _ends(api: Api, **fields: Any) -> tuple[int, str | None]:
    answer = api.create(temperature=0.0, **fields)
    return answer.completion_tokens, answer.finish_reason


def check_logit_bias(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    assert len(set(_greedy_tokens(api))) > 1
    assert len(set(_greedy_tokens(api, logit_bias={str(FORCED): 100.0}))) == 1


def _penalty_check(name: str, value: float) -> Check:
    def check(api: Api, caplog: pytest.LogCaptureFixture) -> None:
        plain = _greedy_tokens(api)
        assert len(set(plain)) < len(plain)  # the tiny model repeats itself under greedy
        assert len(set(_greedy_tokens(api, **{name: value}))) > len(set(plain))

    return check


def check_ignore_eos(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    assert _ends(api, max_tokens=6, logit_bias=TO_EOS) == (1, "stop")
    assert _ends(api, max_tokens=6, logit_bias=TO_EOS, ignore_eos=True) == (6, "length")


def check_min_tokens(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    assert _ends(api, max_tokens=10, logit_bias=TO_EOS, min_tokens=4) == (5, "stop")


def check_stop_token_ids(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    forced = {str(FORCED): 100.0}
    assert _ends(api, max_tokens=8, logit_bias=forced) == (8, "length")
    assert _ends(api, max_tokens=8, logit_bias=forced, stop_token_ids=[FORCED]) == (1, "stop")


def check_min_p(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    greedy = api.create(temperature=0.0).text
    assert api.create(**HOT).text != greedy
    assert api.create(min_p=1.0, **HOT).text == greedy  # only the likeliest token is left


SAMPLING_CHECKS: dict[str, Check] = {
    "logit_bias": check_logit_bias,
    "presence_penalty": _penalty_check("presence_penalty", 2.0),
    "frequency_penalty": _penalty_check("frequency_penalty", 2.0),
    "repetition_penalty": _penalty_check("repetition_penalty", 3.0),
    "ignore_eos": check_ignore_eos,
    "min_tokens": check_min_tokens,
    "stop_token_ids": check_stop_token_ids,
    "min_p": check_min_p,
}
