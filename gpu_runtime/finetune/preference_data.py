"""DPO training files (OpenAI's preference format) to pairs of token sequences.

The format and its tokenization are the contract's
(:mod:`gpu_runtime.contract.preference_examples`, read by
:mod:`gpu_runtime.contract.training_data` as format ``preference``), the rule the control plane
checked the file against before queueing: each output becomes a chat example of the input
messages plus that one assistant message, so both rows of a pair share the prompt tokens and
only the outputs carry labels. A pair whose longer row exceeds ``max_seq_len`` is refused, never
cut.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpu_runtime.contract.chat import ChatTokenizer
from gpu_runtime.contract.preference_examples import tokenize_preference_pair
from gpu_runtime.contract.training_data import TrainingDataError, tokenize_training_lines
from gpu_runtime.contract.training_examples import PreferencePair

__all__ = [
    "PreferenceDataset",
    "PreferencePair",
    "tokenize_preference_lines",
    "tokenize_preference_pair",
]


@dataclass(frozen=True)
class PreferenceDataset:
    """All usable pairs of one preference file, plus how many were dropped."""

    pairs: tuple[PreferencePair, ...]
    num_lines: int
    num_dropped_no_loss_tokens: int


def tokenize_preference_lines(
    lines: Iterable[bytes | str],
    tokenizer: ChatTokenizer,
    max_seq_len: int,
    source: str = "<lines>",
) -> PreferenceDataset:
    """Parse and tokenize preference JSONL lines (blank lines skipped); TrainingDataError names
    ``source`` and the line, ExamplesTooLongError lists pairs over ``max_seq_len``."""
    tokenized = tokenize_training_lines(lines, tokenizer, max_seq_len, source)
    pairs = tuple(e for e in tokenized.examples if isinstance(e, PreferencePair))
    if tokenized.data_format != "preference" or len(pairs) != len(tokenized.examples):
        raise TrainingDataError(
            source, None, f"a DPO job needs a preference file, not {tokenized.data_format}"
        )
    return PreferenceDataset(pairs, tokenized.num_lines, tokenized.num_dropped_no_loss_tokens)
