"""What one line of a training file becomes, and the rules every format shares: a tokenized
sequence with aligned loss labels (:class:`TokenizedExample`), a DPO pair of two of them
(:class:`PreferencePair`), the error a record that breaks its format raises
(:class:`ExampleError`), and the shape of one chat message (:func:`parse_message`).

Labels are aligned with ``input_ids`` (``labels[t]`` is the target for position ``t``; the loss
shifts them), :data:`IGNORE_INDEX` where no loss is taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpu_runtime.contract.chat import CHAT_ROLES, ChatMessage

IGNORE_INDEX = -100


class ExampleError(ValueError):
    """One example that breaks its format (the message is the reason, without a location)."""


def parse_message(item: Any, where: str, *, weight: int = 1) -> ChatMessage:
    """One message `item` at `where` (``messages[2]``), given `weight`: an object whose
    ``role`` is one of :data:`CHAT_ROLES` and whose ``content`` is a string, else ExampleError
    naming `where`. The rule of a preference prompt's messages and of the upload check's chat
    messages (the tokenizer's chat rule, :mod:`gpu_runtime.contract.supervised_examples`,
    words its role error differently and also reads ``weight``)."""
    if not isinstance(item, dict):
        raise ExampleError(f"{where} must be an object")
    role, content = item.get("role"), item.get("content")
    if role not in CHAT_ROLES:
        raise ExampleError(
            f"{where}.role must be one of {', '.join(sorted(CHAT_ROLES))}, got {role!r}"
        )
    if not isinstance(content, str):
        raise ExampleError(f"{where}.content must be a string")
    return ChatMessage(role=role, content=content, weight=weight)


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
