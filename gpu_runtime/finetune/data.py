"""Training files to the token sequences a trainer takes.

The rule (formats, labels, the length limit) is :mod:`gpu_runtime.contract.training_data`, which
the control plane applies to the same files before it queues a job; this module reads files for
the trainer with it. An example longer than ``max_seq_len`` is refused, never cut.
Supervised trainers take chat and prompt/completion files; DPO's preference files are read by
:mod:`gpu_runtime.finetune.preference_data`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpu_runtime.contract.chat import ChatTokenizer
from gpu_runtime.contract.training_data import (
    ExamplesTooLongError,
    TrainingDataError,
    tokenize_training_lines,
)
from gpu_runtime.contract.training_examples import IGNORE_INDEX, TokenizedExample

__all__ = [
    "IGNORE_INDEX",
    "ExamplesTooLongError",
    "TokenizedDataset",
    "TokenizedExample",
    "TrainingDataError",
    "tokenize_lines",
]


@dataclass(frozen=True)
class TokenizedDataset:
    """All usable examples of one file, plus what was dropped."""

    examples: tuple[TokenizedExample, ...]
    data_format: str
    num_lines: int
    num_dropped_no_loss_tokens: int

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.examples)


def tokenize_lines(
    lines: Iterable[bytes | str],
    tokenizer: ChatTokenizer,
    max_seq_len: int,
    source: str = "<lines>",
) -> TokenizedDataset:
    """Parse and tokenize JSONL lines (blank lines skipped). ``source`` names them in errors.
    A preference file is refused: it trains only a DPO job."""
    tokenized = tokenize_training_lines(lines, tokenizer, max_seq_len, source)
    examples = tuple(e for e in tokenized.examples if isinstance(e, TokenizedExample))
    if tokenized.data_format == "preference" or len(examples) != len(tokenized.examples):
        raise TrainingDataError(
            source, None, "a preference (DPO) file trains only a job whose method is 'dpo'"
        )
    return TokenizedDataset(
        examples=examples,
        data_format=tokenized.data_format,
        num_lines=tokenized.num_lines,
        num_dropped_no_loss_tokens=tokenized.num_dropped_no_loss_tokens,
    )
