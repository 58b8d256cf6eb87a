"""One endpoint of a running server through the `openai` client (`Api`), and the observable
effect of each honoured request field (`HONOURED_CHECKS`), for `test_request_fields.py`.

Each check sets its field to a value other than its default and asserts what the answer shows
of it; the tiny model's weights are fixed (seed 3), so a sampled answer under a seed is fixed
too."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from gpu_runtime.contract.request_id import REQUEST_ID_HEADER, LogContextFilter

MODEL = "tiny-llama"
PROMPT = "Once upon a time"
HOT: dict[str, Any] = {"temperature": 1.5, "seed": 0}
"""Sampling that differs from greedy (checked by `_hot_differs`)."""


@dataclass(frozen=True)
class Answer:
    """What a check reads of one whole answer."""

    id: str
    model: str
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    tokens: list[str] | None
    """The chosen tokens' text, when logprobs were asked for."""
    token_logprobs: list[float] | None
    top_logprobs: list[dict[str, float]] | None
    top_sizes: list[int] | None
    """Entries of each token's top logprobs as sent (two tokens may share a text)."""


@dataclass(frozen=True)
class Api:
    """`/v1/completions` (`chat=False`) or `/v1/chat/completions` with one prompt (`PROMPT`
    unless `prompt`/`messages` say otherwise). Fields go in the JSON body as given."""

    client: openai.OpenAI
    chat: bool

    def _body(self, fields: dict[str, Any]) -> dict[str, Any]:
        body = {"model": MODEL, "max_tokens": 8, **fields}
        if self.chat:
            body.setdefault("messages", [{"role": "user", "content": PROMPT}])
        else:
            body.setdefault("prompt", PROMPT)
        return body

    def _post(self, fields: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
        body = self._body(fields)
        kwargs = {
            "model": body.pop("model"),
            "stream": body.pop("stream", False),
            "extra_body": body,
            "extra_headers": headers,
        }
        if self.chat:
            return self.client.chat.completions.create(messages=body.pop("messages"), **kwargs)
        return self.client.completions.create(prompt=body.pop("prompt"), **kwargs)

    def create(self, headers: dict[str, str] | None = None, **fields: Any) -> Answer:
        """The whole answer of a request with `fields`."""
        r = self._post(fields, headers)
        choice = r.choices[0]
        assert r.usage is not None
        tokens, lps, top, sizes = None, None, None, None
        if self.chat and choice.logprobs is not None:
            content = choice.logprobs.content or []
            tokens = [e.token for e in content]
            lps = [e.logprob for e in content]
            top = [{t.token: t.logprob for t in e.top_logprobs} for e in content]
            sizes = [len(e.top_logprobs) for e in content]
        elif not self.chat and choice.logprobs is not None:
            tokens = choice.logprobs.tokens
            lps = choice.logprobs.token_logprobs
            top = choice.logprobs.top_logprobs
        return Answer(
            r.id,
            r.model,
            choice.message.content if self.chat else choice.text,
            choice.finish_reason,
            r.usage.prompt_tokens,
            r.usage.completion_tokens,
            tokens,
            lps,
            top,
            sizes,
        )

    def stream(self, **fields: Any) -> list[Any]:
        """The chunks of a streamed request with `fields`."""
        return list(self._post({**fields, "stream": True}))

    def error(self, **fields: Any) -> tuple[int, dict[str, Any]]:
        """The status and `error` object of a request the server refuses."""
        with pytest.raises(openai.APIStatusError) as caught:
            self._post(fields)
        body = caught.value.body
        assert isinstance(body, dict), body
        return caught.value.status_code, body

    def with_logprobs(self, k: int) -> dict[str, Any]:
        """The fields asking for `k` top logprobs per token."""
        return {"logprobs": True, "top_logprobs": k} if self.chat else {"logprobs": k}

    def message(self, role: str, content: str) -> dict[str, Any]:
        """The fields of a one-message prompt (chat) or of `content` as the prompt."""
        return {"messages": [{"role": role, "content": content}]}


def streamed_text(api: Api, chunks: list[Any]) -> str:
    """The text of a stream's chunks, in order."""
    with_choice = [c.choices[0] for c in chunks if c.choices]
    return "".join((c.delta.content if api.chat else c.text) or "" for c in with_choice)


def _greedy(api: Api, **fields: Any) -> Answer:
    return api.create(temperature=0.0, **fields)


def _hot_differs(api: Api) -> str:
    hot = api.create(**HOT).text
    assert hot != _greedy(api).text
    return hot


def check_model(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    assert api.create().model == MODEL
    status, body = api.error(model="not-served")
    assert (status, body["code"], body["param"]) == (404, "model_not_found", "model")


def check_prompt(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    short, long = api.create(prompt="Once"), api.create(prompt=PROMPT + " there was")
    assert short.prompt_tokens < long.prompt_tokens
    two = api.client.completions.create(model=MODEL, prompt=["Once", PROMPT], max_tokens=2)
    assert [c.index for c in two.choices] == [0, 1]


def check_messages(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    one = api.create()
    turns = [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": "there was"},
        {"role": "user", "content": "go on"},
    ]
    assert api.create(messages=turns).prompt_tokens > one.prompt_tokens


def _first_logprobs(api: Api, **fields: Any) -> dict[str, float]:
    answer = _greedy(api, max_tokens=1, **api.with_logprobs(5), **fields)
    assert answer.top_logprobs is not None
    return answer.top_logprobs[0]


def check_role(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    as_user = _first_logprobs(api, **api.message("user", PROMPT))
    assert _first_logprobs(api, **api.message("system", PROMPT)) != as_user


def check_name(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    """`name` reaches the chat template (the walking test's renders it after the role)."""
    named = {"messages": [{"role": "user", "content": PROMPT, "name": "alice"}]}
    assert _first_logprobs(api, **named) != _first_logprobs(api, **api.message("user", PROMPT))


def check_content(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    once = _first_logprobs(api, **api.message("user", PROMPT))
    assert _first_logprobs(api, **api.message("user", "Hello world")) != once


def check_max_tokens(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    three = _greedy(api, max_tokens=3)
    assert (three.completion_tokens, three.finish_reason) == (3, "length")


def check_max_completion_tokens(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    two = _greedy(api, max_tokens=6, max_completion_tokens=2)  # it wins over max_tokens
    assert (two.completion_tokens, two.finish_reason) == (2, "length")


def check_temperature(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    greedy = _greedy(api, **api.with_logprobs(5))
    assert greedy.token_logprobs and greedy.top_logprobs
    assert greedy.token_logprobs == [max(top.values()) for top in greedy.top_logprobs]
    _hot_differs(api)


def check_top_p(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    _hot_differs(api)
    assert api.create(top_p=1e-6, **HOT).text == _greedy(api).text


def check_top_k(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    _hot_differs(api)
    assert api.create(top_k=1, **HOT).text == _greedy(api).text


def check_seed(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    hot = _hot_differs(api)
    assert api.create(**HOT).text == hot
    assert api.create(**{**HOT, "seed": 1}).text != hot


def check_stop(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    text = _greedy(api).text
    stop = text[3:5]
    cut = _greedy(api, stop=stop)
    assert (cut.text, cut.finish_reason) == (text[: text.index(stop)], "stop")


def check_stream(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    chunks = api.stream(temperature=0.0)
    assert len(chunks) > 2
    assert streamed_text(api, chunks) == _greedy(api).text


def check_stream_options(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    assert all(c.usage is None for c in api.stream())
    last = api.stream(stream_options={"include_usage": True})[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 8


def check_logprobs(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    assert api.create().token_logprobs is None
    answer = api.create(logprobs=True) if api.chat else api.create(logprobs=3)
    assert answer.token_logprobs is not None and answer.top_logprobs is not None
    assert len(answer.token_logprobs) == answer.completion_tokens
    sizes = {len(top) for top in answer.top_logprobs}
    assert sizes == {0} if api.chat else max(sizes) == 3
    if not api.chat:
        _check_streamed_completion_logprobs(api)


def _check_streamed_completion_logprobs(api: Api) -> None:
    """Each chunk carries its tokens' logprobs; a prompt's chunks concatenated are the whole
    answer's logprobs (two prompts, interleaved in one stream)."""
    prompts = [PROMPT, "Hello world"]
    fields: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "temperature": 0.0, "logprobs": 3}
    create: Any = api.client.completions.create  # the fields as one dict: no overload types it
    whole = create(prompt=prompts, **fields)
    chunks = list(create(prompt=prompts, stream=True, **fields))
    for choice in whole.choices:
        expected = choice.logprobs
        assert expected is not None
        parts = [
            c.choices[0].logprobs
            for c in chunks
            if c.choices and c.choices[0].index == choice.index and c.choices[0].logprobs
        ]
        assert len(parts) > 1
        assert sum((p.tokens or [] for p in parts), []) == expected.tokens
        # equal up to fp32 noise: the stream's steps batch the two prompts differently
        got = sum((p.token_logprobs or [] for p in parts), [])
        assert got == pytest.approx(expected.token_logprobs, abs=1e-5)
        tops = sum((p.top_logprobs or [] for p in parts), [])
        assert [t.keys() for t in tops] == [t.keys() for t in expected.top_logprobs or []]
        for top, want in zip(tops, expected.top_logprobs or [], strict=True):
            assert top == pytest.approx(want, abs=1e-5)
        assert sum((p.text_offset or [] for p in parts), []) == expected.text_offset


def check_top_logprobs(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    answer = api.create(logprobs=True, top_logprobs=4)
    assert answer.top_sizes == [4] * answer.completion_tokens


def check_user(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    caplog.handler.addFilter(LogContextFilter())
    with caplog.at_level(logging.INFO, logger="gpu_runtime.server.completion_routes"):
        answer = api.create(user="end-user-7", headers={REQUEST_ID_HEADER: "req-user-check"})
    lines = [r for r in caplog.records if "end-user-7" in r.getMessage()]
    assert [r.getMessage() for r in lines] == [f"{answer.id}: end user 'end-user-7'"]
    assert getattr(lines[0], "request_id", None) == "req-user-check"


Check = Callable[[Api, pytest.LogCaptureFixture], None]
FIELD_CHECKS: dict[str, Check] = {
    "model": check_model,
    "prompt": check_prompt,
    "messages": check_messages,
    "messages.role": check_role,
    "messages.content": check_content,
    "messages.name": check_name,
    "max_tokens": check_max_tokens,
    "max_completion_tokens": check_max_completion_tokens,
    "temperature": check_temperature,
    "top_p": check_top_p,
    "top_k": check_top_k,
    "seed": check_seed,
    "stop": check_stop,
    "stream": check_stream,
    "stream_options": check_stream_options,
    "stream_options.include_usage": check_stream_options,
    "logprobs": check_logprobs,
    "top_logprobs": check_top_logprobs,
    "user": check_user,
}
"""Field path (nested fields under their parent, list items unindexed) -> its check (with
`sampling_checks.SAMPLING_CHECKS`: `HONOURED_CHECKS` in `test_request_fields`)."""
