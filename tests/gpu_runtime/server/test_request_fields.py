"""Every request field is honoured or refused, never accepted and ignored (issue 28).

The walk is driven by the request models themselves: every field of `CompletionRequest` and
`ChatCompletionRequest`, nested models included (`stream_options.include_usage`,
`messages.role`), is either in its model's `REFUSED` table (then setting it is a 400 whose
`param` names it) or has a check in `field_checks.HONOURED_CHECKS` that sets it and asserts
its effect through the `openai` client against a running tiny server. A field added to a model
with neither fails `test_every_field_is_honoured_or_refused`; flipping a field from refused to
honoured (removing its `REFUSED` line) fails it until the field has a check."""

from __future__ import annotations

import importlib
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.model.tiny import build_tiny_model_dir
from gpu_runtime.server import BearerKeys, EngineLoop, create_app, static_key_checker
from gpu_runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.gpu_runtime.server.choice_checks import CHOICE_CHECKS
from tests.gpu_runtime.server.field_checks import FIELD_CHECKS, MODEL, Api
from tests.gpu_runtime.server.sampling_checks import SAMPLING_CHECKS
from tests.gpu_runtime.server.serving import serve_in_thread

KEY = "sk-fields"
HONOURED_CHECKS = FIELD_CHECKS | SAMPLING_CHECKS | CHOICE_CHECKS
ENDPOINTS: dict[str, type[BaseModel]] = {
    "completions": CompletionRequest,
    "chat": ChatCompletionRequest,
}

REFUSED_VALUES: dict[str, Any] = {
    "suffix": " the end",
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "store": True,
    "metadata": {"k": "v"},
    "service_tier": "flex",
    "reasoning_effort": "low",
    "verbosity": "low",
    "web_search_options": {},
}
"""A value other than the default for each refused field, as a client would send it."""

_TOOL_SERVER = "tests.gpu_runtime.server.test_tool_server"
_CONSTRAINED = f"{_TOOL_SERVER}::test_constrained_calls_are_parsed_calls"
_HISTORY = f"{_TOOL_SERVER}::test_the_prompt_is_the_templates_own_rendering"
_COPIES = f"{_TOOL_SERVER}::test_the_answer_goes_back_into_the_history"
CHECKED_ELSEWHERE: dict[str, str] = {
    "tools": _CONSTRAINED,
    "tools.type": _CONSTRAINED,
    "tools.function": _CONSTRAINED,
    "tools.function.name": _CONSTRAINED,
    "tools.function.parameters": _CONSTRAINED,
    "tools.function.description": "tests.gpu_runtime.contract.test_chat_render"
    "::test_the_templates_own_rendering",
    "tools.function.strict": f"{_TOOL_SERVER}"
    "::test_auto_with_a_strict_function_is_text_or_valid_calls",
    "tool_choice": _CONSTRAINED,
    "tool_choice.type": _CONSTRAINED,
    "tool_choice.function": _CONSTRAINED,
    "tool_choice.function.name": _CONSTRAINED,
    "parallel_tool_calls": _CONSTRAINED,
    "messages.tool_call_id": _HISTORY,
    "messages.tool_calls": _HISTORY,
    "messages.tool_calls.id": _HISTORY,
    "messages.tool_calls.type": _HISTORY,
    "messages.tool_calls.function": _HISTORY,
    "messages.tool_calls.function.name": _HISTORY,
    "messages.tool_calls.function.arguments": _HISTORY,
    "messages.tool_calls.index": _COPIES,
    "messages.tool_calls.function.parsed_arguments": _COPIES,
    "messages.parsed": _COPIES,
    **dict.fromkeys(
        [
            "response_format",
            "response_format.type",
            "response_format.json_schema",
            "response_format.json_schema.name",
            "response_format.json_schema.schema_",
            "response_format.json_schema.strict",
        ],
        "tests.gpu_runtime.structured.test_server_structured"
        "::test_chat_json_schema_answers_match_the_schema",
    ),
}
"""Honoured fields whose effect needs a tool-calling chat template (the tiny model's ChatML
refuses `tools`): the test that shows it, `module::function`. `index`, `parsed_arguments` and
`parsed` are the openai client's own copies it sends back with a message it got (the server
renders `content`, the list order and `arguments`; `chat_protocol`)."""


NAMED_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] }}"
    "{% if message['name'] %}{{ ' ' + message['name'] }}{% endif %}"
    "{{ '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The tiny model's ChatML with a message's `name` after its role (as some templates render
it), so that passing `name` to the template shows."""


def _models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    """The pydantic models inside a field's annotation (through `X | None`, `list[X]`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        return
    if typing.get_origin(annotation) is typing.Annotated:
        yield from _models_in(typing.get_args(annotation)[0])
    elif typing.get_origin(annotation) in (typing.Union, types.UnionType, list):
        for arg in typing.get_args(annotation):
            yield from _models_in(arg)


def walk(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[type[BaseModel], str]]:
    """(owning model, path) of every field of `model`, then of its nested models' fields."""
    for name, info in model.model_fields.items():
        yield model, prefix + name
        for nested in _models_in(info.annotation):
            yield from walk(nested, f"{prefix}{name}.")


def _is_refused(owner: type[BaseModel], path: str) -> bool:
    return path.rsplit(".", 1)[-1] in getattr(owner, "REFUSED", {})


def _null_only(owner: type[BaseModel], path: str) -> bool:
    """A field typed `None`: the server takes it only as null (a response message's field a
    client sends back) and refuses any value."""
    return owner.model_fields[path.rsplit(".", 1)[-1]].annotation is type(None)


def _covered(owner: type[BaseModel], path: str) -> bool:
    return (
        _is_refused(owner, path)
        or _null_only(owner, path)
        or path in HONOURED_CHECKS
        or path in CHECKED_ELSEWHERE
    )


FIELDS = [(endpoint, owner, path) for endpoint, m in ENDPOINTS.items() for owner, path in walk(m)]
HERE = [(e, owner, path) for e, owner, path in FIELDS if path not in CHECKED_ELSEWHERE]
"""The fields `test_field` sets on the tiny server (the others: `CHECKED_ELSEWHERE`)."""
IDS = [f"{endpoint}:{path}" for endpoint, _, path in HERE]


def test_every_field_is_honoured_or_refused() -> None:
    uncovered = [f"{e}:{p}" for e, o, p in FIELDS if not _covered(o, p)]
    assert uncovered == [], "fields with neither a REFUSED line nor an honoured check"
    checked = HONOURED_CHECKS.keys() | CHECKED_ELSEWHERE.keys()
    both = [f"{e}:{p}" for e, o, p in FIELDS if _is_refused(o, p) and p in checked]
    assert both == [], "refused fields with an honoured check (flip one or the other)"
    paths = {p for _, _, p in FIELDS}
    assert sorted(checked - paths) == [], "checks of fields no model has"
    assert sorted(HONOURED_CHECKS.keys() & CHECKED_ELSEWHERE.keys()) == []
    for test in set(CHECKED_ELSEWHERE.values()):
        module, name = test.split("::")
        assert callable(getattr(importlib.import_module(module), name, None)), test
    refused_names = {p.rsplit(".", 1)[-1] for _, o, p in FIELDS if _is_refused(o, p)}
    assert refused_names == set(REFUSED_VALUES), "REFUSED_VALUES must match the REFUSED tables"


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir: Path = build_tiny_model_dir(tmp_path_factory.mktemp("fields"), "llama", seed=3)
    (model_dir / "chat_template.jinja").write_text(NAMED_CHATML)
    engine = Engine.from_directory(
        model_dir,
        EngineConfig(num_kv_blocks=128, block_size=8, max_num_seqs=4, max_model_len=256),
    )
    loop = EngineLoop(engine)
    loop.start()
    app = create_app(loop, MODEL, BearerKeys(static_key_checker([KEY])))
    try:
        with serve_in_thread(app) as url:
            yield url
    finally:
        loop.stop()


def _api(base_url: str, endpoint: str) -> Api:
    client = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=30)
    return Api(client, chat=endpoint == "chat")


def _request_setting(path: str, value: Any) -> tuple[dict[str, Any], str]:
    """The fields that set `path` to `value`, and the `param` a refusal must name."""
    if path.startswith("messages."):
        message = {"role": "user", "content": "hi", path.split(".", 1)[1]: value}
        return {"messages": [message]}, "messages.0." + path.split(".", 1)[1]
    if path.startswith("stream_options."):
        options = {path.split(".", 1)[1]: value}
        return {"stream": True, "stream_options": options}, path
    return {path: value}, path


@pytest.mark.parametrize(("endpoint", "owner", "path"), HERE, ids=IDS)
def test_field(
    base_url: str,
    endpoint: str,
    owner: type[BaseModel],
    path: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A refused field answers 400 naming it; an honoured one shows its check's effect."""
    api = _api(base_url, endpoint)
    if _is_refused(owner, path):
        name = path.rsplit(".", 1)[-1]
        fields, param = _request_setting(path, REFUSED_VALUES[name])
        status, error = api.error(**fields)
        assert (status, error["type"], error["param"]) == (400, "invalid_request_error", param)
        assert f"'{name}' is not supported" in error["message"]
        return
    if _null_only(owner, path):
        fields, param = _request_setting(path, "a value")
        status, error = api.error(**fields)
        assert (status, error["param"]) == (400, param)
        return
    check = HONOURED_CHECKS.get(path)
    assert check is not None, f"{endpoint}:{path} has no REFUSED line and no honoured check"
    check(api, caplog)


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
@pytest.mark.parametrize(
    "path", ["guided_json", "stream_options.continuous_usage_stats", "messages.no_such_field"]
)
def test_an_unknown_field_is_refused_by_name(base_url: str, endpoint: str, path: str) -> None:
    if path.startswith("messages.") and endpoint != "chat":
        path = "prompt_logprobs"
    fields, param = _request_setting(path, 1)
    status, error = _api(base_url, endpoint).error(**fields)
    assert (status, error["param"]) == (400, param)
    assert error["message"] == f"Unrecognized request argument supplied: {param}"


def test_cross_field_rules(base_url: str) -> None:
    chat, completions = _api(base_url, "chat"), _api(base_url, "completions")
    status, error = chat.error(top_logprobs=2)
    assert (status, error["param"]) == (400, "top_logprobs")
    assert "'logprobs'" in error["message"]
    for api in (chat, completions):
        status, error = api.error(stream_options={"include_usage": True})
        assert (status, error["param"]) == (400, "stream_options")
    # the documented default of a refused field is what the server does anyway (seeded: the
    # answer does not depend on what the module's other requests drew before)
    assert chat.create(store=False, n=1, presence_penalty=0.0, seed=0).completion_tokens == 8
    assert completions.create(echo=False, suffix=None, seed=0).completion_tokens == 8
