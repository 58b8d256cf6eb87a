"""The chat request's messages and tools, validated (OpenAI's shapes).

A message's ``content`` is a string, a list of parts, or null (an assistant message that only
calls tools). Text parts are joined with ``"\\n"`` (as vLLM joins them); any other part type
(``image_url``, ``input_audio``, ``file``, ``refusal``) is refused with a 400 naming the message's
``content``: the served models are text-only. Roles: ``system``, ``developer`` (rendered as
``system``, which is what it replaces), ``user``, ``assistant`` (optionally with ``tool_calls``,
whose ``function.arguments`` must be a JSON object in a string) and ``tool`` (with
``tool_call_id``). `ChatMessage.template_dict` is what the chat template receives.

Tools are ``{"type": "function", "function": {"name", "description"?, "parameters"?,
"strict"?}}``; ``parameters`` must be a valid JSON schema of an object.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
"""OpenAI's rule for a function's name."""


def _joined_text(content: str | list[dict[str, Any]] | None) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return "\n".join(str(part["text"]) for part in content)


class FunctionCall(BaseModel):
    """A call's function: its name and its arguments as a JSON string."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    arguments: str
    parsed_arguments: Any = None
    """The openai client's parsed copy of `arguments`, which it sends back with a message
    accumulated from a stream; `arguments` is what is rendered."""

    @field_validator("arguments")
    @classmethod
    def _arguments_are_an_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"arguments must be a JSON object in a string: {exc}") from exc
        if not isinstance(parsed, dict):
            raise ValueError(f"arguments must be a JSON object, not {type(parsed).__name__}")
        return value


class AssistantToolCall(BaseModel):
    """One entry of an assistant message's ``tool_calls``."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = Field(default=None, ge=0)
    """The call's position in a stream, which the openai client keeps in a message it
    accumulated; the calls are rendered in list order."""


class ChatMessage(BaseModel):
    """One chat message (see the module docstring for what each role may carry)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = Field(default=None, min_length=1)
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = Field(default=None, min_length=1)
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: None = None
    """Fields of a response message that a client may send back in the history: only null
    (a refusal, audio or the deprecated function_call cannot be rendered)."""
    parsed: Any = None
    """The openai client's parsed copy of the content (`response_format` helpers), sent back
    with the message; `content` is what is rendered."""

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        # one error naming `content` (not each member of its union)
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list) or not all(isinstance(p, dict) for p in value):
            raise ValueError("content must be a string, a list of content parts, or null")
        return value

    @field_validator("content")
    @classmethod
    def _text_parts_only(
        cls, value: str | list[dict[str, Any]] | None
    ) -> str | list[dict[str, Any]] | None:
        if not isinstance(value, list):
            return value
        for j, part in enumerate(value):
            kind = part.get("type")
            if kind != "text":
                raise ValueError(
                    f"part {j} has type {kind!r}: only 'text' parts are accepted, the models "
                    "served here are text-only"
                )
            if not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
                raise ValueError(f"part {j} must be {{'type': 'text', 'text': <string>}}")
        return value

    @model_validator(mode="after")
    def _fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls are only allowed on assistant messages, not {self.role}")
        if self.tool_calls is not None and not self.tool_calls:
            raise ValueError("tool_calls must not be empty (leave it out instead)")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise ValueError("tool_call_id is required on tool messages and only allowed there")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"content is required on a {self.role} message without tool_calls")
        return self

    def text(self) -> str | None:
        """The content as one string (text parts joined), None when absent."""
        return _joined_text(self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: only the keys it has (templates test
        ``'tool_calls' in message``), ``developer`` as ``system``, and each call's arguments
        parsed to an object (templates render them with ``tojson``)."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDefinition(BaseModel):
    """A tool's function. ``strict`` asks for arguments that match ``parameters`` exactly:
    with ``tool_choice`` ``auto`` it makes decoding constrained (`tool_constraints`), as
    ``required`` and a named function always are."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return value
        from jsonschema import SchemaError, validators

        try:
            validators.validator_for(value).check_schema(value)
        except SchemaError as exc:
            raise ValueError(f"parameters is not a valid JSON schema: {exc.message}") from exc
        if value.get("type", "object") != "object":
            raise ValueError(f"parameters must describe an object, not type {value['type']!r}")
        return value

    def parameters_schema(self) -> dict[str, Any]:
        """``parameters``, or the schema of an empty object when the function takes none."""
        return self.parameters or {"type": "object", "properties": {}}


class ToolDefinition(BaseModel):
    """One entry of ``tools``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function: the answer is exactly one call to it."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


TOOL_CHOICE_MODES = ("none", "auto", "required")


def tool_choice_of(value: Any) -> Any:
    """``tool_choice`` checked as a whole (one error naming the field, not each member of its
    union): one of `TOOL_CHOICE_MODES` or a `NamedToolChoice`."""
    if value is None or value in TOOL_CHOICE_MODES or isinstance(value, NamedToolChoice):
        return value
    if isinstance(value, dict):
        try:
            return NamedToolChoice.model_validate(value)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"{where}: {first['msg']}") from None
    raise ValueError(
        "tool_choice must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}"
    )


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice, BeforeValidator(tool_choice_of)
]
