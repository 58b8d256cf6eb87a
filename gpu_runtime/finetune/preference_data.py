"""DPO training files (OpenAI's preference format) to pairs of token sequences.

One JSON object per line: ``{"input": {"messages": [...]}, "preferred_output": [{"role":
"assistant", "content": str}], "non_preferred_output": [...]}`` (``input.tools`` is refused).
Each output becomes a chat example of the input messages plus that one assistant message,
tokenized exactly as chat training data (:func:`gpu_runtime.finetune.data.tokenize_chat`, the
tokenizer's chat template): the prompt is the input rendered up to the generation prompt, and
only the output's tokens (its end-of-turn marker included) carry labels, so both rows of a pair
share the prompt tokens. Malformed lines raise :class:`TrainingDataError` naming file and line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gpu_runtime.finetune.chat import CHAT_ROLES, ChatMessage, ChatTemplateError, ChatTokenizer
from gpu_runtime.finetune.data import TokenizedExample, TrainingDataError, tokenize_chat


@dataclass(frozen=True)
class PreferencePair:
    """One DPO example: the same prompt completed with the preferred and the other output."""

    chosen: TokenizedExample
    rejected: TokenizedExample

    @property
    def num_tokens(self) -> int:
        """Tokens of the pair's two rows padded to the longer one: what a micro-batch computes
        for it (the data stream sizes micro-batches and orders batches by it)."""
        return 2 * max(self.chosen.num_tokens, self.rejected.num_tokens)

    @property
    def num_loss_tokens(self) -> int:
        """1: a pair is one term of the DPO loss, whose batch value is the mean over pairs (the
        data stream's per-batch count of loss terms is then the batch's pair count)."""
        return 1

    @property
    def rows(self) -> tuple[TokenizedExample, TokenizedExample]:
        return self.chosen, self.rejected


@dataclass(frozen=True)
class PreferenceDataset:
    """All usable pairs of one preference file, plus how many were cut or dropped."""

    pairs: tuple[PreferencePair, ...]
    num_lines: int
    num_truncated: int
    num_dropped_no_loss_tokens: int


def _parse_output(raw: Any, name: str, where: str) -> ChatMessage:
    if not isinstance(raw, list) or len(raw) != 1 or not isinstance(raw[0], dict):
        raise TrainingDataError(f"{where}: '{name}' must be a list of one assistant message")
    message = raw[0]
    if message.get("role") != "assistant":
        raise TrainingDataError(f"{where}: {name}[0].role must be 'assistant'")
    content = message.get("content")
    if not isinstance(content, str) or not content:
        raise TrainingDataError(f"{where}: {name}[0].content must be a non-empty string")
    return ChatMessage(role="assistant", content=content)


def _preference_prompt(record: dict[str, Any], where: str) -> list[ChatMessage]:
    prompt = record.get("input")
    if not isinstance(prompt, dict):
        raise TrainingDataError(f"{where}: 'input' must be an object with 'messages'")
    if prompt.get("tools"):
        raise TrainingDataError(f"{where}: input.tools is not supported")
    raw = prompt.get("messages")
    if not isinstance(raw, list) or not raw:
        raise TrainingDataError(f"{where}: input.messages must be a non-empty list")
    messages = []
    for j, item in enumerate(raw):
        role = item.get("role") if isinstance(item, dict) else None
        content = item.get("content") if isinstance(item, dict) else None
        if role not in CHAT_ROLES or not isinstance(content, str):
            raise TrainingDataError(
                f"{where}: input.messages[{j}] needs a role in {', '.join(CHAT_ROLES)} and "
                "string content"
            )
        messages.append(ChatMessage(role=role, content=content, weight=0))
    return messages


def tokenize_preference_pair(
    tokenizer: ChatTokenizer,
    prompt: Sequence[ChatMessage],
    chosen: ChatMessage,
    rejected: ChatMessage,
) -> PreferencePair:
    """Tokenize one pair; labels only on each output (prompt messages carry weight 0)."""
    quiet = [ChatMessage(m.role, m.content, weight=0) for m in prompt]
    return PreferencePair(
        chosen=tokenize_chat(tokenizer, [*quiet, chosen]),
        rejected=tokenize_chat(tokenizer, [*quiet, rejected]),
    )


def _cut(example: TokenizedExample, max_seq_len: int) -> TokenizedExample:
    return TokenizedExample(example.input_ids[:max_seq_len], example.labels[:max_seq_len])


def tokenize_preference_lines(
    lines: Iterable[str], tokenizer: ChatTokenizer, max_seq_len: int, source: str = "<lines>"
) -> PreferenceDataset:
    """Parse and tokenize preference JSONL lines (blank lines skipped). A row longer than
    ``max_seq_len`` is cut on the right; a pair either of whose outputs is then cut away
    entirely is dropped and counted."""
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
    pairs: list[PreferencePair] = []
    num_lines = num_truncated = num_dropped = 0
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        num_lines += 1
        where = f"{source}:{line_number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TrainingDataError(f"{where}: not valid JSON ({exc.msg})") from exc
        if not isinstance(record, dict) or "input" not in record:
            raise TrainingDataError(
                f"{where}: expected a preference example ('input', 'preferred_output', "
                "'non_preferred_output')"
            )
        prompt = _preference_prompt(record, where)
        chosen = _parse_output(record.get("preferred_output"), "preferred_output", where)
        rejected = _parse_output(record.get("non_preferred_output"), "non_preferred_output", where)
        try:
            pair = tokenize_preference_pair(tokenizer, prompt, chosen, rejected)
        except ChatTemplateError as exc:
            raise TrainingDataError(f"{where}: {exc}") from exc
        if max(pair.chosen.num_tokens, pair.rejected.num_tokens) > max_seq_len:
            num_truncated += 1
            pair = PreferencePair(_cut(pair.chosen, max_seq_len), _cut(pair.rejected, max_seq_len))
        if pair.chosen.num_loss_tokens == 0 or pair.rejected.num_loss_tokens == 0:
            num_dropped += 1
            continue
        pairs.append(pair)
    if not pairs:
        raise TrainingDataError(f"{source}: no usable preference pairs ({num_lines} lines)")
    return PreferenceDataset(tuple(pairs), num_lines, num_truncated, num_dropped)
