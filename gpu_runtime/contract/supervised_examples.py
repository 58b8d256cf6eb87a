"""The two supervised formats, record to :class:`TokenizedExample`, with the base model's
tokenizer:

* chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str,
  "weight": 0|1 (assistant only, optional)}, ...]}`` with at least one assistant message of
  weight 1. Rendered with the tokenizer's chat template (:mod:`gpu_runtime.contract.chat`); only
  assistant tokens (their end-of-turn marker included) carry labels.
* prompt/completion: ``{"prompt": str, "completion": str}``. The text ``prompt + completion`` is
  tokenized with the tokenizer's special tokens (BOS); the tokenizer's EOS is appended; only the
  completion tokens and that EOS carry labels. A token that straddles the boundary counts as a
  completion token.

A record that breaks its format raises :class:`ExampleError` (the reason, without a location).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpu_runtime.contract.chat import (
    CHAT_ROLES,
    ChatMessage,
    ChatTemplateError,
    ChatTokenizer,
    render_chat_with_loss_spans,
)
from gpu_runtime.contract.training_examples import IGNORE_INDEX, ExampleError, TokenizedExample


def parse_chat_messages(raw: Any) -> list[ChatMessage]:
    """A chat record's ``messages`` (the chat rule of the module docstring)."""
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


def tokenize_chat_record(tokenizer: ChatTokenizer, record: dict[str, Any]) -> TokenizedExample:
    """Check and tokenize one chat record (it has ``messages``)."""
    messages = parse_chat_messages(record["messages"])
    try:
        return tokenize_chat(tokenizer, messages)
    except ChatTemplateError as exc:
        raise ExampleError(str(exc)) from exc


def tokenize_prompt_completion_record(
    tokenizer: ChatTokenizer, record: dict[str, Any]
) -> TokenizedExample:
    """Check and tokenize one prompt/completion record (it has both keys)."""
    prompt, completion = record["prompt"], record["completion"]
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise ExampleError("'prompt' and 'completion' must be strings")
    if not completion:
        raise ExampleError("'completion' is empty")
    return tokenize_prompt_completion(tokenizer, prompt, completion)
