"""The upload check of a training file (JSONL, one example per line): every line against its
format's record rule, without a tokenizer, so the control plane reports every bad line of an
upload at once.

Three formats, one per file (names in `training_data`):
- chat: `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}` with at
  least one assistant message (the part the model learns), none of them empty;
- prompt/completion: `{"prompt": "...", "completion": "..."}`;
- preference (DPO jobs only, OpenAI's): `{"input": {"messages": [...]}, "preferred_output":
  [{"role": "assistant", "content": "..."}], "non_preferred_output": [...]}`; `input.tools` is
  refused (no tool use in training), `input.parallel_tool_calls` may only be a boolean. This
  rule is the hosts' own (`training_data.parse_preference_record`).
Blank lines are skipped. Errors carry 1-based physical line numbers. A file that passes is
tokenized with the same rules as the hosts (`training_data.tokenize_training_lines`) before a
job may train on it; that pass also checks what needs the tokenizer (lengths, loss weights).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gpu_runtime.contract.chat import CHAT_ROLES
from gpu_runtime.contract.training_data import (
    CHAT_FORMAT,
    PREFERENCE_FORMAT,
    PREFERENCE_KEYS,
    PROMPT_COMPLETION_FORMAT,
    ExampleError,
    parse_preference_record,
)

MAX_REPORTED_ERRORS = 10


@dataclass
class TrainingFileReport:
    """What validation found: the format, the number of examples, and each bad line."""

    format: str | None = None
    example_count: int = 0
    errors: list[tuple[int, str]] = field(default_factory=list)
    error_count: int = 0

    def add_error(self, line_number: int, message: str) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append((line_number, message))


def _chat_error(example: dict[str, Any]) -> str | None:
    messages = example.get("messages")
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    has_assistant = False
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{index}] must be an object"
        role = message.get("role")
        if role not in CHAT_ROLES:
            return (
                f"messages[{index}].role must be one of {', '.join(sorted(CHAT_ROLES))}, "
                f"got {role!r}"
            )
        content = message.get("content")
        if not isinstance(content, str):
            return f"messages[{index}].content must be a string"
        if role == "assistant":
            if not content:
                return f"messages[{index}].content of an assistant message must not be empty"
            has_assistant = True
    if not has_assistant:
        return "a chat example needs at least one assistant message"
    return None


def _prompt_completion_error(example: dict[str, Any]) -> str | None:
    if not isinstance(example.get("prompt"), str):
        return "'prompt' must be a string"
    completion = example.get("completion")
    if not isinstance(completion, str) or not completion:
        return "'completion' must be a non-empty string"
    return None


def _preference_error(example: dict[str, Any]) -> str | None:
    """The hosts' own rule (`training_data.parse_preference_record`), which needs no
    tokenizer."""
    try:
        parse_preference_record(example)
    except ExampleError as exc:
        return str(exc)
    return None


def _example_format(example: dict[str, Any]) -> str | None:
    if PREFERENCE_KEYS & set(example):
        return PREFERENCE_FORMAT
    if "messages" in example:
        return CHAT_FORMAT
    if "prompt" in example or "completion" in example:
        return PROMPT_COMPLETION_FORMAT
    return None


FORMAT_CHECKERS: dict[str, Callable[[dict[str, Any]], str | None]] = {
    CHAT_FORMAT: _chat_error,
    PROMPT_COMPLETION_FORMAT: _prompt_completion_error,
    PREFERENCE_FORMAT: _preference_error,
}
"""Per format: the check of one example, returning what is wrong with it or None."""


def validate_training_lines(lines: Iterable[bytes]) -> TrainingFileReport:
    """Check every line; return the report (never raises for bad content)."""
    report = TrainingFileReport()
    for line_number, raw in enumerate(lines, start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            report.add_error(line_number, "not valid UTF-8")
            continue
        if not text.strip():
            continue
        try:
            example = json.loads(text)
        except json.JSONDecodeError as exc:
            report.add_error(line_number, f"not valid JSON ({exc.msg} at column {exc.colno})")
            continue
        if not isinstance(example, dict):
            report.add_error(line_number, "each line must be a JSON object")
            continue
        line_format = _example_format(example)
        if line_format is None:
            report.add_error(
                line_number,
                "expected a chat example ('messages'), 'prompt' and 'completion', or a "
                "preference example ('input', 'preferred_output', 'non_preferred_output')",
            )
            continue
        problem = FORMAT_CHECKERS[line_format](example)
        if problem:
            report.add_error(line_number, problem)
            continue
        # The first valid example fixes the file's format.
        if report.format is None:
            report.format = line_format
        elif line_format != report.format:
            report.add_error(
                line_number, f"format {line_format} differs from earlier lines ({report.format})"
            )
            continue
        report.example_count += 1
    return report


METHOD_FORMATS = {
    "supervised": (CHAT_FORMAT, PROMPT_COMPLETION_FORMAT),
    "dpo": (PREFERENCE_FORMAT,),
}
"""The file formats each job method trains on."""
