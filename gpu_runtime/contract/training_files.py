"""The upload check of a training file (JSONL, one example per line): every line against its
format's record rule, without a tokenizer, so the control plane answers a tenant at upload time
with every bad line of the file at once.

Three formats, one per file (names in `training_data`). A file that passes is tokenized later
with the base model's tokenizer (`training_data.tokenize_training_lines`, the hosts' own pass,
run by the control plane before a job may train on it); that pass stops at the first bad line
and is the final gate: it also checks what needs the tokenizer (lengths, loss tokens). The two
passes share what they can and differ as follows:

- preference (DPO jobs only): one rule, the hosts' own
  (`preference_examples.parse_preference_record`), same acceptance and error texts.
- chat: both take `{"messages": [...]}`, a non-empty list of objects with a `role` of
  system/user/assistant and a string `content`, and need an assistant message. Here each
  message is checked by `training_examples.parse_message` (its role error reads "role must be
  one of ..., got ..."), an assistant message with empty content is refused, and `weight` is
  not read. The tokenizer pass (`supervised_examples.parse_chat_messages`) words the role
  error "role is ...; expected one of ...", accepts an empty assistant message (it may still
  train on its end-of-turn marker), and checks `weight` (0 or 1, 0 on assistant only), so it
  needs an assistant message of weight 1.
- prompt/completion: here a line with `prompt` or `completion` (and neither preference key nor
  `messages`) is of this format, so `{"prompt": ...}` alone is refused as "'completion' must be
  a non-empty string"; `prompt` and `completion` are checked one by one. The tokenizer pass
  takes the format only when both keys are there (`training_data.detect_format`: otherwise the
  line fits no format) and checks "'prompt' and 'completion' must be strings", then a
  non-empty completion.
- detection: here any preference key (`input`, `preferred_output`, `non_preferred_output`)
  makes a preference line, before `messages`; the tokenizer pass looks at `messages` first,
  then `prompt` with `completion`, then `input`.
- the file's format: here the first valid line fixes it and a line of another format is one
  more bad line; the tokenizer pass takes it from the first line.
Blank lines are skipped. Errors carry 1-based physical line numbers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gpu_runtime.contract.preference_examples import PREFERENCE_KEYS, parse_preference_record
from gpu_runtime.contract.training_data import (
    CHAT_FORMAT,
    PREFERENCE_FORMAT,
    PROMPT_COMPLETION_FORMAT,
)
from gpu_runtime.contract.training_examples import ExampleError, parse_message

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
    for index, item in enumerate(messages):
        try:
            message = parse_message(item, f"messages[{index}]")
        except ExampleError as exc:
            return str(exc)
        if message.role == "assistant":
            if not message.content:
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
    """The hosts' own rule (`preference_examples.parse_preference_record`), which needs no
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
