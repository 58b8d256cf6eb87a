"""The preference (DPO) format, record to :class:`PreferencePair`:

``{"input": {"messages": [...]}, "preferred_output": [{"role": "assistant", "content": str}],
"non_preferred_output": [...]}``. ``input.tools`` is refused (no tool use in training),
``input.parallel_tool_calls`` may only be a boolean. Each output becomes a chat example
(:func:`gpu_runtime.contract.supervised_examples.tokenize_chat`) of the input messages (no
labels) plus that one assistant message, so both rows of a pair share the prompt tokens.

:func:`parse_preference_record` needs no tokenizer: the upload check and the tokenizer path
apply the same rule, with the same error texts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpu_runtime.contract.chat import ChatMessage, ChatTemplateError, ChatTokenizer
from gpu_runtime.contract.supervised_examples import tokenize_chat
from gpu_runtime.contract.training_examples import ExampleError, PreferencePair, parse_message

PREFERENCE_KEYS = frozenset({"input", "preferred_output", "non_preferred_output"})


def _preference_output(raw: Any, name: str) -> ChatMessage:
    if not isinstance(raw, list) or len(raw) != 1 or not isinstance(raw[0], dict):
        raise ExampleError(f"'{name}' must be a list of exactly one assistant message")
    message = raw[0]
    if message.get("role") != "assistant":
        raise ExampleError(f"{name}[0].role must be 'assistant', got {message.get('role')!r}")
    extra = sorted(set(message) - {"role", "content"})
    if extra:
        raise ExampleError(f"{name}[0] has unsupported field(s): {', '.join(extra)}")
    content = message.get("content")
    if not isinstance(content, str) or not content:
        raise ExampleError(f"{name}[0].content must be a non-empty string")
    return ChatMessage(role="assistant", content=content)


def _preference_prompt(record: dict[str, Any]) -> list[ChatMessage]:
    extra = sorted(set(record) - PREFERENCE_KEYS)
    if extra:
        raise ExampleError(f"a preference example has unsupported field(s): {', '.join(extra)}")
    prompt = record.get("input")
    if not isinstance(prompt, dict):
        raise ExampleError("'input' must be an object with 'messages'")
    if prompt.get("tools"):
        raise ExampleError("input.tools is not supported: preference training uses no tools")
    if not isinstance(prompt.get("tools", []), list):
        raise ExampleError("input.tools must be a list")
    if not isinstance(prompt.get("parallel_tool_calls", False), bool):
        raise ExampleError("input.parallel_tool_calls must be a boolean")
    extra = sorted(set(prompt) - {"messages", "tools", "parallel_tool_calls"})
    if extra:
        raise ExampleError(f"input has unsupported field(s): {', '.join(extra)}")
    raw = prompt.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ExampleError("input.messages must be a non-empty list")
    return [parse_message(item, f"input.messages[{j}]", weight=0) for j, item in enumerate(raw)]


def parse_preference_record(
    record: dict[str, Any],
) -> tuple[list[ChatMessage], ChatMessage, ChatMessage]:
    """A preference example's prompt messages, preferred and other output; ExampleError (the
    reason, without a location) when it breaks the format."""
    prompt = _preference_prompt(record)
    chosen = _preference_output(record.get("preferred_output"), "preferred_output")
    rejected = _preference_output(record.get("non_preferred_output"), "non_preferred_output")
    return prompt, chosen, rejected


def tokenize_preference_pair(
    tokenizer: ChatTokenizer,
    prompt: Sequence[ChatMessage],
    chosen: ChatMessage,
    rejected: ChatMessage,
) -> PreferencePair:
    """Tokenize one pair; labels only on each output (prompt messages carry weight 0)."""
    quiet = [ChatMessage(m.role, m.content, weight=0) for m in prompt]
    try:
        return PreferencePair(
            chosen=tokenize_chat(tokenizer, [*quiet, chosen]),
            rejected=tokenize_chat(tokenizer, [*quiet, rejected]),
        )
    except ChatTemplateError as exc:
        raise ExampleError(str(exc)) from exc


def tokenize_preference_record(tokenizer: ChatTokenizer, record: dict[str, Any]) -> PreferencePair:
    """Check and tokenize one preference record."""
    return tokenize_preference_pair(tokenizer, *parse_preference_record(record))
