"""Validation of uploaded training files (JSONL, one example per line).

Three formats, one per file:
- chat: `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}` with at
  least one assistant message (the part the model learns);
- prompt/completion: `{"prompt": "...", "completion": "..."}`;
- preference (DPO jobs only, OpenAI's): `{"input": {"messages": [...]}, "preferred_output":
  [{"role": "assistant", "content": "..."}], "non_preferred_output": [...]}`; `input.tools` is
  refused (no tool use in training), `input.parallel_tool_calls` may only be a boolean.
Blank lines are skipped. Errors carry 1-based physical line numbers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from api.errors import HarliError
from api.models.finetune import FileFormat
from gpu_runtime.contract.training_data import (
    PREFERENCE_KEYS,
    ExampleError,
    parse_preference_record,
)

CHAT_ROLES = frozenset({"system", "user", "assistant"})
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


class TrainingFileError(HarliError):
    """The uploaded file is not a valid training file; the message lists bad lines by number."""

    def __init__(self, report: TrainingFileReport | None, message: str | None = None) -> None:
        if message is None:
            assert report is not None
            listed = "; ".join(f"line {n}: {m}" for n, m in report.errors)
            more = report.error_count - len(report.errors)
            message = f"Invalid training file ({report.error_count} bad line(s)): {listed}" + (
                f"; and {more} more" if more > 0 else ""
            )
        super().__init__(message, code="invalid_file_format", param="file")
        self.report = report


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
    """The hosts' own rule (`gpu_runtime.contract.training_data`), which needs no tokenizer."""
    try:
        parse_preference_record(example)
    except ExampleError as exc:
        return str(exc)
    return None


def _example_format(example: dict[str, Any]) -> str | None:
    if PREFERENCE_KEYS & set(example):
        return FileFormat.PREFERENCE
    if "messages" in example:
        return FileFormat.CHAT
    if "prompt" in example or "completion" in example:
        return FileFormat.PROMPT_COMPLETION
    return None


FORMAT_CHECKERS: dict[str, Callable[[dict[str, Any]], str | None]] = {
    FileFormat.CHAT: _chat_error,
    FileFormat.PROMPT_COMPLETION: _prompt_completion_error,
    FileFormat.PREFERENCE: _preference_error,
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


def check_training_lines(lines: Iterable[bytes]) -> TrainingFileReport:
    """Validate and raise `TrainingFileError` unless every line is a valid example of one format."""
    report = validate_training_lines(lines)
    if report.errors:
        raise TrainingFileError(report)
    if report.example_count == 0:
        raise TrainingFileError(report, "The training file contains no examples.")
    return report


METHOD_FORMATS = {
    "supervised": (FileFormat.CHAT, FileFormat.PROMPT_COMPLETION),
    "dpo": (FileFormat.PREFERENCE,),
}
"""The file formats each job method trains on."""


def check_method_format(*, method: str, file_format: str, file_id: str, param: str) -> None:
    """Raise a 400 unless a `method` job can train on a file of `file_format`."""
    if file_format in METHOD_FORMATS[method]:
        return
    if method == "dpo":
        message = (
            f"File {file_id} is in {file_format or 'an unknown'} format; a DPO job needs a "
            "preference file (lines with 'input', 'preferred_output', 'non_preferred_output')."
        )
    else:
        message = (
            f"File {file_id} holds preference pairs, which only a DPO job trains on; give "
            "method={'type': 'dpo', ...} or a chat or prompt/completion file."
        )
    raise HarliError(message, param=param, code="invalid_file_format")
