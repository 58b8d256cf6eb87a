"""OpenAI-shaped request bodies (validated, strict) and error bodies.

Strictness: every field a request carries is honoured or refused, never accepted and ignored.
- A field no model declares is a 400 `invalid_request_error` whose `param` is the field (its
  path inside the body, e.g. `messages.0.no_such_field`) and whose message names it
  (`extra="forbid"`).
- A declared field listed in its model's `REFUSED` table (field -> why) is a 400 naming it and
  the reason when the request sets it to anything but its default; its default is what the
  server does anyway, so sending it explicitly is fine. Honouring a field is removing its line.
- Types are strict (`strict=True`): `"stream": "yes"` or `"max_tokens": "8"` is a 400 naming
  the field, not coerced (an integer still passes for a float).
- Cross-field rules OpenAI enforces are 400s naming the field: `top_logprobs` without
  `logprobs: true`, `stream_options` without `stream: true`.
The errors reach the client through `app._validation_error`, which reads `param` from the
error's location and, for `request_field` errors, from their context."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from gpu_runtime.server.chat_protocol import ChatMessage, ToolChoice, ToolDefinition
from gpu_runtime.server.response_format import ResponseFormat

REQUEST_FIELD_ERROR = "request_field"
"""The pydantic error type of a refused field; its context's `field` is the `param`."""

REFUSED_SAMPLING: Mapping[str, str] = {}
"""Fields of both endpoints refused when set (field -> why)."""

REFUSED_COMPLETION: Mapping[str, str] = {
    **REFUSED_SAMPLING,
    "suffix": "insertion after the completion (fill-in-the-middle) is not supported",
}
"""`CompletionRequest`'s refused fields."""

REFUSED_CHAT: Mapping[str, str] = {
    **REFUSED_SAMPLING,
    "functions": "the legacy function calling is not supported",
    "function_call": "the legacy function calling is not supported",
    "audio": "only text output is supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "store": "completions are not stored",
    "metadata": "completions are not stored, so they carry no metadata",
    "service_tier": "there is one service tier",
    "reasoning_effort": "the models served do not reason in a separate channel",
    "verbosity": "the models served have no verbosity control",
    "web_search_options": "web search is not supported",
}
"""`ChatCompletionRequest`'s refused fields."""


def field_error(name: str, message: str) -> PydanticCustomError:
    """A validation error the server answers as a 400 whose `param` is `name`."""
    return PydanticCustomError(REQUEST_FIELD_ERROR, message, {"field": name})


class OpenAIError(Exception):
    """An error the server answers with OpenAI's shape and an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """`{"error": {...}}` as OpenAI sends it."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class StrictBody(BaseModel):
    """A request body or a part of one: undeclared fields are refused, values are not coerced
    across types, and a field of `REFUSED` set to anything but its default is refused (see the
    module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    REFUSED: ClassVar[Mapping[str, str]] = {}

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> Self:
        fields = type(self).model_fields
        for name in sorted(self.model_fields_set & self.REFUSED.keys()):
            if getattr(self, name) != fields[name].default:
                reason = self.REFUSED[name]
                raise field_error(name, f"'{name}' is not supported: {reason}")
        return self


class StreamOptions(StrictBody):
    """`stream_options` of a streamed request."""

    include_usage: bool = False


class _SamplingFields(StrictBody):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=128)
    """Choices per prompt (the engine's fan-out: one prefill, n sequences)."""
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    """Token id (as a string, OpenAI's form) -> bias in [-100, 100]."""
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    user: str | None = None
    """Honoured: logged (logger `gpu_runtime.server.completion_routes`, INFO) with the
    response id and the request's `x-request-id`, so abuse reports can name the end user."""
    response_format: ResponseFormat | None = None
    """Constrains the output to JSON (an object, or matching a schema): `response_format.py`."""

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias[{key}]={bias} must be in [-100, 100]")
        return value

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) pairs."""
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> Self:
        if self.stream_options is not None and not self.stream:
            raise field_error(
                "stream_options", "'stream_options' is only allowed when 'stream' is true"
            )
        return self

    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions body. `prompt`: text, token ids, or a list of either (one choice
    per prompt)."""

    REFUSED: ClassVar[Mapping[str, str]] = REFUSED_COMPLETION

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    """Prepend the prompt to each choice's text (and, with `logprobs`, its tokens' logprobs,
    the first null)."""
    best_of: int | None = Field(default=None, ge=1, le=128)
    """Sequences generated per prompt, of which the `n` with the highest cumulative logprob
    are returned (at least `n`; not with `stream` when above `n`)."""
    suffix: str | None = None

    def sequences(self) -> int:
        """Sequences to generate per prompt; 400 naming `best_of` when it is below `n`, or
        above it on a stream."""
        best_of = self.n if self.best_of is None else self.best_of
        if best_of < self.n:
            raise OpenAIError(400, f"best_of ({best_of}) must be >= n ({self.n})", param="best_of")
        if self.stream and best_of > self.n:
            raise OpenAIError(
                400, f"best_of ({best_of}) > n ({self.n}) cannot be streamed", param="best_of"
            )
        return best_of

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions body (messages and tools: `chat_protocol`, `tool_calls`)."""

    REFUSED: ClassVar[Mapping[str, str]] = REFUSED_CHAT

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    store: bool = False
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> Self:
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
        return self
