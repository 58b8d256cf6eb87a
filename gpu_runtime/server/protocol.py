"""OpenAI-shaped request bodies (validated) and error bodies."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpu_runtime.server.chat_protocol import ChatMessage, ToolChoice, ToolDefinition


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


class StreamOptions(BaseModel):
    """`stream_options` of a request."""

    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=1)
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

    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions body. `prompt`: text, token ids, or a list of either (one choice
    per prompt)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] = False

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

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)
