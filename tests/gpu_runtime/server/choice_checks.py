"""The observable effect of `n`, `best_of` and `echo` (`CHOICE_CHECKS`), for
`test_request_fields.py`: more choices, the best of several candidates, the prompt echoed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.gpu_runtime.server.field_checks import HOT, MODEL, PROMPT, Api


def _create(api: Api, **fields: Any) -> Any:
    """The whole answer (every choice) of a request with `fields`."""
    create: Any = api.client.chat.completions.create if api.chat else api.client.completions.create
    where = {"messages": [{"role": "user", "content": PROMPT}]} if api.chat else {"prompt": PROMPT}
    return create(model=MODEL, max_tokens=6, **where, **fields)


def _texts(api: Api, answer: Any) -> list[str]:
    return [c.message.content if api.chat else c.text for c in answer.choices]


def check_n(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    one = _create(api, temperature=0.0)
    three = _create(api, temperature=0.0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert _texts(api, three) == _texts(api, one) * 3
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    sampled = _texts(api, _create(api, n=3, **HOT))
    assert len(set(sampled)) == 3 and sampled[0] == _texts(api, _create(api, **HOT))[0]


def check_best_of(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    candidates = _create(api, n=3, logprobs=0, **HOT).choices
    sums = [sum(c.logprobs.token_logprobs) for c in candidates]
    best = max(range(3), key=lambda i: sums[i])
    assert sums[best] > min(sums)  # the candidates differ, so the pick shows
    picked = _create(api, best_of=3, **HOT)
    assert _texts(api, picked) == [candidates[best].text]


def check_echo(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    plain = _texts(api, _create(api, temperature=0.0))[0]
    assert _texts(api, _create(api, temperature=0.0, echo=True)) == [PROMPT + plain]


Check = Callable[[Api, pytest.LogCaptureFixture], None]
CHOICE_CHECKS: dict[str, Check] = {"n": check_n, "best_of": check_best_of, "echo": check_echo}
"""Field -> its check (part of `HONOURED_CHECKS` in `test_request_fields`)."""
