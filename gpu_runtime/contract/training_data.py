"""Training files to token sequences with loss labels: the one rule the control plane (which
refuses a job whose files break it, before queueing) and the hosts (which train on the result)
both apply.

JSONL, one JSON object per line, one format per file (the first example fixes it); lines are the
file's bytes split at ``\\n``, ``\\r\\n`` or ``\\r`` (as the upload check splits them), numbered
from 1, blank ones skipped. Formats, each one function in :data:`FORMAT_TOKENIZERS` (a new format
is one more function and its key test in :func:`detect_format`): chat and prompt/completion
(:mod:`gpu_runtime.contract.supervised_examples`) and preference
(:mod:`gpu_runtime.contract.preference_examples`), whose rules those modules state. What a line
becomes (a :class:`TokenizedExample` or a :class:`PreferencePair`, labels aligned with
``input_ids``) is :mod:`gpu_runtime.contract.training_examples`; for a pair the length limit
applies to the longer row.

An example longer than the job's ``max_seq_len`` (:func:`training_max_seq_len` of the base
model's context length) is refused, never cut: :class:`ExamplesTooLongError` lists such lines
with their token counts. One with no loss token (nothing to learn) is dropped and counted.
Errors name the file by the caller's label (a file id for tenants) and the line number, never by
a storage location.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gpu_runtime.contract.chat import ChatTokenizer
from gpu_runtime.contract.preference_examples import tokenize_preference_record
from gpu_runtime.contract.supervised_examples import (
    tokenize_chat_record,
    tokenize_prompt_completion_record,
)
from gpu_runtime.contract.training_examples import (
    ExampleError,
    TrainingExample,
    longest_row_tokens,
)

CHAT_FORMAT = "chat"
PROMPT_COMPLETION_FORMAT = "prompt_completion"
PREFERENCE_FORMAT = "preference"
"""The format names a file is recorded with (its first example fixes it)."""
MAX_TRAINING_SEQ_LEN = 2048
"""The longest sequence any job trains on, whatever the base model's context length."""
MAX_LISTED_EXAMPLES = 10
"""An error about too-long examples lists this many, then counts the rest."""


def training_max_seq_len(context_length: int) -> int:
    """The most tokens one training example of a base model with `context_length` may have."""
    return min(context_length, MAX_TRAINING_SEQ_LEN)


class TrainingDataError(ValueError):
    """A file that cannot be trained on: `source` (the caller's label for the file), the
    1-based `line_number` (None: the file as a whole) and the `reason`."""

    def __init__(self, source: str, line_number: int | None, reason: str) -> None:
        where = source if line_number is None else f"{source}, line {line_number}"
        super().__init__(f"{where}: {reason}")
        self.source = source
        self.line_number = line_number
        self.reason = reason


@dataclass(frozen=True)
class OverlongExample:
    """An example with more tokens than the limit."""

    line_number: int
    num_tokens: int


class ExamplesTooLongError(TrainingDataError):
    """Examples longer than `max_seq_len`: all of them in `examples`, the first
    :data:`MAX_LISTED_EXAMPLES` in the message."""

    def __init__(self, source: str, examples: Sequence[OverlongExample], max_seq_len: int) -> None:
        listed = ", ".join(
            f"line {e.line_number} ({e.num_tokens} tokens)" for e in examples[:MAX_LISTED_EXAMPLES]
        )
        more = len(examples) - MAX_LISTED_EXAMPLES
        reason = (
            f"{len(examples)} example(s) longer than the limit of {max_seq_len} tokens: {listed}"
            + (f"; and {more} more" if more > 0 else "")
        )
        super().__init__(source, None, reason)
        self.examples = tuple(examples)
        self.max_seq_len = max_seq_len


@dataclass(frozen=True)
class TokenizedFile:
    """Every usable example of one file, the line each came from, and what was dropped."""

    examples: tuple[TrainingExample, ...]
    line_numbers: tuple[int, ...]
    data_format: str
    num_lines: int
    """Non-blank lines."""
    num_dropped_no_loss_tokens: int


ExampleTokenizer = Callable[[ChatTokenizer, dict[str, Any]], TrainingExample]
FORMAT_TOKENIZERS: dict[str, ExampleTokenizer] = {
    CHAT_FORMAT: tokenize_chat_record,
    PROMPT_COMPLETION_FORMAT: tokenize_prompt_completion_record,
    PREFERENCE_FORMAT: tokenize_preference_record,
}
"""Format name -> the function that checks one record of it and tokenizes it."""


def detect_format(record: dict[str, Any]) -> str:
    """The format of one record, by its keys (ExampleError when none fits)."""
    if "messages" in record:
        return CHAT_FORMAT
    if "prompt" in record and "completion" in record:
        return PROMPT_COMPLETION_FORMAT
    if "input" in record:
        return PREFERENCE_FORMAT
    raise ExampleError(
        "expected an object with 'messages', with 'prompt' and 'completion', or a preference "
        "example ('input', 'preferred_output', 'non_preferred_output'); "
        f"got keys {sorted(record)}"
    )


def jsonl_lines(data: bytes) -> list[bytes]:
    """A file's lines (see the module docstring for where it splits)."""
    return data.splitlines()


def tokenize_training_lines(
    lines: Iterable[bytes | str], tokenizer: ChatTokenizer, max_seq_len: int, source: str
) -> TokenizedFile:
    """Parse and tokenize every line; raise TrainingDataError at the first malformed one, or
    ExamplesTooLongError naming every example over `max_seq_len` (see the module docstring)."""
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
    examples: list[TrainingExample] = []
    line_numbers: list[int] = []
    overlong: list[OverlongExample] = []
    data_format: str | None = None
    num_lines = num_dropped = 0
    for line_number, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        except UnicodeDecodeError:
            raise TrainingDataError(source, line_number, "not valid UTF-8") from None
        if not line.strip():
            continue
        num_lines += 1
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ExampleError("each line must be a JSON object")
            line_format = detect_format(record)
            if data_format is not None and line_format != data_format:
                raise ExampleError(
                    f"line is {line_format} but the file started as {data_format}; "
                    "use one format per file"
                )
            data_format = line_format
            example = FORMAT_TOKENIZERS[line_format](tokenizer, record)
        except json.JSONDecodeError as exc:
            raise TrainingDataError(source, line_number, f"not valid JSON ({exc.msg})") from None
        except ExampleError as exc:
            raise TrainingDataError(source, line_number, str(exc)) from None
        if longest_row_tokens(example) > max_seq_len:
            overlong.append(OverlongExample(line_number, longest_row_tokens(example)))
        elif example.num_loss_tokens == 0:
            num_dropped += 1
        else:
            examples.append(example)
            line_numbers.append(line_number)
    if overlong:
        raise ExamplesTooLongError(source, overlong, max_seq_len)
    if data_format is None or not examples:
        raise TrainingDataError(source, None, f"no usable examples ({num_lines} non-blank lines)")
    return TokenizedFile(
        examples=tuple(examples),
        line_numbers=tuple(line_numbers),
        data_format=data_format,
        num_lines=num_lines,
        num_dropped_no_loss_tokens=num_dropped,
    )
