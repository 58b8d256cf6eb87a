"""Training files to token sequences with loss labels: the one rule the control plane (which
refuses a job whose files break it, before queueing) and the hosts (which train on the result)
both apply.

JSONL, one JSON object per line, one format per file (the first example fixes it); lines are the
file's bytes split at ``\\n``, ``\\r\\n`` or ``\\r`` (as the upload check splits them), numbered
from 1, blank ones skipped. Formats, each one function in :data:`FORMAT_TOKENIZERS` (a new format
is one more function and its key test in :func:`detect_format`):

* chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str,
  "weight": 0|1 (assistant only, optional)}, ...]}`` with at least one assistant message of
  weight 1. Rendered with the tokenizer's chat template (:mod:`gpu_runtime.contract.chat`); only
  assistant tokens (their end-of-turn marker included) carry labels.
* prompt/completion: ``{"prompt": str, "completion": str}``. The text ``prompt + completion`` is
  tokenized with the tokenizer's special tokens (BOS); the tokenizer's EOS is appended; only the
  completion tokens and that EOS carry labels. A token that straddles the boundary counts as a
  completion token.
* preference (DPO): ``{"input": {"messages": [...]}, "preferred_output": [{"role":
  "assistant", "content": str}], "non_preferred_output": [...]}`` (``input.tools`` is refused).
  Each output becomes a chat example of the input messages (no labels) plus that one assistant
  message, so both rows of a :class:`PreferencePair` share the prompt tokens; the length limit
  applies to the longer row.

Labels are aligned with ``input_ids`` (``labels[t]`` is the target for position ``t``; the loss
shifts them), :data:`IGNORE_INDEX` where no loss is taken. An example longer than the job's
``max_seq_len`` (:func:`training_max_seq_len` of the base model's context length) is refused,
never cut: :class:`ExamplesTooLongError` lists such lines with their token counts. One with no
loss token (nothing to learn) is dropped and counted. Errors name the file by the caller's label
(a file id for tenants) and the line number, never by a storage location.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gpu_runtime.contract.chat import (
    CHAT_ROLES,
    ChatMessage,
    ChatTemplateError,
    ChatTokenizer,
    render_chat_with_loss_spans,
)

CHAT_FORMAT = "chat"
PROMPT_COMPLETION_FORMAT = "prompt_completion"
PREFERENCE_FORMAT = "preference"
"""The format names a file is recorded with (its first example fixes it)."""
IGNORE_INDEX = -100
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


class ExampleError(ValueError):
    """One example that breaks its format (the message is the reason, without a location)."""


@dataclass(frozen=True)
class TokenizedExample:
    """One training sequence: ``input_ids`` and aligned ``labels`` (``-100`` = no loss)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.labels):
            raise ValueError(
                f"input_ids ({len(self.input_ids)}) and labels ({len(self.labels)}) differ"
            )
        if not self.input_ids:
            raise ValueError("an example needs at least one token")

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        """Targets that enter the loss: labelled positions after the first (causal shift)."""
        return sum(1 for label in self.labels[1:] if label != IGNORE_INDEX)


@dataclass(frozen=True)
class PreferencePair:
    """One DPO example: the same prompt completed with the preferred and the other output."""

    chosen: TokenizedExample
    rejected: TokenizedExample

    @property
    def num_tokens(self) -> int:
        """Tokens of the pair's two rows padded to the longer one: what a micro-batch computes
        for it (the data stream sizes micro-batches and orders batches by it)."""
        return 2 * self.longest_row_tokens

    @property
    def longest_row_tokens(self) -> int:
        """The longer row's tokens: what the length limit applies to."""
        return max(self.chosen.num_tokens, self.rejected.num_tokens)

    @property
    def num_loss_tokens(self) -> int:
        """1 when both outputs carry labels, else 0: a pair is one term of the DPO loss, whose
        batch value is the mean over pairs (the data stream counts loss terms with this)."""
        return int(self.chosen.num_loss_tokens > 0 and self.rejected.num_loss_tokens > 0)

    @property
    def rows(self) -> tuple[TokenizedExample, TokenizedExample]:
        return self.chosen, self.rejected


TrainingExample = TokenizedExample | PreferencePair
"""What one line of a training file becomes."""


def longest_row_tokens(example: TrainingExample) -> int:
    """The tokens of the longest sequence `example` trains on (the length limit's measure)."""
    if isinstance(example, PreferencePair):
        return example.longest_row_tokens
    return example.num_tokens


@dataclass(frozen=True)
class TokenizedFile:
    """Every usable example of one file, the line each came from, and what was dropped."""

    examples: tuple[TrainingExample, ...]
    line_numbers: tuple[int, ...]
    data_format: str
    num_lines: int
    """Non-blank lines."""
    num_dropped_no_loss_tokens: int


def _parse_messages(raw: Any) -> list[ChatMessage]:
    if not isinstance(raw, list) or not raw:
        raise ExampleError("'messages' must be a non-empty list")
    messages = []
    for j, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ExampleError(f"messages[{j}] must be an object")
        role = item.get("role")
        content = item.get("content")
        if role not in CHAT_ROLES:
            raise ExampleError(
                f"messages[{j}].role is {role!r}; expected one of {', '.join(CHAT_ROLES)}"
            )
        if not isinstance(content, str):
            raise ExampleError(f"messages[{j}].content must be a string")
        weight = item.get("weight", 1)
        if weight not in (0, 1) or isinstance(weight, bool):
            raise ExampleError(f"messages[{j}].weight must be 0 or 1")
        if weight == 0 and role != "assistant":
            raise ExampleError(f"messages[{j}].weight is only allowed on assistant")
        messages.append(ChatMessage(role=role, content=content, weight=weight))
    if not any(m.role == "assistant" and m.weight == 1 for m in messages):
        raise ExampleError("needs at least one assistant message with weight 1")
    return messages


def _tokenize_with_offsets(
    tokenizer: ChatTokenizer, text: str, add_special_tokens: bool
) -> tuple[list[int], list[tuple[int, int]], list[int]]:
    encoded = tokenizer(
        text,
        add_special_tokens=add_special_tokens,
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
    )
    ids = list(encoded["input_ids"])
    offsets = [(int(a), int(b)) for a, b in encoded["offset_mapping"]]
    special = list(encoded["special_tokens_mask"])
    return ids, offsets, special


def tokenize_chat(tokenizer: ChatTokenizer, messages: Sequence[ChatMessage]) -> TokenizedExample:
    """Tokenize one conversation; labels on tokens that start inside an assistant span."""
    rendered = render_chat_with_loss_spans(tokenizer, messages)
    ids, offsets, _ = _tokenize_with_offsets(tokenizer, rendered.text, add_special_tokens=False)
    labels = []
    for token_id, (start, end) in zip(ids, offsets, strict=True):
        trained = end > start and any(a <= start < b for a, b in rendered.loss_spans)
        labels.append(token_id if trained else IGNORE_INDEX)
    return TokenizedExample(tuple(ids), tuple(labels))


def tokenize_prompt_completion(
    tokenizer: ChatTokenizer, prompt: str, completion: str
) -> TokenizedExample:
    """Tokenize ``prompt + completion`` (+ EOS); labels on completion tokens and the EOS."""
    ids, offsets, special = _tokenize_with_offsets(
        tokenizer, prompt + completion, add_special_tokens=True
    )
    boundary = len(prompt)
    labels = [
        token_id if not is_special and end > boundary else IGNORE_INDEX
        for token_id, (_, end), is_special in zip(ids, offsets, special, strict=True)
    ]
    eos = tokenizer.eos_token_id
    if isinstance(eos, int):
        if ids and ids[-1] == eos and special[-1]:
            labels[-1] = eos  # the post-processor already appended EOS
        else:
            ids.append(eos)
            labels.append(eos)
    return TokenizedExample(tuple(ids), tuple(labels))


def _chat_record(tokenizer: ChatTokenizer, record: dict[str, Any]) -> TokenizedExample:
    messages = _parse_messages(record["messages"])
    try:
        return tokenize_chat(tokenizer, messages)
    except ChatTemplateError as exc:
        raise ExampleError(str(exc)) from exc


def _prompt_completion_record(tokenizer: ChatTokenizer, record: dict[str, Any]) -> TokenizedExample:
    prompt, completion = record["prompt"], record["completion"]
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise ExampleError("'prompt' and 'completion' must be strings")
    if not completion:
        raise ExampleError("'completion' is empty")
    return tokenize_prompt_completion(tokenizer, prompt, completion)


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
    messages = []
    for j, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ExampleError(f"input.messages[{j}] must be an object")
        role, content = item.get("role"), item.get("content")
        if role not in CHAT_ROLES:
            raise ExampleError(
                f"input.messages[{j}].role must be one of {', '.join(sorted(CHAT_ROLES))}, "
                f"got {role!r}"
            )
        if not isinstance(content, str):
            raise ExampleError(f"input.messages[{j}].content must be a string")
        messages.append(ChatMessage(role=role, content=content, weight=0))
    return messages


def parse_preference_record(
    record: dict[str, Any],
) -> tuple[list[ChatMessage], ChatMessage, ChatMessage]:
    """A preference example's prompt messages, preferred and other output; ExampleError (the
    reason, without a location) when it breaks the format. Needs no tokenizer: the upload
    check applies it before any tokenizer is at hand."""
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


def _preference_record(tokenizer: ChatTokenizer, record: dict[str, Any]) -> PreferencePair:
    return tokenize_preference_pair(tokenizer, *parse_preference_record(record))


ExampleTokenizer = Callable[[ChatTokenizer, dict[str, Any]], TrainingExample]
FORMAT_TOKENIZERS: dict[str, ExampleTokenizer] = {
    CHAT_FORMAT: _chat_record,
    PROMPT_COMPLETION_FORMAT: _prompt_completion_record,
    PREFERENCE_FORMAT: _preference_record,
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
