"""Training files to token sequences with loss labels.

Two JSONL formats are read, one JSON object per line, one format per file:

* chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str,
  "weight": 0|1 (assistant only, optional)}, ...]}`` with at least one assistant message.
  Rendered with the tokenizer's chat template (see :mod:`gpu_runtime.finetune.chat`); only
  assistant tokens (their end-of-turn marker included) carry labels.
* prompt/completion: ``{"prompt": str, "completion": str}``. The text ``prompt + completion`` is
  tokenized with the tokenizer's special tokens (BOS); the tokenizer's EOS is appended; only the
  completion tokens and that EOS carry labels. A token that straddles the boundary counts as a
  completion token.

A third format, DPO's preference pairs, is read by :mod:`gpu_runtime.finetune.preference_data`
with this module's chat tokenization.

Labels are aligned with ``input_ids`` (``labels[t]`` is the target for position ``t``; the loss
shifts them), ``-100`` where no loss is taken. Sequences longer than ``max_seq_len`` are cut on the
right; one that has no label left after the cut is dropped and counted. Malformed lines raise
:class:`TrainingDataError` naming the file and line number.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gpu_runtime.finetune.chat import (
    CHAT_ROLES,
    ChatMessage,
    ChatTemplateError,
    ChatTokenizer,
    render_chat_with_loss_spans,
)

IGNORE_INDEX = -100
DataFormat = Literal["chat", "prompt_completion"]


class TrainingDataError(ValueError):
    """A training or validation file that cannot be used; the message names file and line."""


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
class TokenizedDataset:
    """All usable examples of one file, plus what was cut or dropped."""

    examples: tuple[TokenizedExample, ...]
    data_format: DataFormat
    num_lines: int
    num_truncated: int
    num_dropped_no_loss_tokens: int

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.examples)


def _where(path: str, line_number: int) -> str:
    return f"{path}:{line_number}"


def _parse_messages(raw: Any, where: str) -> list[ChatMessage]:
    if not isinstance(raw, list) or not raw:
        raise TrainingDataError(f"{where}: 'messages' must be a non-empty list")
    messages = []
    for j, item in enumerate(raw):
        if not isinstance(item, dict):
            raise TrainingDataError(f"{where}: messages[{j}] must be an object")
        role = item.get("role")
        content = item.get("content")
        if role not in CHAT_ROLES:
            raise TrainingDataError(
                f"{where}: messages[{j}].role is {role!r}; expected one of {', '.join(CHAT_ROLES)}"
            )
        if not isinstance(content, str):
            raise TrainingDataError(f"{where}: messages[{j}].content must be a string")
        weight = item.get("weight", 1)
        if weight not in (0, 1) or isinstance(weight, bool):
            raise TrainingDataError(f"{where}: messages[{j}].weight must be 0 or 1")
        if weight == 0 and role != "assistant":
            raise TrainingDataError(f"{where}: messages[{j}].weight is only allowed on assistant")
        messages.append(ChatMessage(role=role, content=content, weight=weight))
    if not any(m.role == "assistant" and m.weight == 1 for m in messages):
        raise TrainingDataError(f"{where}: needs at least one assistant message with weight 1")
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


def _detect_format(record: dict[str, Any], where: str) -> DataFormat:
    if "messages" in record:
        return "chat"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    raise TrainingDataError(
        f"{where}: expected an object with 'messages', or with 'prompt' and 'completion'; "
        f"got keys {sorted(record)}"
    )


def tokenize_lines(
    lines: Iterable[str], tokenizer: ChatTokenizer, max_seq_len: int, source: str = "<lines>"
) -> TokenizedDataset:
    """Parse and tokenize JSONL lines (blank lines skipped). ``source`` names them in errors."""
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
    examples: list[TokenizedExample] = []
    data_format: DataFormat | None = None
    num_lines = num_truncated = num_dropped = 0
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        num_lines += 1
        where = _where(source, line_number)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TrainingDataError(f"{where}: not valid JSON ({exc.msg})") from exc
        if not isinstance(record, dict):
            raise TrainingDataError(f"{where}: each line must be a JSON object")
        line_format = _detect_format(record, where)
        if data_format is None:
            data_format = line_format
        elif line_format != data_format:
            raise TrainingDataError(
                f"{where}: line is {line_format} but the file started as {data_format}; "
                "use one format per file"
            )
        if line_format == "chat":
            messages = _parse_messages(record["messages"], where)
            try:
                example = tokenize_chat(tokenizer, messages)
            except ChatTemplateError as exc:
                raise TrainingDataError(f"{where}: {exc}") from exc
        else:
            prompt, completion = record["prompt"], record["completion"]
            if not isinstance(prompt, str) or not isinstance(completion, str):
                raise TrainingDataError(f"{where}: 'prompt' and 'completion' must be strings")
            if not completion:
                raise TrainingDataError(f"{where}: 'completion' is empty")
            example = tokenize_prompt_completion(tokenizer, prompt, completion)
        if example.num_tokens > max_seq_len:
            num_truncated += 1
            example = TokenizedExample(
                example.input_ids[:max_seq_len], example.labels[:max_seq_len]
            )
        if example.num_loss_tokens == 0:
            num_dropped += 1
            continue
        examples.append(example)
    if data_format is None or not examples:
        raise TrainingDataError(f"{source}: no usable examples ({num_lines} non-blank lines)")
    return TokenizedDataset(
        examples=tuple(examples),
        data_format=data_format,
        num_lines=num_lines,
        num_truncated=num_truncated,
        num_dropped_no_loss_tokens=num_dropped,
    )


def load_jsonl(path: str | Path, tokenizer: ChatTokenizer, max_seq_len: int) -> TokenizedDataset:
    """Read and tokenize one JSONL training or validation file."""
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as handle:
            return tokenize_lines(handle, tokenizer, max_seq_len, source=str(path))
    except UnicodeDecodeError as exc:
        raise TrainingDataError(f"{path}: not UTF-8 text ({exc.reason})") from exc
